"""The streamed chat client of the evaluation layer, shared by the agent harness and `clover bench serve`.

One definition of the timings for both: TTFT is request sent -> first streamed text (content,
reasoning or tool-call arguments); every chunk that carries text is recorded with its time and its
number of characters; E2E is request sent -> last event.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class InfraError(RuntimeError):
    """The endpoint could not be reached or answered nonsense (not the model's fault): transport
    errors, 5xx, 429, error events of the server's own failures and unreadable events."""


class ModelError(RuntimeError):
    """The endpoint answered with an error status (or an error event) for a well-formed request."""


class EndpointRefused(RuntimeError):
    """The endpoint refused the request itself (HTTP 401, 403 or 404): a wrong key, model name or URL, which no
    retry mends and which would fail every task run alike."""


class OutOfTime(RuntimeError):
    """The reply was still streaming when the caller's deadline (`stream_chat`'s `deadline_s`) or, once it had
    begun, the request's time limit passed: the model's outcome (too slow), not the infrastructure's."""


@dataclass
class StreamedReply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # {"id", "name", "arguments"} in index order
    usage: dict[str, Any] = field(default_factory=dict)
    finish_reason: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_s: list[float] = field(default_factory=list)      # arrival of each chunk that carried text
    chunk_chars: list[int] = field(default_factory=list)    # its characters


# what one reply may hold, in characters: a line of the stream (one event) and the reply's text (content,
# reasoning, tool arguments); a server past them is broken (a well-formed event of 256 tokens is a few KB)
MAX_LINE_CHARS = 1 << 20
MAX_REPLY_CHARS = 4 << 20
LINE_END = re.compile(r"\r\n|\r|\n")   # SSE's line ends (str.splitlines also splits at others, which JSON may hold)

# the types of error event that say the server failed (OpenAI's and Clover's, vLLM's, others'), not the request
SERVER_ERROR_TYPES = frozenset({"server_error", "rate_limit_error", "internalservererror", "serviceunavailableerror",
                                "overloaded_error"})

# the token counts of `usage` the callers read (integers, or null when the server does not count them)
USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens", "nfe")


def list_models(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> tuple[int, list[str] | None]:
    """GET `base_url`/models: (the HTTP status, the model ids it lists or None). Any answer says the endpoint
    can be reached (a server may list nothing, answer 501, 429, or refuse a key that may still chat);
    InfraError only when it cannot be reached."""
    url = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s, follow_redirects=True)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:   # (InvalidURL: a URL such as http://[::1/v1)
        raise InfraError(f"cannot reach {url}: {one_line(str(exc)) or type(exc).__name__}") from None
    try:
        models = [str(m["id"]) for m in response.json()["data"]] if response.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        models = None
    return response.status_code, models


def one_line(text: str, limit: int = 200) -> str:
    """`text` (an error body: an HTML page, indented JSON) on one line, at most `limit` characters."""
    return " ".join(text.split())[:limit]


def _is_text(x: Any) -> bool:
    return x is None or isinstance(x, str)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _server_fault(error: Any) -> bool:
    """Whether an error event's error says the server failed (a type of SERVER_ERROR_TYPES, a code 5xx or 429)."""
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    code = int(code) if isinstance(code, str) and code.isdigit() and len(code) == 3 else code
    return (str(error.get("type")).lower() in SERVER_ERROR_TYPES
            or (is_int(code) and (500 <= code <= 599 or code == 429)))


def _is_call(tc: Any) -> bool:
    """A streamed tool call's piece: an integer index, an id, a function's name and arguments (each may be left out)."""
    if not isinstance(tc, dict):
        return False
    fn = tc.get("function") or {}
    return (is_int(tc.get("index", 0)) and _is_text(tc.get("id")) and isinstance(fn, dict)
            and _is_text(fn.get("name")) and _is_text(fn.get("arguments")))


def _shape_problem(data: Any) -> str | None:
    """What is wrong with `data`, one parsed event of a chat completion stream, against the shape of OpenAI's
    (None: nothing). Only the fields the client reads are checked; others may be anything."""
    if not isinstance(data, dict):
        return "is not a JSON object"
    usage = data.get("usage")
    if usage is not None and not (isinstance(usage, dict) and all(usage.get(k) is None or is_int(usage[k])
                                                                  for k in USAGE_COUNTS)):
        return "has a usage that is not an object of token counts"
    choices = data.get("choices", [])
    if not isinstance(choices, list) or not all(isinstance(ch, dict) for ch in choices):
        return "has choices that are not a list of objects"
    for ch in choices:
        delta = ch.get("delta", {})
        if not isinstance(delta, dict) or not _is_text(ch.get("finish_reason")):
            return "has a choice whose delta is not an object or whose finish_reason is not a string"
        if not all(_is_text(delta.get(k)) for k in ("content", "reasoning_content", "reasoning")):
            return "has a delta whose text is not a string"
        calls = delta.get("tool_calls") or []
        if not isinstance(calls, list) or not all(_is_call(tc) for tc in calls):
            return "has tool_calls that are not a list of calls (an integer index, an id, a function's name and arguments)"
    return None


def stream_chat(client: httpx.Client, base_url: str, body: dict, api_key: str | None = None,
                timeout_s: float = 600.0, deadline_s: float | None = None) -> StreamedReply:
    """POST `body` (with "stream": true) to `base_url`/chat/completions and read the whole stream. `timeout_s`
    bounds the whole request (httpx's own timeout bounds each read only, so a reply that kept streaming slowly
    ran on): past it, OutOfTime once the reply has begun (its first event came: a slow reply is the model's,
    and retrying it would flatter slow conditions), InfraError before (no answer, a server that never sends
    one). `deadline_s` is the caller's time left (OutOfTime past it); both are checked as each piece of the
    stream arrives. A stream that is not one (another content type, an event that is not JSON
    or not of the OpenAI shape, a line or a reply over MAX_LINE_CHARS or MAX_REPLY_CHARS, no end) is the
    server's fault: InfraError."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = StreamedReply()
    calls: dict[int, dict] = {}
    t0 = time.perf_counter()
    limit = timeout_s if deadline_s is None else min(timeout_s, max(deadline_s, 0.0))
    ended = False   # [DONE] came
    begun = False   # an event came
    size = 0        # the reply's characters so far

    def check_time() -> None:
        spent = time.perf_counter() - t0
        if deadline_s is not None and spent > deadline_s:
            raise OutOfTime(f"the reply was still streaming after {spent:.1f} s, past the task's time")
        if spent > timeout_s and begun:
            raise OutOfTime(f"the reply was still streaming after {spent:.1f} s, past the request's {timeout_s:g} s")
        if spent > timeout_s:
            raise InfraError(f"the request took over {timeout_s:g} s and no reply began")

    def take(line: str) -> None:
        """One line of the stream: an event's data is added to `out`; comments, other fields and blank lines
        (the separators of events) are skipped."""
        nonlocal ended, begun, size
        if not line.startswith("data:"):
            return
        payload = line[5:].removeprefix(" ")   # (SSE: one space after the colon, if any, is not the data's)
        if payload == "[DONE]":
            ended = True
            return
        now = time.perf_counter() - t0
        out.e2e_s = now
        try:
            data = json.loads(payload)
        except (ValueError, RecursionError) as exc:   # (not JSON, an integer of 5000 digits, nesting too deep)
            raise InfraError(f"the stream sent an event that is not JSON ({type(exc).__name__}: "
                             f"{one_line(str(exc))}): {one_line(payload, 80)}") from None
        if isinstance(data, dict) and "error" in data:   # (a failure after the status line was sent)
            fault = InfraError if _server_fault(data["error"]) else ModelError
            raise fault(f"error event: {one_line(str(data['error']))}")
        problem = _shape_problem(data)
        if problem:
            raise InfraError(f"the stream sent an event that {problem}: {one_line(payload, 80)}")
        begun = True
        out.usage = data.get("usage") or out.usage
        chars = 0
        for ch in data.get("choices", []):
            d = ch.get("delta", {})
            thought = d.get("reasoning_content") or d.get("reasoning") or ""
            out.content += d.get("content") or ""
            out.reasoning += thought
            chars += len(d.get("content") or "") + len(thought)
            for tc in d.get("tool_calls") or []:
                slot = calls.setdefault(tc.get("index", 0), {"id": tc.get("id"), "name": "", "arguments": ""})
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
                chars += len(fn.get("arguments") or "")
            out.finish_reason = ch.get("finish_reason") or out.finish_reason
        size += chars
        if size > MAX_REPLY_CHARS:
            raise InfraError(f"the reply grew past {MAX_REPLY_CHARS} characters (does the server keep to max_tokens?)")
        if chars:
            out.ttft_s = now if out.ttft_s is None else out.ttft_s
            out.chunk_s.append(now)
            out.chunk_chars.append(chars)

    try:
        with client.stream("POST", base_url.rstrip("/") + "/chat/completions", json=body, headers=headers,
                           timeout=max(limit, 1e-3)) as r:
            if r.status_code >= 500 or r.status_code == 429:
                raise InfraError(f"HTTP {r.status_code}")
            if r.status_code in (401, 403, 404):
                raise EndpointRefused(f"HTTP {r.status_code}: {_body_start(r)}")
            if r.status_code != 200:
                raise ModelError(f"HTTP {r.status_code}: {_body_start(r)}")
            kind = r.headers.get("content-type", "")
            if kind.split(";")[0].strip().lower() != "text/event-stream":
                raise InfraError(f"the endpoint answered HTTP 200 with {kind or 'no content type'}, not a stream of "
                                 f"events (text/event-stream): {_body_start(r, 80)}")
            # read as it comes, not line by line: a line that never ends would hold the reader past every deadline
            pieces: list[str] = []   # the line read so far
            held = 0
            for text in r.iter_text():
                check_time()
                *whole, rest = LINE_END.split(text)
                for part in whole:
                    if held + len(part) > MAX_LINE_CHARS:   # (a whole line may come in one piece)
                        raise InfraError(f"the stream sent a line of over {MAX_LINE_CHARS} characters")
                    take("".join(pieces) + part)
                    pieces, held = [], 0
                    if ended:
                        break
                if ended:
                    break
                pieces.append(rest)
                held += len(rest)
                if held > MAX_LINE_CHARS:
                    raise InfraError(f"the stream sent a line of over {MAX_LINE_CHARS} characters")
            else:
                take("".join(pieces))   # (a last line without its line end)
    except httpx.TimeoutException as exc:
        if deadline_s is not None and time.perf_counter() - t0 >= deadline_s:   # the task's time ran out first
            raise OutOfTime(f"no reply within the task's time left ({deadline_s:.1f} s)") from exc
        if begun:   # (it stopped part way)
            raise OutOfTime(f"the reply stopped streaming for {limit:g} s") from exc
        raise InfraError(f"{type(exc).__name__}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise InfraError(f"{type(exc).__name__}: {exc}") from exc
    if not ended and out.finish_reason is None:   # (a reply cut short must not be scored as the model's answer)
        raise InfraError("the stream ended without a finish_reason or [DONE]: the reply was cut off")
    out.tool_calls = [calls[k] for k in sorted(calls)]
    out.e2e_s = out.e2e_s or time.perf_counter() - t0
    return out


def _body_start(response: httpx.Response, limit: int = 200) -> str:
    """The start of `response`'s body on one line (an error page may be large, or never end)."""
    data = b""
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) >= limit:
            break
    return one_line(data.decode(errors="replace"), limit)
