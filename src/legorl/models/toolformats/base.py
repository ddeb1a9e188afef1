"""What every tool-call format shares: the parse result, the parser protocol and the small readers.

The text a parser reads is always the decode of the sampled ids (special tokens kept, the closing
end-of-turn token removed); parsing only shapes the answer sent to the harness, never what is trained.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from legorl.records import ToolCall


@dataclass(frozen=True)
class ParsedReply:
    """A completion as the harness sees it: its text, its tool calls, and (harmony) its reasoning.

    `malformed` says why a completion that attempted a tool call (it wrote the format's opening
    marker) could not be read; its whole text is then `content` and `calls` is empty: a partial set
    of calls would silently drop what the model asked for.
    """

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)
    malformed: str | None = None
    reasoning: str | None = None  # set by formats whose syntax holds the reasoning (harmony's analysis channel)


class ToolCallParser(Protocol):
    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        """`tools`: the request's OpenAI function tools, which say which parameters are strings."""
        ...


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def plain(text: str) -> ParsedReply:
    """No tool call attempted: the text as it is."""
    return ParsedReply(text or None)


def malformed(text: str, why: str) -> ParsedReply:
    """A tool call attempted and not read: the whole text, and why."""
    return ParsedReply(text or None, [], why)


def answered(content: str, calls: list[ToolCall]) -> ParsedReply:
    """Calls read; `content` is the text before the first one (trailing whitespace dropped)."""
    return ParsedReply(content.rstrip() or None, calls)


def call(name: str, arguments: Any) -> ToolCall | None:
    """A call from a name and its arguments (an object, or JSON text of one); None if they are not that."""
    if isinstance(arguments, str):
        try:  # arguments given as JSON text: kept verbatim when it is a JSON object
            if not isinstance(json.loads(arguments), dict):
                return None
        except json.JSONDecodeError:
            return None
        text = arguments
    elif isinstance(arguments, dict):
        text = json.dumps(arguments, ensure_ascii=False)
    else:
        return None
    name = name.strip()
    return ToolCall(id=new_call_id(), name=name, arguments=text) if name else None


def json_call(obj: Any) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` (or `"parameters"`, Llama 3's key) as a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return call(obj["name"], obj.get("arguments", obj.get("parameters", {})))


def json_object(text: str) -> Any:
    """`text` as JSON, or None when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def string_params(tools: list[dict[str, Any]] | None, name: str) -> set[str]:
    """The parameters of tool `name` whose schema type is string (their values are taken verbatim)."""
    for t in tools or []:
        fn = t.get("function", t) if isinstance(t, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def param_value(raw: str, is_string: bool) -> Any:
    """A parameter written as text between tags (Qwen3-Coder, GLM-4.5, MiniMax-M2 write strings raw and
    anything else as JSON): verbatim for a string parameter, else its JSON value when it has one."""
    if is_string:
        return raw
    try:
        return json.loads(raw.strip())
    except json.JSONDecodeError:
        return raw


def read_blocks(text: str, start: str, block: re.Pattern[str], read: Callable[[re.Match[str]], list[ToolCall] | None],
                opens: tuple[str, ...] | None = None) -> ParsedReply:
    """The shared shape of tag formats: calls in `block`s, from the first `start` marker on.

    No `start`: plain text. Otherwise every `block` match must `read` into calls, at least one must
    match, and no marker of `opens` (default: `start`; a call's opening marker) may be left outside the
    complete blocks (a call cut short); else the completion is malformed. Content is the text before
    the first `start`.
    """
    at = text.find(start)
    if at < 0:
        return plain(text)
    calls: list[ToolCall] = []
    for m in block.finditer(text, at):
        got = read(m)
        if not got:
            return malformed(text, f"a tool call that does not parse: {_clip(m.group(0))}")
        calls += got
    rest = block.sub("", text[at:])
    left = [rest.find(s) for s in (opens or (start,)) if s in rest]
    if left:
        return malformed(text, f"a tool call left unclosed: {_clip(rest[min(left):])}")
    if not calls:
        return malformed(text, f"{start} with no complete tool call after it: {_clip(rest)}")
    return answered(text[:at], calls)


def _clip(s: str, n: int = 120) -> str:
    return s if len(s) <= n else s[:n] + "..."
