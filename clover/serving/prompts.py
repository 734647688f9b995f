"""Chat requests as prompts: OpenAI messages and tools in the chat template's terms, and tool_choice.

`tool_choice` "required" or a named function is honoured by pre-filling the start of a tool call after
an empty think block (the model then writes the call; our design, no constrained decoding). "none"
hides the tools from the prompt and keeps tool-call markup in the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clover.model.chat import ChatFormatError, StreamingParser, validate_tools
from clover.model.tokenizer import Tokenizer
from clover.serving.protocol import APIError, ChatRequest, MessageIn, NamedToolChoice, ToolDef


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

    def parser(self) -> StreamingParser:
        """A parser for one reply, fed the pre-filled prefix already."""
        parser = StreamingParser(self.thinking, self.tools, calls=self.tools is not None)
        parser.feed(self.prefix)
        return parser


def chat_prompt(req: ChatRequest, tokenizer: Tokenizer) -> ChatPrompt:
    """Render and tokenise a chat request (blocking: call it off the event loop). Special tokens come
    only from the template: message text cannot forge a turn or a mask."""
    thinking = thinking_from(req.chat_template_kwargs)
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
    offered = tools if choice != "none" else None
    try:
        ids = tokenizer.encode_chat(messages_from(req.messages), tools=offered, enable_thinking=thinking, suffix=prefix)
    except ChatFormatError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    return ChatPrompt(ids, thinking, offered, prefix)
