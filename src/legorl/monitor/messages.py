"""Read the conversation out of a stored request body, whatever the wire format.

A harness sends the whole history on every call, so what the harness said back
after call *i* (tool results, error notes, new user text) is the part of call
*i+1*'s messages that call *i*'s request did not have.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from legorl.records import ToolCall


@dataclass
class Message:
    """One conversation item, normalised across OpenAI Chat, OpenAI Responses and Anthropic Messages."""

    role: str  # system | user | assistant | tool
    text: str = ""
    tool_call_id: str | None = None  # for role == "tool": which call this result answers
    tool_calls: list[ToolCall] = field(default_factory=list)  # for role == "assistant"
    is_error: bool = False

    def key(self) -> tuple[str, str, str | None, tuple[tuple[str, str], ...]]:
        return (self.role, self.text, self.tool_call_id, tuple((t.name, t.arguments) for t in self.tool_calls))


def _text(content: Any) -> str:
    """Text of a content value: a string, or a list of parts/blocks with text in them."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict):
                if isinstance(p.get("text"), str):
                    parts.append(p["text"])
                elif p.get("type") in ("image", "image_url", "input_image"):
                    parts.append("[image]")
        return "\n".join(parts)
    if isinstance(content, dict):
        return _text([content])
    return str(content)


def _args_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _chat(request: dict[str, Any]) -> list[Message]:
    out = []
    for m in request.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", "user"))
        calls = [ToolCall(id=str(tc.get("id", "")), name=str(tc.get("function", {}).get("name", "")),
                          arguments=_args_text(tc.get("function", {}).get("arguments", "")))
                 for tc in m.get("tool_calls") or [] if isinstance(tc, dict)]
        out.append(Message(role="system" if role == "developer" else role, text=_text(m.get("content")),
                           tool_call_id=m.get("tool_call_id"), tool_calls=calls))
    return out


def _anthropic(request: dict[str, Any]) -> list[Message]:
    out = []
    if request.get("system"):
        out.append(Message("system", _text(request["system"])))
    for m in request.get("messages") or []:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", "user"))
        content = m.get("content")
        if isinstance(content, str):
            out.append(Message(role, content))
            continue
        texts, calls = [], []
        for block in content or []:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "tool_result":
                out.append(Message("tool", _text(block.get("content")), tool_call_id=block.get("tool_use_id"),
                                   is_error=bool(block.get("is_error"))))
            elif kind == "tool_use":
                calls.append(ToolCall(id=str(block.get("id", "")), name=str(block.get("name", "")),
                                      arguments=_args_text(block.get("input", {}))))
            elif kind == "text":
                texts.append(str(block.get("text", "")))
        if texts or calls or role == "assistant":
            out.append(Message(role, "\n".join(texts), tool_calls=calls))
    return out


def _responses(request: dict[str, Any]) -> list[Message]:
    out = []
    if request.get("instructions"):
        out.append(Message("system", _text(request["instructions"])))
    items = request.get("input")
    if isinstance(items, str):
        return out + [Message("user", items)]
    for it in items or []:
        if not isinstance(it, dict):
            continue
        kind = it.get("type", "message")
        if kind == "message":
            role = str(it.get("role", "user"))
            out.append(Message("system" if role == "developer" else role, _text(it.get("content"))))
        elif kind in ("function_call", "custom_tool_call", "local_shell_call"):
            args = it.get("arguments", it.get("input", it.get("action", "")))
            call = ToolCall(id=str(it.get("call_id", it.get("id", ""))), name=str(it.get("name", "shell")),
                            arguments=_args_text(args))
            if out and out[-1].role == "assistant":  # consecutive calls belong to one turn
                out[-1].tool_calls.append(call)
            else:
                out.append(Message("assistant", tool_calls=[call]))
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            output = it.get("output", "")
            if isinstance(output, dict):
                output = output.get("content", output.get("output", json.dumps(output)))
            out.append(Message("tool", _text(output), tool_call_id=it.get("call_id")))
    return out


_PARSERS = {"openai_chat": _chat, "anthropic_messages": _anthropic, "openai_responses": _responses}


def messages_of(request: dict[str, Any], wire_format: str) -> list[Message]:
    """The conversation in a request body, normalised; unknown formats are guessed from their keys."""
    parse = _PARSERS.get(wire_format)
    if parse is None:
        parse = _responses if "input" in request else _chat
    try:
        return parse(request)
    except (AttributeError, TypeError, ValueError):
        return []  # a malformed body shows as no messages, never breaks a page


def new_messages(prev: list[Message] | None, cur: list[Message]) -> list[Message]:
    """Messages of `cur` after the longest common prefix with `prev`, less the assistant's own turns."""
    if prev is None:
        return list(cur)
    k = 0
    while k < min(len(prev), len(cur)) and prev[k].key() == cur[k].key():
        k += 1
    return [m for m in cur[k:] if m.role != "assistant"]


def declares_tools(request: dict[str, Any]) -> bool:
    return bool(request.get("tools") or request.get("functions"))
