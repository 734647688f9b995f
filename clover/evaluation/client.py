"""The streamed chat client of the evaluation layer, shared by the agent harness and `clover bench serve`.

One definition of the timings for both: TTFT is request sent -> first streamed text (content,
reasoning or tool-call arguments); every chunk that carries text is recorded with its time and its
number of characters; E2E is request sent -> last event.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class InfraError(RuntimeError):
    """The endpoint could not be reached or answered nonsense (not the model's fault): transport
    errors, 5xx, 429 and unreadable events."""


class ModelError(RuntimeError):
    """The endpoint answered with an error status (or an error event) for a well-formed request."""


class OutOfTime(RuntimeError):
    """The reply was still streaming when the caller's deadline (`stream_chat`'s `deadline_s`) passed."""


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


def list_models(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> tuple[int, list[str] | None]:
    """GET `base_url`/models: (the HTTP status, the model ids it lists or None). Any answer says the endpoint
    can be reached (a server may list nothing, answer 501, 429, or refuse a key that may still chat);
    InfraError only when it cannot be reached."""
    url = base_url.rstrip("/") + "/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise InfraError(f"cannot reach {url}: {one_line(str(exc)) or type(exc).__name__}") from None
    try:
        models = [str(m["id"]) for m in response.json()["data"]] if response.status_code == 200 else None
    except (ValueError, KeyError, TypeError):
        models = None
    return response.status_code, models


def one_line(text: str, limit: int = 200) -> str:
    """`text` (an error body: an HTML page, indented JSON) on one line, at most `limit` characters."""
    return " ".join(text.split())[:limit]


def stream_chat(client: httpx.Client, base_url: str, body: dict, api_key: str | None = None,
                timeout_s: float = 600.0, deadline_s: float | None = None) -> StreamedReply:
    """POST `body` (with "stream": true) to `base_url`/chat/completions and read the whole stream. `timeout_s`
    bounds the whole request (InfraError past it; httpx's own timeout bounds each read only, so a reply that
    kept streaming slowly ran on), `deadline_s` the caller's time left (OutOfTime past it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    out = StreamedReply()
    calls: dict[int, dict] = {}
    t0 = time.perf_counter()
    limit = timeout_s if deadline_s is None else min(timeout_s, max(deadline_s, 0.0))

    def check_time() -> None:
        spent = time.perf_counter() - t0
        if deadline_s is not None and spent > deadline_s:
            raise OutOfTime(f"the reply was still streaming after {spent:.1f} s, past the task's time")
        if spent > timeout_s:
            raise InfraError(f"the request took over {timeout_s:.0f} s")

    try:
        with client.stream("POST", base_url.rstrip("/") + "/chat/completions", json=body, headers=headers,
                           timeout=max(limit, 1e-3)) as r:
            if r.status_code >= 500 or r.status_code == 429:
                raise InfraError(f"HTTP {r.status_code}")
            if r.status_code != 200:
                raise ModelError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:200]}")
            for line in r.iter_lines():
                check_time()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                out.e2e_s = now
                data = json.loads(line[6:])
                if "error" in data:
                    raise ModelError(str(data["error"])[:200])
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
                if chars:
                    out.ttft_s = now if out.ttft_s is None else out.ttft_s
                    out.chunk_s.append(now)
                    out.chunk_chars.append(chars)
    except httpx.TimeoutException as exc:
        if deadline_s is not None and time.perf_counter() - t0 >= deadline_s:   # the task's time ran out first
            raise OutOfTime(f"no reply within the task's time left ({deadline_s:.1f} s)") from exc
        raise InfraError(f"{type(exc).__name__}: {exc}") from exc
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        raise InfraError(f"{type(exc).__name__}: {exc}") from exc
    out.tool_calls = [calls[k] for k in sorted(calls)]
    out.e2e_s = out.e2e_s or time.perf_counter() - t0
    return out
