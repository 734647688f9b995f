"""The OpenAI wire format of `clover serve`: request schemas, the error shape and server-sent events.

Requests are validated strictly (types are not coerced); unknown fields are ignored here and the
routes decide what they support. Errors have the OpenAI shape {"error": {"message", "type", "param",
"code"}}.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticUndefined

from clover.model.chat import lone_surrogate, strings_in

MAX_N = 8
MAX_STOP_CHARS = 1024


class ClientGone(Exception):
    """The client of a non-streamed request hung up; its generation was stopped."""


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


# -- request schemas ------------------------------------------------------------------------------------


def _nullable(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


class _Strict(BaseModel):
    """Nested objects: strict types; fields of no meaning here are ignored (clients echo back message
    objects with refusal, annotations, audio ... set to null). An explicit null means the field's default,
    as in OpenAI's API (the openai client sends `n=None` as null) where the field itself cannot be null."""

    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            drop = [k for k, v in data.items() if v is None and k in fields and fields[k].default is not None
                    and fields[k].default is not PydanticUndefined and not _nullable(fields[k].annotation)]
            if drop:
                data = {k: v for k, v in data.items() if k not in drop}
        return data


class _Request(_Strict):
    """A request body: an unknown field is an error, never silently dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")


class _Options(_Strict):
    """Nested options of a request (output format, streaming): a misspelt field is an error, as at the top
    level (dropped, it would leave the reply unconstrained without a word)."""

    model_config = ConfigDict(strict=True, extra="forbid")


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
    reasoning: str | None = None   # the field this server's replies carry (and vLLM's): echoed back, it is kept


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Options):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Options):
    """vLLM's `structured_outputs` (one of them)."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StreamOptions(_Options):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields every generation request shares. Decoding values are bounded in one place,
    `SamplingParams.validate`; the schema only checks their types."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(default=0, ge=0)     # vLLM's: no end of sequence or stop string before this many tokens
    # vLLM's sampling fields
    stop_token_ids: list[int] | None = None
    min_p: float | None = None
    include_stop_str_in_output: bool = False
    best_of: int | None = None                   # only None or n: every choice is returned
    # vLLM's detokenizer switches, accepted without effect: a reply's text never holds the tokens that end or
    # mask (they end it or are never picked), and keeps the chat markup (<think>, <tool_call>) its parsers read
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # accepted and without effect on the reply (OpenAI bookkeeping)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # Clover's knobs
    algorithm: Literal["low_confidence", "ar", "verify"] | None = None
    block_size: int | None = None
    threshold: float | None = None
    max_accept_per_step: int | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None               # vLLM's: only requests with the same salt share cached prefixes
    return_tokens_as_token_ids: bool = False    # vLLM's: logprobs name tokens "token_id:{id}"
    # structured output: OpenAI's response_format, and vLLM's guided_* / structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatRequest(SamplingRequest):
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    messages: list[MessageIn] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    constrain_tool_calls: bool | None = None    # Clover's: a call the reply writes names an offered tool and
                                                # matches its schema, a grammar holds it (default on)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    """A text completion: one prompt or a batch (text or token ids); `logprobs` N gives each token's
    log-probability and the N most likely; `echo` returns (and with logprobs scores) the prompt too,
    and with `max_tokens` 0 only that: lm-eval's log-likelihood requests."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a text prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[MessageIn] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]




def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status,
                        headers=headers)


def sse_event(data: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(data)}\n\n"


def chunk_event(obj: str, rid: str, created: int, model: str, choices: list[dict], usage: dict | None = None) -> str:
    """A streamed chunk of a chat (`chat.completion.chunk`) or text (`text_completion`) completion."""
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage
    return sse_event(body)


def error_event(err: APIError) -> str:
    """An error after the stream started (the status line is gone): the same body as an HTTP error."""
    return sse_event({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}})


def parse_json_body(raw: bytes) -> Any:
    """A request body's JSON (blocking: run it off the event loop). Raises json.JSONDecodeError, also for
    text that is not Unicode (a lone surrogate), and RecursionError for nesting too deep to parse."""
    data = json.loads(raw)
    if any(lone_surrogate(s) for s in strings_in(data)):
        raise json.JSONDecodeError("a string holds a lone UTF-16 surrogate, which is not a character", "", 0)
    return data


_MEMBER = re.compile(r"(str|int|float|bool|none|[a-z][a-z-]*\[.*\]|[A-Z][A-Za-z]*)")


def _loc(err: dict) -> list:
    return [p for p in err.get("loc", ()) if p != "body"]


def _union_at(errors: list[dict], loc: list) -> int | None:
    """Where in `loc` pydantic names the member of a union (`str`, `list[TextPart]`, `literal['none','auto']`,
    `NamedToolChoice`): a part of that form at which another error of the same prefix names another member
    (a value that fails a union fails each member). None if `loc` passes through no union."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _MEMBER.fullmatch(part) and any(
                _loc(e)[:i] == loc[:i] and len(_loc(e)) > i and _loc(e)[i] != part
                and isinstance(_loc(e)[i], str) and _MEMBER.fullmatch(_loc(e)[i]) for e in errors):
            return i
    return None


def validation_message(exc: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """The first problem of a request as (message, param), the param as the client wrote it. A value
    matching no member of a union is told by the member it got furthest into (the fewest problems among
    those that accepted its outer type: a tool_choice object missing its function, the one token id of a
    prompt that is not an integer), or, where it matched none of them at all, by what each member wants."""
    errors = exc.errors()
    err, alternatives, dropped = errors[0], [], set()
    while (cut := _union_at(errors, _loc(err))) is not None:   # unions inside unions: member by member
        prefix = _loc(err)[:cut]
        members: dict[str, list[dict]] = {}
        for e in errors:
            if _loc(e)[:cut] == prefix and len(_loc(e)) > cut:
                members.setdefault(_loc(e)[cut], []).append(e)
        dropped.add(len(prefix))
        inside = {m: es for m, es in members.items() if any(len(_loc(e)) > cut + 1 for e in es)}
        if not inside:   # none got past the member's own type
            alternatives = list(dict.fromkeys(re.sub(r"a valid dictionary or instance of \w+", "an object",
                                                     str(e.get("msg"))).removeprefix("Input should be ")
                                              for es in members.values() for e in es))
            break
        best = min(inside.values(), key=lambda es: (len(es), -max(len(_loc(e)) for e in es)))
        err, errors = best[0], best
    loc = [str(p) for i, p in enumerate(_loc(err)) if i not in dropped]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        return f"unknown field {param!r}: Clover does not support it (and does not ignore it)", param
    msg = ("Input should be " + ", or ".join(alternatives)) if len(alternatives) > 1 else str(err.get("msg"))
    return (f"{param}: {msg}" if param else msg), param


