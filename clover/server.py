"""`clover serve`: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

POST /v1/chat/completions and /v1/completions (streaming with server-sent events), GET /v1/models,
/health and /metrics (Prometheus text). Concurrent requests share model forwards through
`AsyncEngine`. Clover's own knobs ride as extra body fields: `algorithm`, `block_size`, `threshold`,
`max_accept_per_step`, `top_k`, `repetition_penalty`, `ignore_eos`. Errors have the OpenAI shape
{"error": {"message", "type", "param", "code"}}; bad input never gets a 500.

Streaming sends each committed block as one chunk (the spec's streaming unit). `tool_choice`
"required" or a named function is honoured by pre-filling the start of a tool call after an empty
think block (our design: no constrained decoding).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from clover.async_engine import AsyncEngine, QueueFull
from clover.chat import ChatFormatError, OutputDelta, StreamingParser, validate_tools
from clover.config import GenerationConfig
from clover.engine import Engine, GenerationResult
from clover.model import CloverForCausalLM
from clover.sampling import SamplingParams
from clover.tokenizer import Tokenizer

MAX_N = 8
MAX_STOP_CHARS = 1024


class _ClientGone(Exception):
    """The client of a non-streamed request hung up; its generation was stopped."""


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


# -- request schemas ------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class CallFunction(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    user: str | None = None
    # Clover's knobs
    algorithm: Literal["low_confidence", "ar", "verify"] | None = None
    block_size: int | None = Field(default=None, ge=1, le=1024)
    threshold: float | None = Field(default=None, ge=0, le=1)
    max_accept_per_step: int | None = Field(default=None, ge=1)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    ignore_eos: bool = False


class ChatRequest(_Sampling):
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[MessageIn] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# -- the app ----------------------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    model_name: str = "clover-tiny"
    api_key: str | None = None
    max_waiting: int = 64
    default_max_tokens: int = 512
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


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def _event(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


def _chunk_event(obj: str, rid: str, created: int, model: str, choices: list[dict], usage: dict | None = None) -> str:
    """A streamed chunk of a chat (`chat.completion.chunk`) or text (`text_completion`) completion."""
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return _event(body)


def _error_event(err: APIError) -> str:
    """An error after the stream started (the status line is gone): the same body as an HTTP error."""
    return _event({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})


def _validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return (f"{param}: {err.get('msg')}" if param else str(err.get("msg"))), param


def build_app(model: CloverForCausalLM, tokenizer: Tokenizer, cfg: ServerConfig, max_batch_size: int = 32,
              generation_defaults: GenerationConfig | dict | None = None, prefix_cache_bytes: int = 0,
              max_prefill_tokens: int | None = None) -> FastAPI:
    engine = AsyncEngine(Engine(model, tokenizer, max_batch_size=max_batch_size, prefix_cache_bytes=prefix_cache_bytes,
                                max_prefill_tokens=max_prefill_tokens), max_waiting=cfg.max_waiting)
    defaults = generation_defaults if isinstance(generation_defaults, GenerationConfig) else \
        GenerationConfig.from_dict(generation_defaults or {})
    ctx = model.config.max_position_embeddings
    errors: dict[int, int] = {}
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        # graceful: uvicorn has stopped accepting and waited for open responses; what is left gets 30 s
        await asyncio.to_thread(engine.stop, 30.0)

    app = FastAPI(title="Clover", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine

    @app.middleware("http")
    async def _auth_and_count(request: Request, call_next: Any) -> Any:
        if cfg.api_key and request.url.path.startswith("/v1/"):
            sent = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(sent, f"Bearer {cfg.api_key}".encode()):  # constant time
                errors[401] = errors.get(401, 0) + 1
                return _error(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                              "authentication_error", code="invalid_api_key")
        response = await call_next(request)
        if response.status_code >= 400:
            errors[response.status_code] = errors.get(response.status_code, 0) + 1
        return response

    @app.exception_handler(_ClientGone)
    async def _client_gone(request: Request, exc: _ClientGone) -> JSONResponse:
        # nobody reads this answer; the status (nginx's "client closed request") shows in the error counts
        return _error(499, "the client closed the request", code="client_closed_request")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else
                      "invalid_request_error")

    async def _body(request: Request, schema: type[BaseModel]) -> Any:
        """The JSON body read up to `max_body_bytes` (413 beyond), parsed off the event loop."""
        limit = cfg.max_body_bytes
        too_big = APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")
        if int(request.headers.get("content-length") or 0) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            data = await asyncio.to_thread(json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object")
        try:
            return schema.model_validate(data)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise APIError(400, message, param=param) from exc

    def _params(req: _Sampling, max_new: int | None, prompt_len: int, stop: tuple[str, ...]) -> SamplingParams:
        if req.logprobs:
            raise APIError(400, "logprobs are not supported", param="logprobs")
        if req.n > MAX_N:
            raise APIError(400, f"n must be at most {MAX_N}", param="n")
        _check_model(req.model)
        room = ctx - prompt_len
        if room < 1:
            raise APIError(400, f"the prompt has {prompt_len} tokens but the context limit is {ctx} tokens",
                           param="messages", code="context_length_exceeded")
        if max_new is not None and max_new > room:
            raise APIError(400, f"prompt ({prompt_len} tokens) plus max_tokens ({max_new}) exceeds the context "
                                f"limit of {ctx} tokens", param="max_tokens", code="context_length_exceeded")
        max_new = max_new or min(cfg.default_max_tokens, room)
        decoding = defaults.merged(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            algorithm=req.algorithm, block_size=req.block_size, threshold=req.threshold)
        params = SamplingParams(**decoding, max_new_tokens=max_new, seed=req.seed, stop=stop,
                                ignore_eos=req.ignore_eos, max_accept_per_step=req.max_accept_per_step)
        try:
            params.validate(model.config.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        return params

    def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise APIError(400, "stop must be up to 16 non-empty strings", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"each stop string must be at most {MAX_STOP_CHARS} characters", param="stop")
        return tuple(stops)

    def _usage(prompt_len: int, choices: list[_Choice]) -> dict:
        completion = sum(c.result.stats.generated_tokens for c in choices if c.result)
        nfe = sum(c.result.stats.nfe for c in choices if c.result)
        cached = max((c.result.stats.cached_tokens for c in choices if c.result), default=0)
        return {"prompt_tokens": prompt_len, "completion_tokens": completion, "total_tokens": prompt_len + completion,
                "prompt_tokens_details": {"cached_tokens": cached}, "nfe": nfe, "tpf": completion / nfe if nfe else 0.0,
                "blocks": sum(c.result.stats.blocks for c in choices if c.result)}

    async def _merged(ids: list[int], params: list[SamplingParams], request: Request | None = None
                      ) -> AsyncIterator[tuple[int, Any]]:
        """Events of n sequences of one request, tagged with their choice index, in arrival order. With
        `request` (a reply sent whole), a client that hangs up ends the generation: its sequences are
        aborted (a stream is cancelled by the server itself when its client leaves)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, p: SamplingParams) -> None:
            try:
                async for ev in engine.generate(ids, p):
                    await queue.put((i, ev))
            except BaseException as exc:  # noqa: BLE001 - delivered to the consumer
                await queue.put((i, exc))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(params)]
        # the body is read: the next message from the client's side is its disconnect
        watch = asyncio.ensure_future(request.receive()) if request is not None else None
        try:
            open_ = len(tasks)
            while open_:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, watch} - {None}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    if watch.result().get("type") == "http.disconnect":
                        raise _ClientGone()
                    watch = None  # an unexpected message: stop watching rather than spin
                    continue
                i, item = get.result()
                if item is None:
                    open_ -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            if watch is not None:
                watch.cancel()

    def _n_params(params: SamplingParams, n: int) -> list[SamplingParams]:
        if n == 1:
            return [params]
        return [params.with_(seed=None if params.seed is None else params.seed + i) for i in range(n)]

    def _start_error(exc: BaseException) -> APIError:
        if isinstance(exc, QueueFull):
            return APIError(429, str(exc), "rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
        if isinstance(exc, ValueError):
            return APIError(400, str(exc))
        return APIError(500, f"internal error: {exc}", "server_error")

    def _thinking(kwargs: dict | None) -> bool:
        thinking = (kwargs or {}).get("enable_thinking", True)
        if not isinstance(thinking, bool):
            raise APIError(400, "chat_template_kwargs.enable_thinking must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
        return thinking

    def _tools(defs: list[ToolDef] | None) -> list[dict] | None:
        tools = [t.model_dump(exclude_none=True) for t in defs] if defs else None
        try:
            validate_tools(tools)
        except ChatFormatError as exc:
            raise APIError(400, str(exc), param="tools") from exc
        return tools

    def _messages(items: list[MessageIn]) -> list[dict]:
        """OpenAI messages as the chat template takes them (developer -> system, text parts joined)."""
        messages = []
        for m in items:
            d = m.model_dump(exclude_none=True)
            if d["role"] == "developer":
                d["role"] = "system"
            if isinstance(d.get("content"), list):
                d["content"] = "".join(p["text"] for p in d["content"])
            messages.append(d)
        return messages

    def _check_model(name: str | None) -> None:
        if name is not None and name != cfg.model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {cfg.model_name!r}",
                           param="model", code="model_not_found")

    # -- chat ---------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req: ChatRequest = await _body(request, ChatRequest)
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported", param="response_format")
        thinking = _thinking(req.chat_template_kwargs)
        tools = _tools(req.tools)
        choice = req.tool_choice or "auto"
        prefix = ""
        if choice != "auto" and choice != "none" and not tools:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t["function"]["name"] for t in tools}:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                               param="tool_choice")
            prefix, thinking = f"<tool_call>\n<function={choice.function.name}>\n", False
        elif choice == "required":
            prefix, thinking = "<tool_call>\n", False
        messages = _messages(req.messages)
        try:
            # templating and tokenising run off the event loop: a huge prompt must not stall other requests;
            # special tokens come only from the template (message text cannot forge a turn or a mask)
            ids = await asyncio.to_thread(tokenizer.encode_chat, messages, tools=tools if choice != "none" else None,
                                          enable_thinking=thinking, suffix=prefix)
        except ChatFormatError as exc:
            raise APIError(400, str(exc), param="messages") from exc
        max_new = req.max_completion_tokens or req.max_tokens
        params = _n_params(_params(req, max_new, len(ids), _stops(req.stop)), req.n)
        parse_tools = tools if choice != "none" else None
        choices = [_Choice(i, StreamingParser(thinking, parse_tools, calls=choice != "none")) for i in range(req.n)]
        for c in choices:
            c.parser.feed(prefix)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        events = _merged(ids, params, None if req.stream else request)
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            first = None
        except _ClientGone:
            raise
        except BaseException as exc:
            raise _start_error(exc) from exc

        async def consume() -> AsyncIterator[tuple[_Choice, OutputDelta, bool]]:
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
                yield c, delta, ev.finished

        def finish_reason(c: _Choice) -> str:
            if c.calls:
                return "tool_calls"
            return "length" if c.result.finish_reason == "length" else "stop"

        def tool_call_json(c: _Choice, call: Any) -> dict:
            c.calls = c.calls or []
            entry = {"index": len(c.calls), "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments_json()}}
            c.calls.append(entry)
            return entry

        if not req.stream:
            async for c, delta, _ in consume():
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
                item = {"index": c.index, "message": msg, "finish_reason": finish_reason(c), "logprobs": None}
                if c.errors:
                    item["clover_parse_errors"] = c.errors
                out.append(item)
            return {"id": rid, "object": "chat.completion", "created": created, "model": cfg.model_name,
                    "choices": out, "usage": _usage(len(ids), choices)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices_: list[dict], usage: dict | None = None) -> str:
            return _chunk_event("chat.completion.chunk", rid, created, cfg.model_name, choices_, usage)

        async def sse() -> AsyncIterator[str]:
            for c in choices:
                yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            try:
                async for c, delta, done in consume():
                    d: dict[str, Any] = {}
                    if delta.reasoning:
                        d["reasoning_content"] = d["reasoning"] = delta.reasoning
                    if delta.content:
                        d["content"] = delta.content
                    if delta.tool_calls:
                        d["tool_calls"] = [tool_call_json(c, call) for call in delta.tool_calls]
                    if d:
                        yield chunk([{"index": c.index, "delta": d, "finish_reason": None}])
                    if done:
                        yield chunk([{"index": c.index, "delta": {}, "finish_reason": finish_reason(c)}])
            except Exception as exc:  # noqa: BLE001 - reported in the stream, the headers are gone
                yield _error_event(_start_error(exc))
                return
            if include_usage:
                yield chunk([], _usage(len(ids), choices))
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    # -- completions --------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req: CompletionRequest = await _body(request, CompletionRequest)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, "give one prompt per request", param="prompt")
        if not prompts[0]:
            raise APIError(400, "prompt is empty", param="prompt")
        ids = await asyncio.to_thread(tokenizer.encode, prompts[0])
        params = _n_params(_params(req, req.max_tokens, len(ids), _stops(req.stop)), req.n)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        choices = [_Choice(i, None) for i in range(req.n)]
        events = _merged(ids, params, None if req.stream else request)
        try:
            first = await events.__anext__()
        except _ClientGone:
            raise
        except BaseException as exc:
            raise _start_error(exc) from exc

        def reason(r: GenerationResult) -> str:
            return "length" if r.finish_reason == "length" else "stop"

        async def each() -> AsyncIterator[tuple[int, Any]]:
            yield first
            async for item in events:
                yield item

        if not req.stream:
            texts = [prompts[0] if req.echo else "" for _ in choices]
            async for i, ev in each():
                texts[i] += ev.text
                if ev.finished:
                    choices[i].result = ev.result
            return {"id": rid, "object": "text_completion", "created": created, "model": cfg.model_name,
                    "choices": [{"index": c.index, "text": texts[c.index], "finish_reason": reason(c.result),
                                 "logprobs": None} for c in choices], "usage": _usage(len(ids), choices)}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def sse() -> AsyncIterator[str]:
            def body(items: list[dict], usage: dict | None = None) -> str:
                return _chunk_event("text_completion", rid, created, cfg.model_name, items, usage)

            try:
                async for i, ev in each():
                    if ev.finished:
                        choices[i].result = ev.result
                    yield body([{"index": i, "text": ev.text, "logprobs": None,
                                 "finish_reason": reason(ev.result) if ev.finished else None}])
            except Exception as exc:  # noqa: BLE001 - reported in the stream, the headers are gone
                yield _error_event(_start_error(exc))
                return
            if include_usage:
                yield body([], _usage(len(ids), choices))
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

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
                ids = await asyncio.to_thread(tokenizer.encode_chat, _messages(req.messages), tools=_tools(req.tools),
                                              add_generation_prompt=req.add_generation_prompt,
                                              enable_thinking=_thinking(req.chat_template_kwargs))
            except ChatFormatError as exc:
                raise APIError(400, str(exc), param="messages") from exc
        return {"count": len(ids), "max_model_len": ctx, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req: DetokenizeRequest = await _body(request, DetokenizeRequest)
        _check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token {bad} is outside the vocabulary [0, {tokenizer.vocab_size})", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> dict:
        return {"status": "ok", "running": engine.engine.num_running, "queued": engine.queue_depth}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        s = engine.stats
        lines = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {value}" for labels, value in samples)

        metric("clover_requests_total", "counter", "Requests accepted by the engine.", [("", s.requests)])
        metric("clover_requests_rejected_total", "counter", "Requests refused because the queue was full.",
               [("", s.rejected)])
        metric("clover_requests_aborted_total", "counter", "Requests cancelled before the end (disconnects).",
               [("", s.aborted)])
        metric("clover_http_errors_total", "counter", "HTTP error responses by status.",
               [(f'{{status="{k}"}}', v) for k, v in sorted(errors.items())] or [('{status="none"}', 0)])
        metric("clover_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [("", s.prompt_tokens)])
        metric("clover_generation_tokens_total", "counter", "Generated tokens.", [("", s.generated_tokens)])
        metric("clover_nfe_total", "counter", "Model forwards of finished requests (previews + commits).",
               [("", s.nfe)])
        metric("clover_engine_steps_total", "counter", "Engine steps.", [("", s.steps)])
        prefix = engine.engine.prefix
        if prefix is not None:
            ps = prefix.stats
            for key, help_ in (("lookups", "Prompt lookups in the prefix cache."),
                               ("hits", "Lookups that reused at least one cached block."),
                               ("tokens_reused", "Prompt tokens restored from the prefix cache instead of prefilled."),
                               ("evictions", "Blocks evicted from the prefix cache.")):
                metric(f"clover_prefix_cache_{key}_total", "counter", help_, [("", getattr(ps, key))])
            metric("clover_prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", [("", prefix.nbytes)])
        metric("clover_queue_depth", "gauge", "Requests waiting to start.", [("", engine.queue_depth)])
        metric("clover_running_requests", "gauge", "Requests being decoded.", [("", engine.engine.num_running)])
        for name, hist, help_ in (("clover_request_latency_seconds", s.latency, "End-to-end request latency."),
                                  ("clover_request_tpf", s.tpf, "Tokens per forward of finished requests.")):
            samples, cum = [], 0
            for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
                cum += count
                samples.append((f'_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}}', cum))
            samples += [("_sum", hist.total), ("_count", hist.n)]
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} histogram"])
            lines.extend(f"{name}{suffix} {value}" for suffix, value in samples)
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    return app


def serve(model_dir: str | None, host: str, port: int, api_key: str | None, max_batch_size: int, max_waiting: int,
          dtype: str, device: str, model_name: str | None, prefix_cache_bytes: int = 0,
          max_prefill_tokens: int | None = None) -> None:
    import logging

    import uvicorn

    from clover.checkpoint import load_for_generation

    loaded = load_for_generation(model_dir, dtype, device)
    name = model_name or (str(model_dir).rstrip("/").split("/")[-1] if model_dir else "clover-tiny")
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logging.getLogger("clover").warning("serving on %s without --api-key: anyone who can reach it may use it", host)
    app = build_app(loaded.model, loaded.tokenizer, ServerConfig(name, api_key, max_waiting), max_batch_size,
                    loaded.generation, prefix_cache_bytes, max_prefill_tokens)
    print(f"clover serve: {name} on http://{host}:{port}/v1 (batch {max_batch_size}, queue {max_waiting}, prefix cache "
          f"{prefix_cache_bytes / 2**20:.0f} MiB)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)

