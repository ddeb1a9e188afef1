"""Formats that wrap their calls in a section of special tokens: DeepSeek-V3 / R1 / V3.1 and Kimi-K2."""

from __future__ import annotations

import re
from typing import Any

from legorl.models.toolformats.base import ParsedReply, call, json_object, read_blocks
from legorl.records import ToolCall

_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_DS_FENCED = re.compile(r"\s*([^\s`]+)\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


class DeepSeekParser:
    """DeepSeek-V3 / R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}
    \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; V3.1 drops the type and the fence:
    ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``. R1's ``<think>`` block stays text."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        def read(m: re.Match[str]) -> list[ToolCall] | None:
            fenced = _DS_FENCED.fullmatch(m.group(2))
            name, args = (fenced.group(1), fenced.group(2)) if fenced is not None else (m.group(1), m.group(2))
            c = call(name, json_object(args))
            return [c] if c is not None else None

        return read_blocks(text, "<｜tool▁calls▁begin｜>", _DS_CALL, read, opens=("<｜tool▁call▁begin｜>",))


_KIMI_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
                        re.DOTALL)
_KIMI_ID = re.compile(r"\s*(?:functions\.)?(.+?)(?::\d+)?\s*")


class KimiK2Parser:
    """Kimi-K2: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|><|tool_calls_section_end|>`` (the call id is ``functions.NAME:INDEX``)."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        def read(m: re.Match[str]) -> list[ToolCall] | None:
            ident = _KIMI_ID.fullmatch(m.group(1))
            c = call(ident.group(1), json_object(m.group(2))) if ident is not None else None
            return [c] if c is not None else None

        return read_blocks(text, "<|tool_calls_section_begin|>", _KIMI_CALL, read, opens=("<|tool_call_begin|>",))
