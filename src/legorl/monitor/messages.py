"""Read the conversation out of a stored request body, whatever the wire format.

A harness sends the whole history on every call, so what the harness said back
after call *i* (tool results, error notes, new user text) is the part of call
*i+1*'s messages that call *i*'s request did not have.

Bodies are read by the proxy's own parser for their wire format (`conversation` and `messages`
of each format, proxy/wire.py): the dashboard shows each message as the model was given it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from legorl.proxy.formats import FORMATS
from legorl.proxy.gemini import Gemini
from legorl.proxy.openai_chat import OpenAIChat
from legorl.proxy.openai_responses import OpenAIResponses
from legorl.proxy.wire import WireFormat
from legorl.records import ToolCall


@dataclass
class Message:
    """One conversation item, normalised across OpenAI Chat, OpenAI Responses, Anthropic Messages and Gemini."""

    role: str  # system | user | assistant | tool
    text: str = ""
    tool_call_id: str | None = None  # for role == "tool": which call this result answers
    tool_calls: list[ToolCall] = field(default_factory=list)  # for role == "assistant"
    is_error: bool = False

    def key(self) -> tuple[str, str, str | None, tuple[tuple[str, str], ...]]:
        return (self.role, self.text, self.tool_call_id, tuple((t.name, t.arguments) for t in self.tool_calls))


def _format(request: dict[str, Any], wire_format: str) -> type[WireFormat]:
    """The format of a body; an unknown one is guessed from its keys."""
    if wire_format in FORMATS:
        return FORMATS[wire_format]
    if "contents" in request:
        return Gemini
    return OpenAIResponses if "input" in request else OpenAIChat


def _args_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _message(m: dict[str, Any], failed: set[str]) -> Message:
    """A canonical message (proxy/request.py) as a Message."""
    calls = []
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        calls.append(ToolCall(id=str(c.get("id") or ""), name=str(fn.get("name", "")),
                              arguments=_args_text(fn.get("arguments", ""))))
    call_id = m.get("tool_call_id")
    return Message(role=m["role"], text=m.get("content") or "", tool_call_id=call_id, tool_calls=calls,
                   is_error=m["role"] == "tool" and call_id in failed)


def conversation_items(request: dict[str, Any], wire_format: str) -> list[Any]:
    """The raw conversation items of a request, in order (system prompt first where it is separate)."""
    return _format(request, wire_format).conversation(request)


def normalise(items: list[Any], wire_format: str) -> list[Message]:
    fmt = FORMATS.get(wire_format, OpenAIChat)
    try:
        failed = fmt.failed_tool_results(items)
        return [_message(m, failed) for m in fmt.messages(items)]
    except (AttributeError, TypeError, ValueError):
        return []  # a malformed body shows as no messages, never breaks a page


def messages_of(request: dict[str, Any], wire_format: str) -> list[Message]:
    """The conversation in a request body, normalised; unknown formats are guessed from their keys."""
    return normalise(conversation_items(request, wire_format), _format(request, wire_format).name)


def new_messages(prev: list[Any] | None, cur: list[Any], wire_format: str) -> list[Message]:
    """Items of `cur` after its longest common prefix with `prev`, normalised, less the assistant's own turns.

    Items are compared raw first (cheap), then normalised (so moved cache markers do not count as new).
    """
    k = 0
    if prev is not None:
        n = min(len(prev), len(cur))
        while k < n and (prev[k] == cur[k] or [m.key() for m in normalise([prev[k]], wire_format)]
                         == [m.key() for m in normalise([cur[k]], wire_format)]):
            k += 1
    return [m for m in normalise(cur[k:], wire_format) if m.role != "assistant"]


def declares_tools(request: dict[str, Any]) -> bool:
    return bool(request.get("tools") or request.get("functions"))
