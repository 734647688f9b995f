"""Chat requests as prompts: OpenAI messages and tools in the chat template's terms, tool_choice, and the
grammar a reply must match (structured output; a constrained reply starts without a reasoning block).

`tool_choice` "required" or a named function pre-fills the start of a tool call after an empty think
block, and a grammar (`tool_call_grammar`) holds the rest of the call to the tools' schemas, so the
reply is always a valid call. "auto" leaves the reply free until it opens a call (the `<tool_call>`
token, after the reasoning), and the same grammar, lazy, holds that call and any after it: a call names
an offered tool and matches its schema (as llama.cpp's lazy tool-call grammars; `constrain_tool_calls`
false turns it off). "none" hides the tools from the prompt and keeps tool-call markup in the text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from clover.engine.structured import Constraint, auto_tool_calls, grammar_error, tool_call_grammar
from clover.model.chat import ChatFormatError, StreamingParser, validate_tools
from clover.model.tokenizer import Tokenizer, TokenizerError
from clover.serving.protocol import APIError, ChatRequest, MessageIn, NamedToolChoice, SamplingRequest, ToolDef


def constraint_from(req: SamplingRequest) -> Constraint | None:
    """The grammar a request asks its reply to match: OpenAI's response_format (json_object,
    json_schema), or vLLM's guided_json / guided_regex / guided_choice / guided_grammar (Lark) or
    structured_outputs. At most one."""
    found: list[tuple[str, Constraint]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint("json_object")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format json_schema needs a json_schema object with a schema",
                           param="response_format.json_schema")
        found.append(("response_format", Constraint.json_schema(rf.json_schema.schema_)))
    so = req.structured_outputs
    for name, value, kind in (("guided_json", req.guided_json, "json_schema"), ("guided_regex", req.guided_regex, "regex"),
                              ("guided_choice", req.guided_choice, "choice"), ("guided_grammar", req.guided_grammar, "lark"),
                              ("structured_outputs.json", so and so.json_schema, "json_schema"),
                              ("structured_outputs.regex", so and so.regex, "regex"),
                              ("structured_outputs.choice", so and so.choice, "choice"),
                              ("structured_outputs.grammar", so and so.grammar, "lark")):
        if value is None:
            continue
        if kind == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise APIError(400, f"{name} is not JSON: {exc}", param=name) from exc
            if not isinstance(value, dict):
                raise APIError(400, f"{name} must be a JSON schema object", param=name)
            found.append((name, Constraint.json_schema(value)))
        elif kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise APIError(400, f"{name} must be a list of non-empty strings", param=name)
            found.append((name, Constraint("choice", json.dumps(value))))
        else:
            found.append((name, Constraint(kind, value)))
    if so is not None and so.json_object:
        found.append(("structured_outputs.json_object", Constraint("json_object")))
    if len(found) > 1:
        raise APIError(400, f"give one structured-output constraint, not {', '.join(n for n, _ in found)}",
                       param=found[1][0])
    if not found:
        return None
    name, constraint = found[0]
    return _compiles(constraint, name)


def _compiles(constraint: Constraint, param: str) -> Constraint:
    """The constraint, if its grammar compiles; else a 400 naming the field it came from (the engine would
    refuse it too, without the name)."""
    problem = grammar_error(constraint)
    if problem is not None:
        raise APIError(400, f"{param}: {problem[:2000]}", param=param)
    return replace(constraint, origin=param)   # (a grammar that matches no text is found later)


def thinking_from(kwargs: dict[str, Any] | None) -> bool:
    """`chat_template_kwargs.enable_thinking` (default on)."""
    thinking = (kwargs or {}).get("enable_thinking", True)
    if not isinstance(thinking, bool):
        raise APIError(400, "chat_template_kwargs.enable_thinking must be a boolean",
                       param="chat_template_kwargs.enable_thinking")
    return thinking


def tools_from(defs: list[ToolDef] | None) -> list[dict] | None:
    """Tool definitions as the chat template takes them, validated."""
    tools = [t.model_dump(exclude_none=True) for t in defs] if defs else None
    try:
        validate_tools(tools)
    except ChatFormatError as exc:
        raise APIError(400, str(exc), param="tools") from exc
    return tools


def messages_from(items: list[MessageIn]) -> list[dict]:
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


@dataclass
class ChatPrompt:
    """What a chat request asks the model for: the rendered, tokenised prompt and how to read the reply."""

    ids: list[int]
    thinking: bool
    tools: list[dict] | None      # the tools a reply may call (None under tool_choice "none")
    prefix: str                   # text pre-filled after the prompt (the start of a forced tool call)
    constraint: Constraint | None = None   # the grammar of the reply (structured output)

    def parser(self) -> StreamingParser:
        """A parser for one reply, fed the pre-filled prefix already."""
        parser = StreamingParser(self.thinking, self.tools, calls=self.tools is not None)
        parser.feed(self.prefix)
        return parser


def chat_prompt(req: ChatRequest, tokenizer: Tokenizer) -> ChatPrompt:
    """Render and tokenise a chat request (blocking: call it off the event loop). Special tokens come
    only from the template: message text cannot forge a turn or a mask."""
    thinking = thinking_from(req.chat_template_kwargs)
    constraint = constraint_from(req)
    if constraint is not None:   # the grammar starts at the first reply token: no free-form reasoning first
        thinking = False
    tools = tools_from(req.tools)
    choice = req.tool_choice or "auto"
    prefix = ""
    if choice not in ("auto", "none") and not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not in tools",
                           param="tool_choice")
        prefix, thinking = f"<tool_call>\n<function={choice.function.name}>\n", False
    elif choice == "required":
        prefix, thinking = "<tool_call>\n", False
    if prefix:   # the call is guaranteed: a grammar holds the rest of it to the tools' schemas
        if constraint is not None:
            raise APIError(400, "a forced tool_choice and a structured-output format cannot be combined",
                           param="tool_choice")
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        specials = tokenizer.special_ids
        if req.constrain_tool_calls is not False:   # (false: the call is opened for the model, then left to it)
            constraint = _compiles(Constraint("lark", tool_call_grammar(
                tools, named, req.parallel_tool_calls is not False, specials["<tool_call>"], specials["</tool_call>"])),
                "tools")
    elif tools and choice == "auto" and constraint is None and req.constrain_tool_calls is not False \
            and not req.ignore_eos:   # (a grammar ends the reply where it completes)
        constraint = auto_tool_calls(tools, tokenizer, thinking, req.parallel_tool_calls is not False)
    offered = tools if choice != "none" else None
    try:
        ids = tokenizer.encode_chat(messages_from(req.messages), tools=offered, enable_thinking=thinking, suffix=prefix)
    except (ChatFormatError, TokenizerError) as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return ChatPrompt(ids, thinking, offered, prefix, constraint)
