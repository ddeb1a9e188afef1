"""Tool-call parsers: sampled completion text -> (content, tool calls).

The text is always the decode of the sampled ids; parsing only shapes the
answer sent to the harness. Unparseable output is returned as plain content
(the harness decides what to do with it), never an error.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Protocol

from legorl.records import ToolCall

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class ToolCallParser(Protocol):
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]: ...


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _one_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:  # arguments given as a JSON string: keep it only if it is a JSON object
            if not isinstance(json.loads(args), dict):
                return None
        except json.JSONDecodeError:
            return None
        arguments = args
    elif isinstance(args, dict):
        arguments = json.dumps(args, ensure_ascii=False)
    else:
        return None
    return ToolCall(id=new_call_id(), name=obj["name"], arguments=arguments)


class TaggedJsonParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    This is both legorl's built-in syntax and the Hermes / Qwen style. If any
    block fails to parse, the whole completion is returned as text: a partial
    set of calls would silently drop what the model asked for.
    """

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        blocks = list(_BLOCK.finditer(text))
        if not blocks:
            return (text or None), []
        calls = [_one_call(m.group(1)) for m in blocks]
        if any(c is None for c in calls):
            return text, []
        content = text[: blocks[0].start()].rstrip()
        return (content or None), [c for c in calls if c is not None]


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


class XmlFunctionParser:
    """Qwen3-Coder style: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``.

    Parameter values are JSON when they parse as JSON (numbers, booleans, objects), else text.
    Falls back to the JSON-in-``<tool_call>`` syntax for blocks that hold JSON.
    """

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        blocks = list(_BLOCK.finditer(text))
        if not blocks:
            return (text or None), []
        calls: list[ToolCall] = []
        for m in blocks:
            body = m.group(1)
            fn = _FUNCTION.fullmatch(body.strip())
            if fn is None:
                call = _one_call(body)
                if call is None:
                    return text, []
                calls.append(call)
                continue
            args = {}
            for p in _PARAMETER.finditer(fn.group(2)):
                raw = p.group(2)
                try:
                    args[p.group(1).strip()] = json.loads(raw)
                except json.JSONDecodeError:
                    args[p.group(1).strip()] = raw
            calls.append(ToolCall(id=new_call_id(), name=fn.group(1).strip(),
                                  arguments=json.dumps(args, ensure_ascii=False)))
        content = text[: blocks[0].start()].rstrip()
        return (content or None), calls


PARSERS: dict[str, type] = {
    "tagged": TaggedJsonParser,  # legorl's built-in template syntax
    "hermes": TaggedJsonParser,  # Hermes / Qwen2.5 / Qwen3: JSON inside <tool_call>
    "qwen": TaggedJsonParser,
    "qwen3_coder": XmlFunctionParser,  # <function=...><parameter=...> inside <tool_call>
}


def get_parser(name: str) -> ToolCallParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser '{name}'; choose one of {sorted(PARSERS)}") from None
