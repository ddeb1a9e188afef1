"""Formats whose calls sit in XML-like tags: Hermes / Qwen JSON, Qwen3-Coder, GLM-4.5, MiniMax-M2.

Each reads the blocks its chat template writes after an assistant turn's text (see each class), with
`base.read_blocks`: a block that does not parse, or one left open, makes the completion malformed.
Parameter values written between tags are typed from the request's tool schema (a string parameter
is taken verbatim, even when it looks like JSON: a file's content stays text), else read as JSON when
they are JSON.
"""

from __future__ import annotations

import re
from typing import Any

from legorl.models.toolformats.base import (
    ParsedReply,
    call,
    json_call,
    json_object,
    param_value,
    read_blocks,
    string_params,
)
from legorl.records import ToolCall

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _only(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """The matches of `pattern` when they are all `text` holds (whitespace aside), else None."""
    return list(pattern.finditer(text)) if not pattern.sub("", text).strip() else None


def _params(pairs: list[re.Match[str]], name: str, tools: list[dict[str, Any]] | None,
            trim_newline: bool) -> dict[str, Any]:
    strings = string_params(tools, name)
    out = {}
    for m in pairs:
        key, raw = m.group(1).strip(), m.group(2)
        if trim_newline:  # the template puts a value on lines of its own: one newline each side is layout
            raw = raw.removeprefix("\n").removesuffix("\n")
        out[key] = param_value(raw, key in strings)
    return out


class TaggedJsonParser:
    """Hermes / Qwen2.5 / Qwen3, and legorl's own rendering: ``<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`` blocks after the text (a ``<think>`` block, where the model writes one, stays text)."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        return read_blocks(text, "<tool_call>", _TOOL_CALL, lambda m: _one(json_call(json_object(m.group(1)))))


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class XmlFunctionParser:
    """Qwen3-Coder: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n
    </tool_call>``; a block holding JSON is read as Hermes's."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        def read(m: re.Match[str]) -> list[ToolCall] | None:
            fn = _FUNCTION.fullmatch(m.group(1).strip())
            if fn is None:
                return _one(json_call(json_object(m.group(1))))
            pairs = _only(_PARAMETER, fn.group(2))
            name = fn.group(1).strip()
            return None if pairs is None else _one(call(name, _params(pairs, name, tools, trim_newline=True)))

        return read_blocks(text, "<tool_call>", _TOOL_CALL, read)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_GLM_NAME = re.compile(r"\s*([^\s<>{}]+)\s*(.*)", re.DOTALL)


class Glm45Parser:
    """GLM-4.5 / 4.6 / 4.7: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``
    (4.7 writes the first ``<arg_key>`` right after the name)."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        def read(m: re.Match[str]) -> list[ToolCall] | None:
            head = _GLM_NAME.fullmatch(m.group(1))
            pairs = _only(_GLM_ARG, head.group(2)) if head is not None else None
            if head is None or pairs is None:
                return None
            return _one(call(head.group(1), _params(pairs, head.group(1), tools, trim_newline=False)))

        return read_blocks(text, "<tool_call>", _TOOL_CALL, read)


_MINIMAX = re.compile(r"<minimax:tool_call>(.*?)</minimax:tool_call>", re.DOTALL)
_INVOKE = re.compile(r"<invoke name=\"([^\"]+)\">(.*?)</invoke>", re.DOTALL)
_MINIMAX_PARAM = re.compile(r"<parameter name=\"([^\"]+)\">(.*?)</parameter>", re.DOTALL)


class MiniMaxM2Parser:
    """MiniMax-M2: ``<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="K">V</parameter>\\n</invoke>
    \\n</minimax:tool_call>``, one or more ``<invoke>`` per block (its ``<think>`` block stays text). The
    template writes a value right between its tags, so it is taken verbatim (a file's last newline kept)."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        def read(m: re.Match[str]) -> list[ToolCall] | None:
            invokes = _only(_INVOKE, m.group(1))
            calls = []
            for inv in invokes or []:
                pairs = _only(_MINIMAX_PARAM, inv.group(2))
                c = call(inv.group(1), _params(pairs, inv.group(1).strip(), tools, trim_newline=False)) \
                    if pairs is not None else None
                if c is None:
                    return None
                calls.append(c)
            return calls or None

        return read_blocks(text, "<minimax:tool_call>", _MINIMAX, read)


def _one(c: ToolCall | None) -> list[ToolCall] | None:
    return [c] if c is not None else None
