"""What the wire formats share: the answer they render, and the `WireFormat` base class.

A wire format (openai_chat.py, openai_responses.py, anthropic_messages.py, gemini.py) does two things:

* **parse** a request body into a `ChatRequest` (request.py). The conversation part of that is
  two static methods, `conversation(body)` (the body's items in order, its top-level system prompt
  first) and `messages(items)` (those items as canonical messages), so that readers of stored
  bodies (the dashboard, monitor/messages.py) see exactly what the proxy fed the model;
* **render** the `Completion` that `CallCore` returns, as JSON or as an SSE stream.

Nothing here imports the engine or torch: the dashboard imports the wire formats to read bodies.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from legorl.models.chat_format import ChatFormat
from legorl.models.chat_format import chat_format as read_chat_format
from legorl.proxy.errors import ProxyError, openai_error_body
from legorl.proxy.logprobs import TokenTexts
from legorl.proxy.request import OPENAI, ChatRequest, Dialect, Problems, require_object
from legorl.records import LLMCall, ToolCall


@dataclass
class Choice:
    call: LLMCall
    content: str | None  # text shown to the harness (before any tool call, stop string removed)
    tool_calls: list[ToolCall]
    finish: str  # "stop" | "length" | "tool_calls" | "stop_sequence"
    stop_sequence: str | None = None
    reasoning: str | None = None  # the reply's reasoning (proxy/reasoning.py), shown in the format's own field


@dataclass
class Completion:
    """One answered request: everything a wire format needs to reply (and to replay a retry)."""

    id: str
    created: int
    model: str
    prompt_tokens: int
    choices: list[Choice]
    extra: dict[str, Any] = field(default_factory=dict)


def new_id(prefix: str, n: int = 12) -> str:
    return prefix + secrets.token_hex(n)


def sse(obj: Any, event: str | None = None) -> str:
    """One server-sent event: compact JSON data, after an `event:` line when the format names events."""
    head = f"event: {event}\n" if event else ""
    return head + "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class WireFormat:
    """The base of every wire format: ids, the start of parsing, logprob entries, the error shape."""

    name: str  # also ChatRequest.wire_format and LLMCall.wire_format
    id_prefix: str  # of the answer's id
    tool_id_prefix = "call_"  # of the tool-call ids the proxy issues
    dialect: Dialect = OPENAI  # how request problems are worded
    keepalive = ": keep-alive\n\n"  # what a slow stream sends meanwhile (an SSE comment)

    def __init__(self, tokenizer: Any = None, strict_fields: bool = True, chat_format: ChatFormat | None = None):
        self.strict_fields = strict_fields
        self.texts = TokenTexts(tokenizer) if tokenizer is not None else None
        if chat_format is None and tokenizer is not None:
            chat_format = read_chat_format(tokenizer)
        # the ids that close a turn (the checkpoint's end-of-turn and eos tokens): not part of the answer's tokens
        self.turn_end_ids = frozenset(chat_format.turn_end_ids) if chat_format is not None else frozenset()

    def new_id(self) -> str:
        return new_id(self.id_prefix)

    # ---- request --------------------------------------------------------------------------------
    def begin(self, body: Any, known: frozenset[str], check_unknown: bool = True,
              ) -> tuple[dict[str, Any], Problems, str | None]:
        """What every parse starts with: a JSON object, no unknown fields (when strict), a model name."""
        body = require_object(body)
        p = Problems(self.dialect)
        if self.strict_fields and check_unknown:
            p.unknown(body, known)
        return body, p, p.typed(body, "model", str, "a string", required=True)

    @staticmethod
    def conversation(body: dict[str, Any]) -> list[Any]:
        """The body's conversation items in order, a top-level system prompt first (as an item)."""
        raise NotImplementedError

    @staticmethod
    def messages(items: list[Any], p: Problems | None = None) -> list[dict[str, Any]]:
        """Canonical messages of conversation items; without `p`, malformed items are passed over."""
        raise NotImplementedError

    @staticmethod
    def offered_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
        """The tools the body offers the model, as canonical function tools (the parse's own reading, malformed
        ones passed over)."""
        raise NotImplementedError

    @staticmethod
    def failed_tool_results(items: list[Any]) -> set[str]:
        """Tool-call ids whose results the harness marked as errors (a flag the model does not see)."""
        return set()

    # ---- answers --------------------------------------------------------------------------------
    def token_entries(self, c: Choice, req: ChatRequest) -> list[dict[str, Any]]:
        """Logprob entries of the completion's tokens, the closing end-of-turn token left out."""
        assert self.texts is not None, "a wire format that renders logprobs needs the tokenizer"
        ids, lps = c.call.completion_ids, c.call.completion_logprobs
        if ids and ids[-1] in self.turn_end_ids:
            ids, lps = ids[:-1], lps[:-1]
        return self.texts.entries(ids, lps, req.top_logprobs)

    # ---- errors ---------------------------------------------------------------------------------
    def error_body(self, e: ProxyError) -> dict[str, Any]:
        return openai_error_body(e)
