"""gpt-oss's harmony format: a reply is a run of messages on channels.

The prompt ends with ``<|start|>assistant``, so a sampled reply reads::

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

or ends with ``<|channel|>final<|message|>ANSWER<|return|>``. The recipient (``to=functions.NAME``) may
also sit in the role part (``<|start|>assistant to=functions.NAME<|channel|>commentary json``). The
closing ``<|call|>`` / ``<|return|>`` is a stop token, so the proxy's text usually lacks it.
"""

from __future__ import annotations

import re
from typing import Any

from legorl.models.toolformats.base import ParsedReply, call, json_object, malformed, plain

_MESSAGE = re.compile(r"(?:<\|start\|>(?P<role>[^<]*))?<\|channel\|>(?P<header>.*?)<\|message\|>"
                      r"(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|\Z)", re.DOTALL)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class HarmonyParser:
    """Calls are the messages addressed to ``functions.NAME``; content is the ``final`` channel's text, else
    the ``commentary`` preamble's; the ``analysis`` channel is the reply's reasoning (returned in the wire
    format's reasoning field; it stays in the recorded completion text). A reply without channels is plain text."""

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedReply:
        if "<|channel|>" not in text:
            return plain(text)
        messages = list(_MESSAGE.finditer(text))
        if len(messages) != text.count("<|channel|>"):  # a header without its <|message|>: cut short
            return malformed(text, "a harmony message header without a message: " + text[-120:])
        final: list[str] = []
        preamble: list[str] = []
        analysis: list[str] = []
        calls = []
        for m in messages:
            header = m.group("header")
            channel = header.split(" ", 1)[0].split("<", 1)[0].strip()
            to = _RECIPIENT.search(f"{m.group('role') or ''} {header}")
            if to is None:
                by_channel = {"final": final, "commentary": preamble, "analysis": analysis}
                by_channel.get(channel, []).append(m.group("body"))
                continue
            recipient = to.group(1)
            c = call(recipient.removeprefix("functions."), json_object(m.group("body"))) \
                if recipient.startswith("functions.") else None
            if c is None:
                return malformed(text, f"a message to {recipient} that is not a function call with JSON arguments: "
                                       + m.group("body")[:120])
            calls.append(c)
        content = "".join(final) or "".join(preamble)
        return ParsedReply(content.strip() or None, calls, reasoning="\n".join(analysis).strip() or None)
