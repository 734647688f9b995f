"""Chat format (spec section 6): the Jinja chat template, and the parser of model output into
reasoning, content and OpenAI tool calls, one-shot or incrementally block by block.

Turns are `<|im_start|>{role}\\n{content}<|im_end|>\\n`. Tools are listed in the system turn; calls are
XML-style `<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`;
tool results come back wrapped in `<tool_response>` inside a user turn (the Qwen3.5 convention:
consecutive tool messages share one turn; spec section 6 says "a `tool` turn": read as the API's tool
messages, which this template renders the Qwen3.5 way, the backbone's). Thinking mode opens the assistant turn with
`<think>\\n`; with thinking off the template pre-fills an empty `<think>\\n\\n</think>\\n\\n`.
Assistant turns after the last user message keep their reasoning (or the empty think block), so
that a rendered conversation extends its own generation prompts; earlier turns drop it.
"""

from __future__ import annotations

import contextvars
import functools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError, safe_range

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# The template file: written into every checkpoint as `chat_template.jinja`, read back from there.
TEMPLATE_FILE = Path(__file__).with_name("chat_template.jinja")
DEFAULT_CHAT_TEMPLATE = TEMPLATE_FILE.read_text()

ROLES = ("system", "user", "assistant", "tool")


class ChatFormatError(ValueError):
    """A message list or tool definition the chat template cannot render."""


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _raise(message: str) -> None:
    raise TemplateError(message)


# What a checkpoint's template may spend on one rendering (a hostile pass, session 54: two nested loops over
# range(100000) hung a `clover chat`; `'x' * 10**10` ended it with MemoryError): steps of its `range` loops (each
# range is capped at 100,000 by Jinja's sandbox already), characters of output, and the size of a `*` or `**`.
MAX_TEMPLATE_STEPS = 10_000_000
MAX_RENDERED_CHARS = 64 * 2**20
_steps_left: contextvars.ContextVar[list[int]] = contextvars.ContextVar("template_steps")


class _CountedRange:
    """`range` for templates: each step taken counts against the rendering's budget."""

    def __init__(self, *args: int) -> None:
        self.r = safe_range(*args)

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i: Any) -> Any:
        return self.r[i]

    def __iter__(self) -> Iterator[int]:
        left = _steps_left.get([MAX_TEMPLATE_STEPS])
        for x in self.r:
            left[0] -= 1
            if left[0] < 0:
                raise SecurityError(f"more than {MAX_TEMPLATE_STEPS:,} loop steps")
            yield x


class _TemplateEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with a size check on `*` (repeating a string or list) and `**`."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            seq, n = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDERED_CHARS:
                raise SecurityError(f"a repetition of more than {MAX_RENDERED_CHARS:,} items")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1000:
            raise SecurityError("a power above 1000")
        return super().call_binop(context, operator, left, right)


# The environment transformers' apply_chat_template uses (trim_blocks, lstrip_blocks, loop controls,
# tojson without HTML escaping, raise_exception): a template renders the same here and there.
_ENV = _TemplateEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise
_ENV.globals["range"] = _CountedRange


def lone_surrogate(text: str) -> bool:
    """Whether `text` holds a UTF-16 surrogate alone: not a character (JSON allows the escape, and bytes that are
    not UTF-8 arrive so from the command line and standard input, through Python's surrogateescape)."""
    return any("\ud800" <= ch <= "\udfff" for ch in text)


def json_value(text: str) -> Any:
    """`json.loads` of untrusted text (a model's call, a client's arguments): only finite numbers (NaN, Infinity and
    1e999 are not JSON a strict parser reads back); every failure a ValueError (a JSONDecodeError or not: an integer
    past Python's 4,300 digits, nesting deeper than the recursion limit)."""
    def finite(number: str) -> float:
        value = float(number)
        if not math.isfinite(value):
            raise ValueError(f"the number {number:.40} is out of range")
        return value

    def constant(name: str) -> float:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(text, parse_float=finite, parse_constant=constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def strings_in(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value: the value itself, the items of lists and tuples, the keys and values of
    dicts, at any depth."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            yield v
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _check_messages(messages: list[dict]) -> list[dict]:
    """Check roles and contents (copies: OpenAI text parts joined, `reasoning` read as
    `reasoning_content` as transformers does). Tool-call arguments are left as they are."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ChatFormatError(f"messages[{i}] must have a role in {list(ROLES)}, got {m!r:.80}")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(parts) != len(content):
                raise ChatFormatError(f"messages[{i}].content: only text parts are supported")
            content = "".join(parts)
        if content is not None and not isinstance(content, str):
            raise ChatFormatError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ChatFormatError(f"messages[{i}] ({m['role']}) has no content")
        m["content"] = content
        if m.get("reasoning_content") is None and m.get("reasoning") is not None:
            m["reasoning_content"] = m["reasoning"]
        for j, call in enumerate(m.get("tool_calls") or []):
            fn = (call or {}).get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip() or \
                    not isinstance(fn.get("arguments", {}), (dict, str)):
                raise ChatFormatError(f"messages[{i}].tool_calls[{j}] needs a function name (not empty) and "
                                      "arguments (an object or a JSON string)")
            # `<function=NAME>` and `<parameter=KEY>` end at the first '>' or new line: a name or key holding
            # one would write markup (another parameter) that the model reads as the call's own
            args = fn.get("arguments")
            bad = next((k for k in ([fn["name"]] + (list(args) if isinstance(args, dict) else []))
                        if not isinstance(k, str) or not k.strip() or ">" in k or "\n" in k), None)
            if bad is not None:
                raise ChatFormatError(f"messages[{i}].tool_calls[{j}]: the name {bad!r:.80} (of the function or an "
                                      "argument) must be non-empty without '>' or a new line")
        out.append(m)
    return out


def parse_tool_arguments(messages: list[dict]) -> list[dict]:
    """Messages in the OpenAI wire shape (tool-call `arguments` a JSON string) in the shape the template
    renders as trained (`arguments` an object), as vLLM does for such templates. Other messages unchanged."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if not calls or not isinstance(calls, list):
            out.append(m)
            continue
        parsed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            args = fn.get("arguments") if isinstance(fn, dict) else None
            if isinstance(args, str):
                try:
                    args = json_value(args) if args.strip() else {}
                except ValueError as exc:
                    raise ChatFormatError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON: {exc}") \
                        from None
                if not isinstance(args, dict):
                    raise ChatFormatError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
                if any(lone_surrogate(s) for s in strings_in(args)):   # (escaped in the JSON text: "\\ud800")
                    raise ChatFormatError(f"messages[{i}].tool_calls[{j}].function.arguments holds a lone UTF-16 "
                                          "surrogate, which is not a character")
                call = {**call, "function": {**fn, "arguments": args}}
            parsed.append(call)
        out.append({**m, "tool_calls": parsed})
    return out


def extra_parameters(parameters: Any) -> dict | None:
    """The schema of a tool's parameters that its `properties` do not name, where it takes any: a tool that declares
    no properties and allows additional ones (`"additionalProperties": true` or a schema). None for every other
    tool: its calls hold the parameters it declares (as OpenAI's strict mode asks)."""
    if not isinstance(parameters, dict) or parameters.get("properties"):
        return None
    more = parameters.get("additionalProperties")
    return {} if more is True else more if isinstance(more, dict) else None


JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")


def validate_tools(tools: list[dict] | None) -> list[dict]:
    """OpenAI tool definitions: [{"type": "function", "function": {"name", "parameters"?...}}]."""
    if not tools:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError("tools must be a list")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatFormatError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", fn["name"]):
            raise ChatFormatError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
        if any(isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name") == fn["name"]
               for t in tools[:i]):   # a call names its tool: two of one name could not be told apart
            raise ChatFormatError(f"tools[{i}].function.name {fn['name']!r} is the name of an earlier tool")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object" or not isinstance(
            params.get("properties", {}), dict
        ):
            raise ChatFormatError(f"tools[{i}].function.parameters must be a JSON schema of type object")
        props = params.get("properties", {})
        bad = next((k for k, v in props.items() if not isinstance(v, dict)), None)
        if bad is not None:
            raise ChatFormatError(f"tools[{i}].function.parameters.properties.{bad} must be a JSON schema object")
        bad = next((k for k in props if not k or ">" in k or "\n" in k), None)
        if bad is not None:   # `<parameter=NAME>` could not be read back
            raise ChatFormatError(f"tools[{i}].function.parameters.properties: the name {bad!r} must be non-empty "
                                  "without '>' or a new line")
        for key, schema in props.items():   # (a misspelt type turned the call's grammar off, with a warning only)
            kinds = schema.get("type", [])
            if not all(k in JSON_TYPES for k in (kinds if isinstance(kinds, list) else [kinds])):
                raise ChatFormatError(f"tools[{i}].function.parameters.properties.{key}.type must be one of "
                                      f"{', '.join(JSON_TYPES)} (or a list of them), got {kinds!r}")
        required = params.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ChatFormatError(f"tools[{i}].function.parameters.required must be a list of property names")
    return tools


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Template:
    return _ENV.from_string(template)


def render_chat(
    template: str, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
    enable_thinking: bool = True, **extra: Any,
) -> str:
    """Render `messages` with a Jinja chat template in a sandbox, exactly as transformers'
    `apply_chat_template` renders them (after checking them). Tool-call arguments given as JSON
    strings are rendered as the template renders strings; `Tokenizer.apply_chat_template` parses
    them first (`parse_tool_arguments`)."""
    if not messages:
        raise ChatFormatError("messages is empty")
    messages, tools = _check_messages(messages), validate_tools(tools) or None
    token = _steps_left.set([MAX_TEMPLATE_STEPS])
    try:
        out, size = [], 0
        for piece in _compiled(template).generate(messages=messages, tools=tools,
                                                  add_generation_prompt=add_generation_prompt,
                                                  enable_thinking=enable_thinking, **extra):
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise SecurityError(f"more than {MAX_RENDERED_CHARS:,} characters of output")
            out.append(piece)
        if not size:   # (else reported as an empty prompt, as if the user had given none)
            raise ChatFormatError("chat template failed: it rendered nothing for these messages")
        return "".join(out)
    except TemplateError as exc:   # (SecurityError included: the budgets above)
        raise ChatFormatError(f"chat template failed: {exc}") from exc
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError, MemoryError) as exc:
        # a checkpoint's own template may fail at render time (`{{ 1 // 0 }}`, a macro that calls itself)
        raise ChatFormatError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    finally:
        _steps_left.reset(token)


# -- output parsing -------------------------------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedOutput:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
_FUNCTION_HEAD = re.compile(r"\s*<function=[^>\n]+>")
# a value ends at a "</parameter>" that closes it: one followed by the next parameter or the call's end (the
# template writes "\n</parameter>\n"), so the same text inside a value stays in it, as the grammar reads it
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>(?=\s*(?:<parameter=|$))", re.S)


# JSON-schema keywords that say nothing about a value: a parameter with only these has no schema (its value is
# text, as the template writes it and as the Qwen3 reference parser reads a parameter without a type)
ANNOTATIONS = {"description", "title", "default", "examples", "deprecated", "readOnly", "writeOnly", "$comment"}


def string_enum(schema: dict) -> bool:
    """Whether a parameter's schema is an enum of strings or a string const: its values are written raw, as
    strings are."""
    enum = schema.get("enum")
    return isinstance(schema.get("const"), str) or (
        isinstance(enum, list) and bool(enum) and all(isinstance(e, str) for e in enum))


def written_raw(schema: Any) -> bool:
    """Whether a parameter's value is written as raw text rather than as JSON: a parameter without a schema (or
    with annotations only, or one the tool does not declare), a string enum, or a type that admits a string
    (e.g. ["string", "null"]). The one rule of the grammar (`structured.tool_call_grammar`) and the parser."""
    if not isinstance(schema, dict) or set(schema) <= ANNOTATIONS or string_enum(schema):
        return True
    kind = schema.get("type")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _convert(value: str, schema: dict | None) -> tuple[Any, str | None]:
    kind = schema.get("type") if isinstance(schema, dict) else None
    kinds = kind if isinstance(kind, list) else [kind]
    if written_raw(schema):
        if "string" in kinds and len(kinds) > 1:   # e.g. ["string", "null"]: a JSON value of another allowed
            try:                                    # type, or a JSON string, is read as JSON; else it is the text
                parsed = json_value(value)
            except ValueError:
                return value, None
            if isinstance(parsed, str) or (parsed is None and "null" in kinds):
                return parsed, None
        return value, None
    if kind is None:  # a schema without a type (anyOf, enum, $ref...): JSON if it parses, else the text
        try:
            return json_value(value), None
        except ValueError:
            return value, None
    try:
        parsed = json_value(value)
    except ValueError:
        return value, f"value {value!r:.40} is not valid JSON for type {kind}"
    checks = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
              "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
    if not any(checks.get(k, lambda v: True)(parsed) for k in kinds):
        return value, f"value {value!r:.40} is not of type {kind}"
    return parsed, None


def _loose_call(body: str, tools: list[dict] | None) -> tuple[ToolCall | None, list[str]]:
    """The text between <tool_call> and </tool_call> of a call not written as the template writes it (`_written_call`
    read it first): a name and each `<parameter=KEY>` ending at a "</parameter>" before the next or the end."""
    m = _FUNCTION.fullmatch(body)
    if not m or not m.group(1).strip():   # no name: not a call a client could send back in its history
        return None, [f"malformed tool call: {body.strip()!r:.80}"]
    return typed_call(m.group(1).strip(), [(k.strip(), v) for k, v in _PARAM.findall(m.group(2))], tools)


def typed_call(name: str, params: list[tuple[str, str]], tools: list[dict] | None) -> tuple[ToolCall, list[str]]:
    """A call from its name and its (key, value as written) pairs, each value typed by the tool's schema."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools or []}
    errors = []
    if tools and name not in schemas:
        errors.append(f"call to unknown function {name!r}")
    props = schemas.get(name, {}).get("properties", {})
    more = extra_parameters(schemas.get(name))
    args: dict[str, Any] = {}
    for key, raw in params:
        if tools and name in schemas and key not in props and more is None:
            errors.append(f"{name}: unknown parameter {key!r}")
        value, err = _convert(raw, props.get(key, more))
        if err:
            errors.append(f"{name}.{key}: {err}")
        args[key] = value
    missing = [k for k in schemas.get(name, {}).get("required", []) if k not in args]
    if missing:
        errors.append(f"{name}: missing required parameter(s) {missing}")
    return ToolCall(name, args), errors


_NAME = re.compile(r"[^>\n]*")
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "\n</parameter>\n"
_FUNCTION_CLOSE = "</function>\n"


def _named(text: str, pos: int, opener: str) -> tuple[int, str] | int | None:
    """`opener`, a name and ">\n" at `pos`: (the position after them, the name); -1 where the text ends inside
    them; None where it differs."""
    if not text.startswith(opener, pos):
        return -1 if opener.startswith(text[pos:]) else None
    start = pos + len(opener)
    end = _NAME.match(text, start).end()
    name = text[start:end].strip()
    if text.startswith(">\n", end) and name:
        return end + 2, name
    return -1 if text[end:] in ("", ">") else None


def _written_call(text: str, body: int) -> tuple[int, str, list[tuple[str, str]]] | int | None:
    """The call whose body starts at `body`, read exactly as the template writes it and the grammar holds it:
    "\n<function=NAME>\n", then for each parameter "<parameter=KEY>\n" VALUE "\n</parameter>\n", where a value
    ends at the first "\n</parameter>\n" whatever markup it holds (a file's content may hold a whole call), then
    "</function>\n" and `</tool_call>`. (Where its `</tool_call>` starts, the name, the (key, value) pairs); -1
    while the text so far may still become such a call; None where it is not one (`_call_end` then reads it as
    loosely written markup)."""
    head = _named(text, body, "\n<function=")
    if not isinstance(head, tuple):
        return head
    pos, name = head
    params = []
    while True:
        if text.startswith(_FUNCTION_CLOSE + CALL_CLOSE, pos):
            return pos + len(_FUNCTION_CLOSE), name, params
        if not text.startswith(_PARAM_OPEN, pos):
            rest = text[pos:]
            return -1 if (_FUNCTION_CLOSE + CALL_CLOSE).startswith(rest) or _PARAM_OPEN.startswith(rest) else None
        opened = _named(text, pos, _PARAM_OPEN)
        if not isinstance(opened, tuple):
            return opened
        start, key = opened
        close = text.find(_PARAM_CLOSE, start)
        if close < 0:
            return -1
        params.append((key, text[start:close]))
        pos = close + len(_PARAM_CLOSE)


def _call_end(text: str, body: int, final: bool) -> int:
    """Where the call whose body starts at `body` is closed: at the first `</tool_call>`, unless the body up to
    it opens a function but does not close it there. Then that `</tool_call>` may be text inside one of its
    values (a file's content, a string): the call ends at a later `</tool_call>` that closes the function with
    the first one inside a parameter's value. -1 while that may still come; once the text is final and none
    came, the first one (a malformed call, as before)."""
    first = text.find(CALL_CLOSE, body)
    if first < 0 or _FUNCTION.fullmatch(text, body, first) or not _FUNCTION_HEAD.match(text, body):
        return first
    end = first
    while (end := text.find(CALL_CLOSE, end + len(CALL_CLOSE))) >= 0:
        m = _FUNCTION.fullmatch(text, body, end)
        if m and any(p.start(2) <= first < p.end(2) for p in _PARAM.finditer(text, m.start(2), m.end(2))):
            return end
    return first if final else -1


def _partial_tag(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:k]):
                best = max(best, k)
                break
    return best


@dataclass
class _Settled:
    """What a scan of a streamed text found that later text cannot change (`StreamingParser` resumes from it):
    the closed reasoning and where the text after it starts, and the content parts, calls and errors up to the
    end of the last complete call."""
    rest: int | None = None        # where the text after the reasoning starts, once that is known
    reasoning: str | None = None
    pos: int = 0                   # the end of the last complete call (or `rest`)
    parts: list[str] = field(default_factory=list)
    found: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _scan(text: str, thinking: bool, tools: list[dict] | None, final: bool, calls: bool = True,
          settled: _Settled | None = None) -> ParsedOutput:
    """Parse `text`; when not final, keep back what a later piece could still change. With `calls`
    False, tool-call markup stays in the content (tool_choice "none"). `settled`, from scans of earlier
    prefixes of `text` (not final), is where this one starts, and it is brought up to date."""
    settled = settled if settled is not None else _Settled()
    if settled.rest is None:
        reasoning, rest, close = None, 0, -1
        if thinking:
            stripped = text.lstrip()
            if not final and THINK_OPEN.startswith(stripped):
                return ParsedOutput("", "", [], [])  # could still become a (repeated) opening tag
            body = len(text) - len(stripped) + len(THINK_OPEN) if stripped.startswith(THINK_OPEN) else 0
            close = text.find(THINK_CLOSE, body)
            if close >= 0:
                reasoning, rest = text[body:close].strip(), close + len(THINK_CLOSE)
            else:   # all reasoning so far; a tail that may become the closing tag, and trailing whitespace, wait
                reasoning, rest = text[body:], len(text)
                if not final:
                    reasoning = reasoning[: len(reasoning) - _partial_tag(reasoning, (THINK_CLOSE,))]
                reasoning = reasoning.strip()
        if not thinking or close >= 0:
            settled.rest, settled.reasoning, settled.pos = rest, reasoning, rest
    else:
        reasoning, rest = settled.reasoning, settled.rest
    pos = settled.pos if settled.rest is not None else rest
    parts, found, errors = list(settled.parts), list(settled.found), list(settled.errors)
    while True:
        start = text.find(CALL_OPEN, pos) if calls else -1
        if start < 0:
            tail = text[pos:]
            if not final and calls:
                tail = tail[: len(tail) - _partial_tag(tail, (CALL_OPEN,))]
            parts.append(tail)
            break
        parts.append(text[pos:start])
        body = start + len(CALL_OPEN)
        written = _written_call(text, body)
        if isinstance(written, tuple):
            end, name, params = written
            call, errs = typed_call(name, params, tools)
        elif written == -1 and not final:
            break
        else:
            end = _call_end(text, body, final)
            if end < 0:
                if final:   # cut short (max_tokens): the text stays in the content, as vLLM's parsers leave it
                    errors.append(f"unterminated tool call: {text[start:]!r:.80}")
                    parts.append(text[start:])
                break
            call, errs = _loose_call(text[body:end], tools)
        errors.extend(errs)
        if call is not None:
            found.append(call)
        else:   # markup that names no call: the client sees it as text rather than nothing
            parts.append(text[start: end + len(CALL_CLOSE)])
        pos = end + len(CALL_CLOSE)
        if not final and settled.rest is not None:   # (a call's end, once found, stays where it is)
            settled.pos, settled.parts, settled.found, settled.errors = pos, list(parts), list(found), list(errors)
    return ParsedOutput(reasoning, "".join(parts).strip(), found, errors)


def parse_output(text: str, thinking: bool = True, tools: list[dict] | None = None, calls: bool = True
                 ) -> ParsedOutput:
    """Split a finished assistant output (text after the generation prompt) into its parts."""
    return _scan(text, thinking, tools, final=True, calls=calls)


@dataclass
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)   # calls completed by this piece
    errors: list[str] = field(default_factory=list)            # only on the final piece


class StreamingParser:
    """Feed text pieces as they become final; every delta is safe to show, and the deltas add up to
    exactly `parse_output` of the whole text, wherever the pieces were split."""

    def __init__(self, thinking: bool = True, tools: list[dict] | None = None, calls: bool = True) -> None:
        self.thinking, self.tools, self.calls = thinking, tools, calls
        self.text = ""
        self._sent = ParsedOutput("" if thinking else None, "")
        self._settled = _Settled()   # each feed scans on from what the earlier ones settled (not the whole text)

    def _delta(self, now: ParsedOutput) -> OutputDelta:
        sent = self._sent
        d = OutputDelta(
            reasoning=(now.reasoning or "")[len(sent.reasoning or ""):],
            content=now.content[len(sent.content):],
            tool_calls=now.tool_calls[len(sent.tool_calls):],
        )
        self._sent = ParsedOutput(now.reasoning, now.content, list(now.tool_calls))
        return d

    def feed(self, piece: str) -> OutputDelta:
        self.text += piece
        return self._delta(_scan(self.text, self.thinking, self.tools, False, self.calls, self._settled))

    def finish(self) -> OutputDelta:
        final = _scan(self.text, self.thinking, self.tools, True, self.calls, self._settled)
        d = self._delta(final)
        d.errors = final.errors
        return d
