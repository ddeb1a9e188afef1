"""Formats whose calls are bare JSON after a marker: Llama 3 and Mistral."""

from __future__ import annotations

import json
import re
from typing import Any

from legorl.models.toolformats.base import ParsedReply, answered, call, json_call, malformed, plain
from legorl.records import ToolCall

_DECODER = json.JSONDecoder()


def _json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values `text` is made of (whitespace, and any of `separators`, between them), or None."""
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = _DECODER.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _json_calls(values: list[Any] | None) -> list[ToolCall] | None:
    calls = [json_call(v) for v in values or []]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


_CALL_START = re.compile(r'\{\s*"name"\s*:')


class Llama3JsonParser:
    """Llama 3.1 / 3.2 / 3.3: the whole reply is ``{"name": ..., "parameters": {...}}`` (``"arguments"`` is read
    too), several separated by ``;``; the reply may open with ``<|python_tag|>``, text before it is content.

    A reply that starts with JSON of another shape is plain text (the model answered in JSON); one that
    starts like a call (``{"name":``) or follows ``<|python_tag|>`` and does not parse is malformed.
    """

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        at = text.find("<|python_tag|>")
        body = text[at + len("<|python_tag|>"):] if at >= 0 else text
        values = _json_values(body, ";")
        # a call names its parameters: a JSON answer that merely has a "name" is not one
        calls = _json_calls(values) if all(isinstance(v, dict) and ("parameters" in v or "arguments" in v)
                                           for v in values or []) else None
        if calls is not None:
            return answered(text[:at] if at >= 0 else "", calls)
        if at >= 0 or _CALL_START.match(body.lstrip()):
            return malformed(text, "a tool call that is not JSON objects with a name and parameters: " + body[:120])
        return plain(text)


_MISTRAL_CALL = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*([A-Za-z0-9]+)\s*)?(?:\[ARGS\])?")


class MistralParser:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (tokenizers before v11: Mistral 7B v0.3,
    Nemo, Small 3) and ``[TOOL_CALLS]NAME[ARGS]{...}`` once per call (v11 on: Small 3.2, Devstral, Magistral;
    some write ``[CALL_ID]ID`` before ``[ARGS]``). Text before the first ``[TOOL_CALLS]`` is content (a
    ``[THINK]`` block stays in it)."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return plain(text)
        parts = text[at:].split("[TOOL_CALLS]")[1:]
        if parts[0].lstrip().startswith("["):  # the JSON-list form: one list, or one per marker
            values = _json_values("".join(parts)) or []
            calls = _json_calls([c for v in values for c in (v if isinstance(v, list) else [v])])
        else:
            calls = [self._named(p) for p in parts]
        if not calls or any(c is None for c in calls):
            return malformed(text, "a [TOOL_CALLS] section that does not parse: " + text[at:at + 120])
        return answered(text[:at], calls)  # type: ignore[arg-type]

    @staticmethod
    def _named(part: str) -> ToolCall | None:
        """``NAME[ARGS]{...}``: the name, then exactly one JSON object."""
        head = _MISTRAL_CALL.match(part)
        values = _json_values(part[head.end():]) if head is not None else None
        if head is None or not values or len(values) != 1:
            return None
        return call(head.group(1), values[0])
