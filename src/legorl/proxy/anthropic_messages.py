"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`), streaming and not.

Content blocks become canonical messages: text blocks are joined, `tool_use` blocks become
tool calls of the assistant message, each `tool_result` block becomes a tool message (before
the text of the same user turn), an assistant's `thinking` blocks its `reasoning_content`. Redacted
thinking, images and documents are not rendered; `cache_control`, `thinking`, `context_management` and other
beta fields are accepted and ignored. A reasoning model's reasoning is answered as a `thinking` block. With an `anthropic-beta` header, unknown top-level fields
are accepted too (a beta may add any field).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from legorl.proxy.errors import ProxyError, anthropic_error_body
from legorl.proxy.request import ANTHROPIC, ChatRequest, Problems, function_tool, join_texts
from legorl.proxy.wire import Choice, Completion, WireFormat, sse

KNOWN = frozenset({
    "model", "messages", "max_tokens", "system", "metadata", "stop_sequences", "stream", "temperature",
    "top_p", "top_k", "tools", "tool_choice", "thinking", "service_tier", "container", "mcp_servers",
    "context_management", "output_config", "output_format", "inference_geo", "speed", "betas",
})
COUNT_KNOWN = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "mcp_servers",
                         "context_management", "output_config", "output_format", "betas"})
STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
               "stop_sequence": "stop_sequence"}


def _sse(event: str, obj: Any) -> str:
    return sse(obj, event)


class AnthropicMessages(WireFormat):
    name = "anthropic_messages"
    id_prefix = "msg_"
    tool_id_prefix = "toolu_"
    dialect = ANTHROPIC

    # ---- request --------------------------------------------------------------------------------
    def parse(self, body: Any, headers: Any = None, *, count_only: bool = False) -> ChatRequest:
        beta = headers is not None and bool(headers.get("anthropic-beta"))
        body, p, model = self.begin(body, COUNT_KNOWN if count_only else KNOWN, check_unknown=not beta)
        max_tokens = None if count_only else p.integer(body, "max_tokens", 1, required=True)
        messages: list[dict[str, Any]] = []
        system = body.get("system")
        if system is not None:
            text = _blocks_text(system, "system", p)
            if text is not None:
                messages.append({"role": "system", "content": text})
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            p.add("messages", "messages: must be a non-empty array of {role, content} objects")
        else:
            messages += self.messages(raw, p)
        tools = _tools(body.get("tools"), p)
        p.number(body, "temperature", 0, 1)
        p.number(body, "top_p", 0, 1)
        p.integer(body, "top_k", 0)
        stream = p.boolean(body, "stream")
        stop = p.stop_list(body, "stop_sequences")
        choice = body.get("tool_choice")
        if choice is not None and not (isinstance(choice, dict) and isinstance(choice.get("type"), str)):
            p.add("tool_choice", "tool_choice: must be an object with a 'type' (auto, any, tool or none)")
        p.raise_if_any()
        no_tools = isinstance(choice, dict) and choice.get("type") == "none"
        return ChatRequest(wire_format=self.name, body=body, messages=messages, tools=tools, model=model or "",
                           max_tokens=max_tokens, stop=stop, stream=stream,
                           parse_tools=bool(tools) and not no_tools)

    @staticmethod
    def conversation(body: dict[str, Any]) -> list[Any]:
        items = body.get("messages")
        head = [{"role": "system", "content": body["system"]}] if body.get("system") is not None else []
        return head + (list(items) if isinstance(items, list) else [])

    @staticmethod
    def messages(items: list[Any], p: Problems | None = None) -> list[dict[str, Any]]:
        p = p or Problems(ANTHROPIC)
        return [msg for i, m in enumerate(items) for msg in _message(m, i, p)]

    @staticmethod
    def offered_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
        return _tools(body.get("tools"), Problems(ANTHROPIC)) or []

    @staticmethod
    def failed_tool_results(items: list[Any]) -> set[str]:
        """`tool_result` blocks with `is_error: true` (not rendered: the template has no such flag)."""
        return {b["tool_use_id"] for m in items if isinstance(m, dict) and isinstance(m.get("content"), list)
                for b in m["content"] if isinstance(b, dict) and b.get("type") == "tool_result"
                and b.get("is_error") and isinstance(b.get("tool_use_id"), str)}

    # ---- answers --------------------------------------------------------------------------------
    @staticmethod
    def _content(c: Choice) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = []
        if c.reasoning:
            blocks.append({"type": "thinking", "thinking": c.reasoning, "signature": _signature(c.reasoning)})
        if c.content or not c.tool_calls:
            blocks.append({"type": "text", "text": c.content or ""})
        for t in c.tool_calls:
            blocks.append({"type": "tool_use", "id": t.id, "name": t.name, "input": json.loads(t.arguments)})
        return blocks

    @staticmethod
    def _usage(comp: Completion, output_tokens: int) -> dict[str, Any]:
        return {"input_tokens": comp.prompt_tokens, "output_tokens": output_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def answer(self, comp: Completion, req: ChatRequest) -> dict[str, Any]:
        c = comp.choices[0]
        return {"id": comp.id, "type": "message", "role": "assistant", "model": comp.model,
                "content": self._content(c), "stop_reason": STOP_REASON[c.finish],
                "stop_sequence": c.stop_sequence, "usage": self._usage(comp, len(c.call.completion_ids))}

    def stream(self, comp: Completion, req: ChatRequest) -> str:
        c = comp.choices[0]
        start = {"id": comp.id, "type": "message", "role": "assistant", "model": comp.model, "content": [],
                 "stop_reason": None, "stop_sequence": None, "usage": self._usage(comp, 1)}
        out = [_sse("message_start", {"type": "message_start", "message": start}), _sse("ping", {"type": "ping"})]
        for i, block in enumerate(self._content(c)):
            if block["type"] == "thinking":
                out.append(_sse("content_block_start", {"type": "content_block_start", "index": i,
                                                        "content_block": {**block, "thinking": "", "signature": ""}}))
                for delta in ({"type": "thinking_delta", "thinking": block["thinking"]},
                              {"type": "signature_delta", "signature": block["signature"]}):
                    out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": i,
                                                            "delta": delta}))
            elif block["type"] == "text":
                out.append(_sse("content_block_start", {"type": "content_block_start", "index": i,
                                                        "content_block": {"type": "text", "text": ""}}))
                if block["text"]:
                    out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": i,
                                                            "delta": {"type": "text_delta", "text": block["text"]}}))
            else:
                first = {**block, "input": {}}
                out.append(_sse("content_block_start", {"type": "content_block_start", "index": i,
                                                        "content_block": first}))
                partial = json.dumps(block["input"], ensure_ascii=False)
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": i,
                                                        "delta": {"type": "input_json_delta",
                                                                  "partial_json": partial}}))
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": i}))
        out.append(_sse("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": STOP_REASON[c.finish],
                                                    "stop_sequence": c.stop_sequence},
                                          "usage": self._usage(comp, len(c.call.completion_ids))}))
        out.append(_sse("message_stop", {"type": "message_stop"}))
        return "".join(out)

    # ---- errors ---------------------------------------------------------------------------------
    def error_body(self, e: ProxyError) -> dict[str, Any]:
        return anthropic_error_body(e)

    def stream_error(self, e: ProxyError) -> str:
        return _sse("error", anthropic_error_body(e))


def _signature(thinking: str) -> str:
    """The `signature` Anthropic's thinking blocks carry (SDKs require one): a digest of the text. Harnesses send
    it back with the block; the proxy does not check it (the reasoning is rendered from the block's text)."""
    return hashlib.sha256(thinking.encode()).hexdigest()


def _blocks_text(content: Any, where: str, p: Problems) -> str | None:
    """Text of a string or an array of text blocks (other block types are not rendered)."""
    return p.content_text(content, where, ("text",), refusals=False, join=join_texts)


def _message(m: Any, i: int, p: Problems) -> list[dict[str, Any]]:
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        p.add(where, f"{where}: must be an object with role 'user' or 'assistant'")
        return []
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        p.add(f"{where}.content", f"{where}.content: must be a string or an array of content blocks")
        return []
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        bw = f"{where}.content.{j}"
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            p.add(bw, f"{bw}: must be a content block object with a 'type'")
            return []
        kind = b["type"]
        if kind == "text":
            if not isinstance(b.get("text"), str):
                p.add(f"{bw}.text", f"{bw}.text: must be a string")
                return []
            texts.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thinking.append(b["thinking"])
        elif kind in ("tool_use", "server_tool_use"):
            if role != "assistant" or not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                p.add(bw, f"{bw}: tool_use blocks need a name and an object input, on an assistant message")
                return []
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        elif kind == "tool_result":
            if not isinstance(b.get("tool_use_id"), str):
                p.add(f"{bw}.tool_use_id", f"{bw}.tool_use_id: must be a string")
                return []
            inner = b.get("content")
            text = "" if inner is None else _blocks_text(inner, f"{bw}.content", p)
            if text is None:
                return []
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        # redacted_thinking, image, document, search results...: accepted, not rendered
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": join_texts(texts) or None}
        if join_texts(thinking):
            msg["reasoning_content"] = join_texts(thinking)
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out = list(results)
    if texts or not results:
        out.append({"role": role, "content": join_texts(texts)})
    return out


def _tools(tools: Any, p: Problems) -> list[dict[str, Any]] | None:
    tools = p.tool_array(tools)
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            p.add(f"tools.{i}", f"tools.{i}: must be an object with a 'name'")
            continue
        if t.get("defer_loading") or t.get("type") not in (None, "custom"):
            continue  # deferred (not loaded yet) or a server/built-in tool: not offered to the model
        out.append(function_tool(t["name"], t.get("description"), t.get("input_schema")))
    return out or None
