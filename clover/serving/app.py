"""`clover serve`: the HTTP routes of the OpenAI-compatible server (FastAPI + uvicorn).

POST /v1/chat/completions and /v1/completions (streaming with server-sent events), GET /v1/models,
/health and /metrics (Prometheus, vLLM's metric names). Concurrent requests share model forwards through
`AsyncEngine`. Clover's own knobs ride as extra body fields: `algorithm`, `block_size`, `threshold`,
`max_accept_per_step`, `top_k`, `repetition_penalty`, `ignore_eos`. Errors have the OpenAI shape
{"error": {"message", "type", "param", "code"}} (`protocol`); bad input never gets a 500.
Chat requests become prompts in `prompts`; /metrics is rendered by `metrics`.

Streaming sends each committed block as one chunk (the spec's streaming unit).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hmac
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from clover.engine.engine import Engine, GenerationResult
from clover.engine.sampling import (
    LOGPROB_ALGORITHMS,
    MAX_LOGPROBS,
    SEED_BOUND,
    InvalidParameter,
    SamplingParams,
    TokenLogprob,
    check_generation_defaults,
)
from clover.engine.structured import Constraint
from clover.model.chat import ChatFormatError, OutputDelta, StreamingParser
from clover.model.config import GenerationConfig
from clover.model.modeling import CloverForCausalLM
from clover.model.tokenizer import Tokenizer, TokenizerError
from clover.serving.async_engine import AsyncEngine, QueueFull, ShuttingDown
from clover.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from clover.serving.metrics import ServerMetrics
from clover.serving.prompts import chat_prompt, constraint_from, messages_from, thinking_from, tools_from
from clover.serving.protocol import (
    MAX_N,
    MAX_STOP_CHARS,
    APIError,
    ChatRequest,
    ClientGone,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
    chunk_event,
    error_event,
    error_response,
    parse_json_body,
    validation_message,
)

# -- the app ----------------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    model_name: str = "clover-tiny"
    api_key: str | None = None
    max_waiting: int = 64
    default_max_tokens: int = 512          # a chat reply that names no max_tokens (what the context leaves, if less)
    default_completion_tokens: int = 16    # a /v1/completions request that names none (OpenAI's and vLLM's 16)
    max_body_bytes: int = 4 << 20           # a larger request body is answered 413 before it is parsed


@dataclass
class _Choice:
    """One sequence of a request: its parser and what it has sent."""

    index: int
    parser: StreamingParser | None
    result: GenerationResult | None = None
    reasoning: str = ""
    content: str = ""
    calls: list[dict] | None = None
    errors: list[str] | None = None


def _token_namer(tokenizer: Tokenizer, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text (decoded alone), or "token_id:{id}" (vLLM's
    return_tokens_as_token_ids, which round-trips exactly)."""
    return (lambda t: f"token_id:{t}") if as_ids else (lambda t: tokenizer.decode([t]))


def _chat_logprobs(name: Callable[[int], str], raw: Callable[[int], bytes], ids: list[int],
                   logprobs: list[TokenLogprob] | None) -> dict | None:
    """OpenAI chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]} (the token's text decoded
    alone, and its bytes: `raw`, part of a character for some, so that the entries' bytes join into the
    reply's text), or None when not requested."""
    if logprobs is None:
        return None

    def entry(token_id: int, lp: float) -> dict:
        return {"token": name(token_id), "logprob": lp, "bytes": list(raw(token_id))}

    return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, b) for a, b in top]}
                        for t, (lp, top) in zip(ids, logprobs, strict=True)]}


def _completion_logprobs(name: Callable[[int], str], ids: list[int], logprobs: list[TokenLogprob | None] | None,
                         offset: int) -> dict:
    """The legacy completions `logprobs`: tokens, token_logprobs, top_logprobs ({token: logprob}) and
    text_offset (from `offset`). A prompt's first token has None (nothing predicts it)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, item in zip(ids, logprobs or [None] * len(ids), strict=True):
        text = name(token_id)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if item is None else item[0])
        out["top_logprobs"].append(None if item is None else {name(a): b for a, b in item[1]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _with_stop(result: GenerationResult) -> tuple[list[int], list]:
    """A reply's tokens and logprobs with the stop token that ended it (as vLLM reports them to scorers:
    lm-eval reads one entry per generated token, the stop token included)."""
    ids, lps = list(result.token_ids), list(result.logprobs or [])
    if result.stop_logprob is not None:
        ids.append(result.stop_logprob[0])
        lps.append(result.stop_logprob[1])
    return ids, lps


class _EventStream(StreamingResponse):
    """Server-sent events whose sequences are aborted as soon as the response ends, however it ends. A client
    gone mid-stream makes Starlette stop reading the body iterator without closing it: the sequences were
    aborted only when Python finalized the generator (at once, as a rule, by reference counting; a test of
    two streams saw the second finish before the first's abort, once in about ten runs: unexplained)."""

    def __init__(self, body: AsyncIterator[str], events: Any) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()   # (`_merged`'s finally: its sequences are aborted)


def build_app(model: CloverForCausalLM, tokenizer: Tokenizer, cfg: ServerConfig, max_batch_size: int = 32,
              generation_defaults: GenerationConfig | dict | None = None, prefix_cache_bytes: int = 0,
              max_prefill_tokens: int | None = None, prefix_state_every: int = 16) -> FastAPI:
    defaults = generation_defaults if isinstance(generation_defaults, GenerationConfig) else \
        GenerationConfig.from_dict(generation_defaults or {})
    # (a bad default would make every request that leaves it unset a 400 blaming the request)
    check_generation_defaults(defaults, model.config.vocab_size, "generation_config.json")
    engine = AsyncEngine(Engine(model, tokenizer, max_batch_size=max_batch_size, prefix_cache_bytes=prefix_cache_bytes,
                                max_prefill_tokens=max_prefill_tokens, prefix_state_every=prefix_state_every),
                         max_waiting=cfg.max_waiting)
    ctx = model.config.max_position_embeddings
    metrics = ServerMetrics(engine, cfg.model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        # graceful: uvicorn has stopped accepting and waited for open responses; what is left gets the grace
        # period (`serve` starts it already at the signal), then a final error event
        await asyncio.to_thread(engine.stop, float(SHUTDOWN_GRACE_S))

    app = FastAPI(title="Clover", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next: Any) -> Any:
        if cfg.api_key and (request.url.path.startswith("/v1/") or request.url.path in PROTECTED):
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, f"Bearer {cfg.api_key}".encode()):  # constant time
                metrics.http_error(401)
                return error_response(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                              "authentication_error", code="invalid_api_key")
        response = await call_next(request)
        if response.status_code >= 400:
            metrics.http_error(response.status_code)
        return response

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> JSONResponse:
        # nobody reads this answer; the status (nginx's "client closed request") shows in the error counts
        return error_response(499, "the client closed the request", code="client_closed_request")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # a request that failed inside the engine (its generation ended with an error) or a bug:
        # the OpenAI error shape with status 500, never a bare traceback page
        logging.getLogger("clover").error("request failed: %s", exc)
        return error_response(500, f"internal error: {exc}", "server_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    async def _body(request: Request, schema: type[BaseModel]) -> Any:
        """The JSON body read up to `max_body_bytes` (413 beyond), parsed off the event loop."""
        limit = cfg.max_body_bytes
        too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        if int(request.headers.get("content-length") or 0) > limit:
            raise too_big
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect as exc:   # the client left before its body arrived: nobody to answer
            raise ClientGone() from exc
        raw = b"".join(chunks)
        try:
            data = await asyncio.to_thread(parse_json_body, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from exc
        except ValueError as exc:   # e.g. an integer of more digits than Python converts (4,300)
            raise APIError(400, f"request body cannot be read: {exc}") from exc
        except RecursionError as exc:
            raise APIError(400, "request body nests too deeply") from exc
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        def validate() -> tuple[Any, tuple[str, str | None] | None]:
            try:
                return schema.model_validate(data), None
            except ValidationError as exc:
                return None, validation_message(exc)

        # off the event loop, its error message too: a body of 60,000 messages took over a second to validate,
        # and one of 110,000 bad ones ~1 s to describe
        req, problem = await asyncio.to_thread(validate)
        if problem is not None:
            raise APIError(400, problem[0], param=problem[1])
        return req

    def _params(req: SamplingRequest, max_new: int | None, prompt_len: int, stop: tuple[str, ...],
                logprobs: int | None = None, constraint: Constraint | None = None,
                scoring: bool = False, default_max: int | None = None) -> SamplingParams:
        """The request's sampling parameters, checked. `scoring`: for a prompt only scored (max_tokens 0 with
        echo), which may fill the whole context (the parameters are those a one-token generation would get)."""
        if req.n > MAX_N:
            raise APIError(400, f"n must be at most {MAX_N}", param="n")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of other than n is not supported (every choice is returned: ask for n)",
                           param="best_of")
        if req.stream_options is not None and not req.stream:   # (as OpenAI and vLLM answer it)
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        _check_model(req.model)
        room = ctx - prompt_len
        if room < (0 if scoring else 1):
            full = ", which leaves no room for a reply" if room == 0 else ""
            raise APIError(400, f"the prompt has {prompt_len} tokens but the context limit is {ctx} tokens{full}",
                           param="messages" if isinstance(req, ChatRequest) else "prompt",
                           code="context_length_exceeded")
        if scoring:
            max_new, room = 1, 1
        if max_new is not None and max_new > room:
            raise APIError(400, f"prompt ({prompt_len} tokens) plus max_tokens ({max_new}) exceeds the context "
                                f"limit of {ctx} tokens", param="max_tokens", code="context_length_exceeded")
        max_new = max_new or min(default_max or cfg.default_max_tokens, room)
        algorithm = req.algorithm
        if logprobs is not None and algorithm is None and defaults.algorithm not in LOGPROB_ALGORITHMS:
            algorithm = "ar"   # a request for logprobs that names no decoder gets one that can give them
        decoding = defaults.merged(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            algorithm=algorithm, block_size=req.block_size, threshold=req.threshold)
        bias = []
        for key, value in (req.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise APIError(400, f"logit_bias keys are token ids, got {key[:40]!r}", param="logit_bias")
            bias.append((int(key), float(value)))
        # validated by the engine when the request is added (`_start_error` names the field)
        return SamplingParams(**decoding, max_new_tokens=max_new, seed=req.seed, stop=stop,
                              ignore_eos=req.ignore_eos, max_accept_per_step=req.max_accept_per_step,
                              logprobs=logprobs, constraint=constraint, logit_bias=tuple(bias),
                              min_tokens=req.min_tokens, stop_token_ids=tuple(req.stop_token_ids or ()),
                              min_p=0.0 if req.min_p is None else req.min_p,
                              include_stop_str_in_output=req.include_stop_str_in_output,
                              cache_salt=req.cache_salt)

    def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise APIError(400, "stop must be up to 16 non-empty strings", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"each stop string must be at most {MAX_STOP_CHARS} characters", param="stop")
        return tuple(stops)

    def _usage(prompt_len: int, choices: list[_Choice]) -> dict:
        completion = sum(c.result.completion_tokens for c in choices if c.result)   # with the stop token, as vLLM
        nfe = sum(c.result.stats.nfe for c in choices if c.result)
        cached = max((c.result.stats.cached_tokens for c in choices if c.result), default=0)
        return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion,
                "prompt_tokens_details": {"cached_tokens": cached}, "nfe": nfe, "tpf": completion / nfe if nfe else 0.0,
                "blocks": sum(c.result.stats.blocks for c in choices if c.result)}

    async def _unless_gone(work: asyncio.Future, watch: asyncio.Future | None) -> asyncio.Future | None:
        """Wait for `work` unless the client hangs up first (`watch`: its next message; then `work` is cancelled
        and ClientGone raised). Returns the watch to go on with: None once a message other than a disconnect
        came (stop watching rather than spin)."""
        while True:
            done, _ = await asyncio.wait({work} | ({watch} if watch else set()), return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return watch
            if watch.result().get("type") == "http.disconnect":
                work.cancel()
                raise ClientGone()
            watch = None

    async def _merged(jobs: list[tuple[list[int], SamplingParams]], request: Request, stream: bool = False
                      ) -> AsyncIterator[tuple[int, Any]]:
        """Events of the sequences of one request ((prompt, params) each: n choices of one or more prompts),
        tagged with their choice index, in arrival order; a sequence's failure is raised as its HTTP error
        (`_start_error`), at the first event or later. A client that hangs up ends the generation: its
        sequences are aborted (ClientGone). A `stream` is watched until its first event only: its response
        starts then, and the server cancels it itself when its client leaves (before, a streamed request whose
        client left while it was queued kept its place and was prefilled and stepped for no one)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ids: list[int], p: SamplingParams) -> None:
            try:
                async for ev in engine.generate(ids, p):
                    await queue.put((i, ev))
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(jobs)]
        # the body is read: the next message from the client's side is its disconnect
        watch = asyncio.ensure_future(request.receive())
        try:
            open_ = len(tasks)
            while open_:
                get = asyncio.ensure_future(queue.get())
                watch = await _unless_gone(get, watch)
                i, item = get.result()
                if item is None:
                    open_ -= 1
                    continue
                if isinstance(item, BaseException):   # this request's failure, whenever it comes: its HTTP error
                    raise _start_error(item) from item
                if stream and watch is not None:
                    watch.cancel()   # (before the response starts its own watch: one receiver at a time)
                    watch = None
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            if watch is not None:
                watch.cancel()

    async def _scored(prompts: list[list[int]], top: int, request: Request) -> list[list]:
        """Each prompt scored on the engine thread, one call at a time (a request of 64 long prompts does not hold
        the engine: generation steps go on between its calls), admitted as a request is (429 when the queue is
        full); a client that hangs up ends it (ClientGone; found by a hostile pass: scoring skipped the queue,
        and a flood of it stalled every other request for tens of seconds, after its clients had gone too)."""
        watch = asyncio.ensure_future(request.receive())   # (the body is read: the next message is a disconnect)
        out = []
        try:
            for j, ids in enumerate(prompts):
                call = asyncio.ensure_future(engine.call(lambda e, ids=ids: e.score(ids, top), admit=j == 0))
                watch = await _unless_gone(call, watch)
                try:
                    out.append(call.result())
                except BaseException as exc:
                    raise _start_error(exc) from exc
        finally:
            if watch is not None:
                watch.cancel()
        return out

    def _n_params(params: SamplingParams, n: int) -> list[SamplingParams]:
        if n == 1:
            return [params]
        return [params.with_(seed=None if params.seed is None else (params.seed + i) % SEED_BOUND) for i in range(n)]

    def _start_error(exc: BaseException) -> APIError:
        """The HTTP error of a request's failure (at its start, or later in a reply sent whole or streamed)."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, QueueFull):
            return APIError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        if isinstance(exc, ShuttingDown):
            return APIError(503, str(exc), "server_error", code="server_shutting_down")
        if isinstance(exc, InvalidParameter):
            return APIError(400, str(exc), param=exc.param)
        if isinstance(exc, ValueError):
            return APIError(400, str(exc))
        return APIError(500, f"internal error: {exc}", "server_error")

    def _check_fits(count: int, param: str) -> None:
        """A request of more sequences (prompts x n) than the batch and the queue hold together could never be
        accepted whole (its sequences are queued one by one): a 400 naming the limit, not a 429 to retry."""
        limit = engine.engine.max_batch_size + engine.max_waiting
        if count > limit:
            raise APIError(400, f"this request asks for {count} sequences (prompts x n); this server takes at most "
                                f"{limit} at once (--max-batch-size {engine.engine.max_batch_size} + --max-queue "
                                f"{engine.max_waiting})", param=param)

    def _check_model(name: str | None) -> None:
        if name is not None and name != cfg.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {cfg.model_name!r}",
                           param="model", code="model_not_found")

    # -- chat ---------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req: ChatRequest = await _body(request, ChatRequest)
        # templating and tokenising run off the event loop: a huge prompt must not stall other requests
        prompt = await asyncio.to_thread(chat_prompt, req, tokenizer)
        ids, thinking = prompt.ids, prompt.thinking
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if req.top_logprobs is not None and req.top_logprobs > MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be at most {MAX_LOGPROBS}", param="top_logprobs")
        max_new = req.max_completion_tokens or req.max_tokens
        want = (req.top_logprobs or 0) if req.logprobs else None
        namer = _token_namer(tokenizer, req.return_tokens_as_token_ids)
        params = _n_params(_params(req, max_new, len(ids), _stops(req.stop), want, prompt.constraint)
                           .with_(cache_points=tokenizer.reply_start(ids)), req.n)
        choices = [_Choice(i, prompt.parser()) for i in range(req.n)]
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        _check_fits(len(params), "n")
        events = _merged([(ids, p) for p in params], request, req.stream)
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None

        async def consume() -> AsyncIterator[tuple[_Choice, OutputDelta, bool, dict | None]]:
            pending = [first] if first else []
            while True:
                if pending:
                    i, ev = pending.pop()
                else:
                    try:
                        i, ev = await events.__anext__()
                    except StopAsyncIteration:
                        return
                c = choices[i]
                delta = c.parser.feed(ev.text)
                if ev.finished:
                    c.result = ev.result
                    tail = c.parser.finish()
                    delta = OutputDelta(delta.reasoning + tail.reasoning, delta.content + tail.content,
                                        delta.tool_calls + tail.tool_calls, tail.errors)
                yield c, delta, ev.finished, _chat_logprobs(namer, tokenizer.token_bytes, ev.token_ids, ev.logprobs)

        def finish_reason(c: _Choice) -> str:
            if c.result.finish_reason == "length":   # cut short, calls or not: OpenAI's "length" tells the client
                return "length"
            return "tool_calls" if c.calls else "stop"

        def tool_call_json(c: _Choice, call: Any) -> dict | None:
            if c.calls and req.parallel_tool_calls is False:
                return None   # one call only: later ones are dropped
            c.calls = c.calls or []
            entry = {"index": len(c.calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments_json()}}
            c.calls.append(entry)
            return entry

        if not req.stream:
            async for c, delta, _, _ in consume():
                c.reasoning += delta.reasoning
                c.content += delta.content
                for call in delta.tool_calls:
                    tool_call_json(c, call)
                if delta.errors:
                    c.errors = delta.errors
            out = []
            for c in choices:
                msg: dict[str, Any] = {"role": "assistant", "content": c.content if (c.content or not c.calls) else None}
                if thinking:
                    msg["reasoning_content"] = msg["reasoning"] = c.reasoning
                if c.calls:
                    msg["tool_calls"] = [{k: v for k, v in e.items() if k != "index"} for e in c.calls]
                item = {"index": c.index, "message": msg, "finish_reason": finish_reason(c),
                        "logprobs": _chat_logprobs(namer, tokenizer.token_bytes, c.result.token_ids, c.result.logprobs)}
                if c.errors:
                    item["clover_parse_errors"] = c.errors
                out.append(item)
            return {"id": rid, "object": "chat.completion", "created": created, "model": cfg.model_name,
                    "choices": out, "usage": _usage(len(ids), choices)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices_: list[dict], usage: dict | None = None) -> str:
            return chunk_event("chat.completion.chunk", rid, created, cfg.model_name, choices_, usage)

        async def sse() -> AsyncIterator[str]:
            for c in choices:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            try:
                async for c, delta, done, logprobs in consume():
                    d: dict[str, Any] = {}
                    if delta.reasoning:
                        d["reasoning_content"] = d["reasoning"] = delta.reasoning
                    if delta.content:
                        d["content"] = delta.content
                    calls = [e for e in (tool_call_json(c, call) for call in delta.tool_calls) if e is not None]
                    if calls:
                        d["tool_calls"] = calls
                    if d or logprobs:
                        item = {"index": c.index, "delta": d, "finish_reason": None}
                        if logprobs:
                            item["logprobs"] = logprobs
                        yield chunk([item])
                    if done:
                        last = {"index": c.index, "delta": {}, "finish_reason": finish_reason(c)}
                        if delta.errors:   # (as the whole reply's choice carries them)
                            last["clover_parse_errors"] = delta.errors
                        yield chunk([last])
            except Exception as exc:  # noqa: BLE001 - reported in the stream, the headers are gone
                yield error_event(_start_error(exc))
                return
            if include_usage:
                yield chunk([], _usage(len(ids), choices))
            yield "data: [DONE]\n\n"

        return _EventStream(sse(), events)

    # -- completions --------------------------------------------------------------------------------------
    MAX_PROMPTS = 64

    async def _prompt_ids(prompt: Any) -> list[tuple[str | None, list[int]]]:
        """The request's prompts (one, or a batch) as (text or None, ids); token ids checked by the engine's
        own check (before anything decodes them)."""
        items = [prompt] if isinstance(prompt, str) or (prompt and all(isinstance(x, int) for x in prompt)) \
            else list(prompt)
        if not items or len(items) > MAX_PROMPTS:
            raise APIError(400, f"give 1 to {MAX_PROMPTS} prompts", param="prompt")
        out = []
        for item in items:
            if not item:
                raise APIError(400, "prompt is empty", param="prompt")
            if isinstance(item, str):
                out.append((item, await asyncio.to_thread(tokenizer.encode, item)))
            else:
                try:
                    out.append((None, engine.engine.check_prompt(item)))
                except InvalidParameter as exc:
                    raise APIError(400, str(exc), param=exc.param) from exc
        return out

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req: CompletionRequest = await _body(request, CompletionRequest)
        prompts = await _prompt_ids(req.prompt)
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens 0 generates nothing; add echo (with logprobs) to score the prompt",
                           param="max_tokens")
        if req.max_tokens == 0 and (req.stream or req.n != 1):   # scoring answers once, whole, per prompt
            raise APIError(400, "scoring a prompt (max_tokens 0 with echo) is neither streamed nor sampled n times",
                           param="stream" if req.stream else "n")
        if req.logprobs is not None and req.logprobs > MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be at most {MAX_LOGPROBS}", param="logprobs")
        stops = _stops(req.stop)
        namer = _token_namer(tokenizer, req.return_tokens_as_token_ids)
        scoring = req.max_tokens == 0
        constraint = await asyncio.to_thread(constraint_from, req)   # (a grammar checked off the event loop, as chat's)
        jobs = [] if scoring else [(ids, p) for _, ids in prompts
                                   for p in _n_params(_params(req, req.max_tokens, len(ids), stops, req.logprobs,
                                                              constraint, default_max=cfg.default_completion_tokens),
                                                      req.n)]
        if scoring:   # the checks a generation gets
            try:
                _params(req, None, max(len(ids) for _, ids in prompts), stops,
                        scoring=True).validate(model.config.vocab_size)
            except InvalidParameter as exc:
                raise APIError(400, str(exc), param=exc.param) from exc
        texts = [text if text is not None else tokenizer.decode(ids) for text, ids in prompts]
        scores: list[list | None] = [None] * len(prompts)
        if req.echo and req.logprobs is not None:
            scores = await _scored([ids for _, ids in prompts], req.logprobs, request)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n = 1 if scoring else req.n
        choices = [_Choice(i, None) for i in range(len(prompts) * n)]
        echo = [(texts[i // n], prompts[i // n][1], scores[i // n]) for i in range(len(choices))]

        def head(i: int) -> tuple[str, dict | None]:
            """What a choice starts with: the echoed prompt and, with logprobs, its scores."""
            if not req.echo:
                return "", None
            text, ids, score = echo[i]
            return text, None if req.logprobs is None else _completion_logprobs(namer, ids, score, 0)

        prompt_tokens = sum(len(ids) for _, ids in prompts)
        if scoring:
            out = []
            for c in choices:
                text, logprobs = head(c.index)
                out.append({"index": c.index, "text": text, "finish_reason": "length", "logprobs": logprobs})
            return {"id": rid, "object": "text_completion", "created": created, "model": cfg.model_name,
                    "choices": out, "usage": _usage(prompt_tokens, [])}

        _check_fits(len(jobs), "n" if req.n > 1 else "prompt")
        events = _merged(jobs, request, req.stream)
        first = await events.__anext__()

        def reason(r: GenerationResult) -> str:
            return "length" if r.finish_reason == "length" else "stop"

        async def each() -> AsyncIterator[tuple[int, Any]]:
            yield first
            async for item in events:
                yield item

        if not req.stream:
            async for i, ev in each():
                if ev.finished:
                    choices[i].result = ev.result
            out = []
            for c in choices:
                text, logprobs = head(c.index)
                if req.logprobs is not None:
                    tail = _completion_logprobs(namer, *_with_stop(c.result), len(text))
                    logprobs = tail if logprobs is None else {k: logprobs[k] + tail[k] for k in logprobs}
                out.append({"index": c.index, "text": text + c.result.text, "finish_reason": reason(c.result),
                            "logprobs": logprobs})
            return {"id": rid, "object": "text_completion", "created": created, "model": cfg.model_name,
                    "choices": out, "usage": _usage(prompt_tokens, choices)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def sse() -> AsyncIterator[str]:
            def body(items: list[dict], usage_: dict | None = None) -> str:
                return chunk_event("text_completion", rid, created, cfg.model_name, items, usage_)

            offsets = [0] * len(choices)
            for c in choices:
                text, logprobs = head(c.index)
                if text:
                    offsets[c.index] = len(text)
                    yield body([{"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": None}])
            try:
                async for i, ev in each():
                    if ev.finished:
                        choices[i].result = ev.result
                    logprobs = None
                    if req.logprobs is not None:
                        ids, lps = ev.token_ids, ev.logprobs or []
                        if ev.finished and ev.result is not None and ev.result.stop_logprob is not None:
                            ids, lps = [*ids, ev.result.stop_logprob[0]], [*lps, ev.result.stop_logprob[1]]
                        logprobs = _completion_logprobs(namer, ids, lps, offsets[i])
                        # each token's text, as the whole reply's offsets count (not the text let out so far,
                        # which holds back a split character or a possible stop string)
                        offsets[i] += sum(map(len, logprobs["tokens"]))
                    yield body([{"index": i, "text": ev.text, "logprobs": logprobs,
                                 "finish_reason": reason(ev.result) if ev.finished else None}])
            except Exception as exc:  # noqa: BLE001 - reported in the stream, the headers are gone
                yield error_event(_start_error(exc))
                return
            if include_usage:
                yield body([], _usage(prompt_tokens, choices))
            yield "data: [DONE]\n\n"

        return _EventStream(sse(), events)

    model_card = {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "clover", "max_model_len": ctx}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    async def model_by_id(model_id: str) -> dict:
        _check_model(model_id)
        return model_card

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req: TokenizeRequest = await _body(request, TokenizeRequest)
        _check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if req.prompt is not None:
            ids = await asyncio.to_thread(tokenizer.encode, req.prompt)
        else:
            try:
                ids = await asyncio.to_thread(tokenizer.encode_chat, messages_from(req.messages), tools=tools_from(req.tools),
                                              add_generation_prompt=req.add_generation_prompt,
                                              enable_thinking=thinking_from(req.chat_template_kwargs))
            except (ChatFormatError, TokenizerError) as exc:
                raise APIError(400, str(exc), param="messages") from exc
        return {"count": len(ids), "max_model_len": ctx, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req: DetokenizeRequest = await _body(request, DetokenizeRequest)
        _check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", param="tokens")
        # off the event loop: a million tokens took 0.5 s, during which no other request was answered
        return {"prompt": await asyncio.to_thread(tokenizer.decode, req.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict:
        """Drop every cached prefix (vLLM's route; SGLang's /flush_cache): requests in flight go on."""
        try:
            blocks, nbytes = await engine.call(lambda e: e.reset_prefix_cache(), admit=False)
        except ValueError as exc:
            raise APIError(400, f"{exc} (clover serve --prefix-cache-bytes)") from exc
        return {"reset": True, "blocks_dropped": blocks, "bytes_dropped": nbytes}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        # 503 where the engine thread has ended (a load balancer or supervisor then takes the server out)
        alive = engine.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped", "running": engine.engine.num_running,
                             "queued": engine.queue_depth}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app


SHUTDOWN_GRACE_S = 30
# routes outside /v1/ that an --api-key protects as well (they run the tokenizer on the caller's text, or drop the
# prefix cache)
PROTECTED = ("/tokenize", "/detokenize", "/reset_prefix_cache")


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """TCP sockets listening on every address `host` resolves to (all interfaces for ""), as uvicorn's
    start-up binds them, but made before the model loads and failing with a ValueError that names the
    address (uvicorn logs the errno and exits 3 from inside its start-up, after the load). They listen at
    once: a second server on the port is refused at its start, and a client that connects during the
    load waits for it instead of being refused."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
                                   flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise ValueError(f"--host {host!r} is not an address to listen on: {getattr(exc, 'strerror', None) or exc}") from None
    socks: list[socket.socket] = []
    for family, kind, proto, _, address in dict.fromkeys(infos):   # (in order, each address once)
        sock = socket.socket(family, kind, proto)
        socks.append(sock)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:   # (its own family only: 0.0.0.0 is bound apart, as asyncio does)
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(2048)   # (uvicorn's default backlog)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL and len(infos) > 1:   # a family the host has not enabled (as asyncio)
                socks.pop().close()
                continue
            for other in socks:
                other.close()
            where = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
            raise ValueError(f"cannot listen on {where}:{port}: {exc.strerror or exc}") from None
        sock.set_inheritable(True)
    if not socks:
        raise ValueError(f"cannot listen on {host}:{port}: none of its addresses is available")
    return socks


def serve(model_dir: str | None, host: str, port: int, api_key: str | None, max_batch_size: int, max_waiting: int,
          dtype: str, device: str, model_name: str | None, prefix_cache_bytes: int = 0,
          max_prefill_tokens: int | None = None, compile: bool = False, prefix_state_every: int = 16) -> None:

    import uvicorn

    from clover.model.checkpoint import load_for_generation

    socks = listening_sockets(host, port)   # before the model loads: a port in use is said at once, in one line
    with contextlib.ExitStack() as closing:   # (closed however the start-up ends)
        for sock in socks:
            closing.enter_context(sock)
        loaded = load_for_generation(model_dir, dtype, device)
        if compile:
            loaded.model.compile_decode()
        name = model_name or (str(model_dir).rstrip("/").split("/")[-1] if model_dir else "clover-tiny")
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            logging.getLogger("clover").warning("serving on %s without --api-key: anyone who can reach it may use it", host)
        app = build_app(loaded.model, loaded.tokenizer, ServerConfig(name, api_key, max_waiting), max_batch_size,
                        loaded.generation, prefix_cache_bytes, max_prefill_tokens, prefix_state_every)
        where = f"[{host}]" if ":" in host else host or "0.0.0.0"   # (an IPv6 address is bracketed in a URL)
        print(f"clover serve: {name} on http://{where}:{port}/v1 (batch {max_batch_size}, queue {max_waiting}, prefix cache "
              f"{prefix_cache_bytes / 2**20:.0f} MiB, {'API key required' if api_key else 'no API key'})", flush=True)
        engine: AsyncEngine = app.state.engine
        if compile:
            print("clover serve: compiling the decoding passes (minutes on a few cores the first time; inductor keeps "
                  "them on disk for the next start)", flush=True)
            engine.engine.warm_up()

        class Server(uvicorn.Server):
            """On SIGTERM / SIGINT the engine gets SHUTDOWN_GRACE_S to finish what is running and then ends the rest
            with a final error event, before uvicorn (which waits longer) closes the connections."""

            def handle_exit(self, sig: int, frame: object) -> None:
                if not self.should_exit:
                    threading.Thread(target=engine.stop, args=(SHUTDOWN_GRACE_S,), daemon=True).start()
                super().handle_exit(sig, frame)

        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S + 10)
        Server(config).run(sockets=socks)

