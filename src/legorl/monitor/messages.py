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


_SYSTEM = "__system__"  # marks a top-level system prompt (Anthropic `system`, Responses `instructions`)


def _fn(tool_call: dict[str, Any]) -> dict[str, Any]:
    f = tool_call.get("function")
    return f if isinstance(f, dict) else {}


def _chat(items: list[Any]) -> list[Message]:
    out = []
    for m in items:
        if not isinstance(m, dict):
            continue
        role = str(m.get("role", "user"))
        calls = [ToolCall(id=str(tc.get("id", "")), name=str(_fn(tc).get("name", "")),
                          arguments=_args_text(_fn(tc).get("arguments", "")))
                 for tc in m.get("tool_calls") or [] if isinstance(tc, dict)]
        out.append(Message(role="system" if role == "developer" else role, text=_text(m.get("content")),
                           tool_call_id=m.get("tool_call_id"), tool_calls=calls))
    return out


def _anthropic(items: list[Any]) -> list[Message]:
    out = []
    for m in items:
        if not isinstance(m, dict):
            continue
        if _SYSTEM in m:
            out.append(Message("system", _text(m[_SYSTEM])))
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


def _responses(items: list[Any]) -> list[Message]:
    out: list[Message] = []
    for it in items:
        if not isinstance(it, dict):
            continue
        if _SYSTEM in it:
            out.append(Message("system", _text(it[_SYSTEM])))
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


_NORMALISE = {"openai_chat": _chat, "anthropic_messages": _anthropic, "openai_responses": _responses}


def _format(request: dict[str, Any], wire_format: str) -> str:
    if wire_format in _NORMALISE:
        return wire_format
    return "openai_responses" if "input" in request else "openai_chat"


def conversation_items(request: dict[str, Any], wire_format: str) -> list[Any]:
    """The raw conversation items of a request, in order (system prompt first where it is separate)."""
    fmt = _format(request, wire_format)
    if fmt == "openai_chat":
        items = request.get("messages")
        return list(items) if isinstance(items, list) else []
    head: list[Any] = []
    sys_key = "system" if fmt == "anthropic_messages" else "instructions"
    if request.get(sys_key):
        head.append({_SYSTEM: request[sys_key]})
    body = request.get("messages" if fmt == "anthropic_messages" else "input")
    if isinstance(body, str):
        body = [{"type": "message", "role": "user", "content": body}]
    return head + (list(body) if isinstance(body, list) else [])


def normalise(items: list[Any], wire_format: str) -> list[Message]:
    try:
        return _NORMALISE.get(wire_format, _chat)(items)
    except (AttributeError, TypeError, ValueError):
        return []  # a malformed body shows as no messages, never breaks a page


def messages_of(request: dict[str, Any], wire_format: str) -> list[Message]:
    """The conversation in a request body, normalised; unknown formats are guessed from their keys."""
    return normalise(conversation_items(request, wire_format), _format(request, wire_format))


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
