"""OpenAI Responses (`POST /v1/responses`), streaming and not. Codex CLI speaks this.

Input items become canonical messages: `message` items by role (developer -> system), a
`function_call` / `custom_tool_call` joins the assistant message before it, each
`function_call_output` / `custom_tool_call_output` is a tool message. The text of `reasoning` items
(their `reasoning_text` content, else their summary) is the `reasoning_content` of the assistant message
after them; a reasoning model's reasoning is answered as a `reasoning` output item. Function tools, custom
(freeform) tools (offered as a function with one string parameter `input`) and the function
tools inside a `namespace` are offered to the model; hosted tools (web search, file search...)
are not. `previous_response_id` continues a response this session answered with store != false.
"""

from __future__ import annotations

import json
from typing import Any

from legorl.proxy.bridge import reply_message
from legorl.proxy.errors import ProxyError, openai_error_body
from legorl.proxy.request import MAX_TOP_LOGPROBS, ChatRequest, Problems, function_tool
from legorl.proxy.wire import Choice, Completion, WireFormat, new_id, sse

KNOWN = frozenset({
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "max_output_tokens",
    "max_tool_calls", "temperature", "top_p", "top_logprobs", "stream", "stream_options", "store", "metadata",
    "previous_response_id", "reasoning", "text", "truncation", "user", "include", "prompt", "prompt_cache_key",
    "prompt_cache_retention", "prompt_cache_options", "safety_identifier", "service_tier", "background",
    "background_options", "conversation", "context_management", "client_metadata", "access_programs", "image",
    "moderation",
})
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
SKIPPED_ITEMS = ("compaction", "compaction_summary")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _sse(obj: dict[str, Any]) -> str:
    return sse(obj, obj["type"])


class OpenAIResponses(WireFormat):
    name = "openai_responses"
    id_prefix = "resp_"

    # ---- request --------------------------------------------------------------------------------
    def parse(self, body: Any, headers: Any = None) -> ChatRequest:
        body, p, model = self.begin(body, KNOWN)
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            p.add("instructions", "'instructions' must be a string")
        prev = p.typed(body, "previous_response_id", str, "a string")
        raw = body.get("input")
        conv: list[dict[str, Any]] = []
        if isinstance(raw, str):
            conv.append({"role": "user", "content": raw})
        elif isinstance(raw, list) and (raw or prev):
            conv = self.messages(raw, p)
        else:
            p.add("input", "'input' must be a string or a non-empty array of input items")
        tools, custom, namespaces = _tools(body.get("tools"), p)
        p.number(body, "temperature", 0, 2)
        p.number(body, "top_p", 0, 1)
        max_tokens = p.integer(body, "max_output_tokens", 1)
        top = p.integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        stream = p.boolean(body, "stream")
        include = p.typed(body, "include", list, "an array of strings") or []
        choice = p.openai_tool_choice(body)
        p.raise_if_any()
        system = [{"role": "system", "content": instructions}] if instructions else []
        return ChatRequest(
            wire_format=self.name, body=body, messages=system + conv, tools=tools, model=model or "",
            max_tokens=max_tokens, stream=stream, parse_tools=bool(tools) and choice != "none",
            logprobs=bool(top) or LOGPROBS_INCLUDE in include, top_logprobs=top,
            extra={"custom": custom, "namespaces": namespaces, "previous_response_id": prev,
                   "n_system": len(system), "conv": conv},
        )

    @staticmethod
    def conversation(body: dict[str, Any]) -> list[Any]:
        items = body.get("input")
        if isinstance(items, str):
            items = [{"type": "message", "role": "user", "content": items}]
        head = [{"type": "message", "role": "system", "content": body["instructions"]}] if (
            body.get("instructions")) else []
        return head + (list(items) if isinstance(items, list) else [])

    @staticmethod
    def messages(items: list[Any], p: Problems | None = None) -> list[dict[str, Any]]:
        return _items(items, p or Problems())

    @staticmethod
    def offered_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
        return _tools(body.get("tools"), Problems())[0] or []

    def resolve_previous(self, req: ChatRequest, responses: dict[str, list[dict[str, Any]]]) -> None:
        """Prepend the conversation of `previous_response_id` (answered earlier in this session)."""
        prev = req.extra.get("previous_response_id")
        if not prev:
            return
        if prev not in responses:
            raise ProxyError(f"Previous response with id '{prev}' not found (this proxy keeps the responses "
                             "of the current session that were created with store != false).",
                             param="previous_response_id")
        n = req.extra["n_system"]
        req.messages = req.messages[:n] + responses[prev] + req.messages[n:]
        req.extra["conv"] = responses[prev] + req.extra["conv"]

    def remember(self, comp: Completion, req: ChatRequest, responses: dict[str, list[dict[str, Any]]]) -> None:
        if req.body.get("store") is False:
            return
        c = comp.choices[0]
        responses[comp.id] = req.extra["conv"] + [reply_message(c.content, c.tool_calls, c.reasoning)]

    # ---- answers --------------------------------------------------------------------------------
    def _items_of(self, comp: Completion, req: ChatRequest) -> list[dict[str, Any]]:
        """Output items (ids are fixed on first use so a replayed retry answers identically)."""
        if "items" in comp.extra:
            return comp.extra["items"]
        c = comp.choices[0]
        items: list[dict[str, Any]] = []
        if c.reasoning:  # raw reasoning as `content` (vLLM's shape), no summary: none was made
            items.append({"type": "reasoning", "id": new_id("rs_"), "summary": [], "status": "completed",
                          "content": [{"type": "reasoning_text", "text": c.reasoning}]})
        if c.content or not c.tool_calls:
            part: dict[str, Any] = {"type": "output_text", "text": c.content or "", "annotations": []}
            part["logprobs"] = self._logprobs(c, req)
            items.append({"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant",
                          "content": [part]})
        custom, namespaces = req.extra.get("custom", set()), req.extra.get("namespaces", {})
        for t in c.tool_calls:
            if t.name in custom:
                args = json.loads(t.arguments)
                text = args["input"] if set(args) == {"input"} and isinstance(args["input"], str) else t.arguments
                items.append({"type": "custom_tool_call", "id": new_id("ctc_"), "call_id": t.id, "name": t.name,
                              "input": text, "status": "completed"})
            else:
                item = {"type": "function_call", "id": new_id("fc_"), "call_id": t.id, "name": t.name,
                        "arguments": t.arguments, "status": "completed"}
                if t.name in namespaces:
                    item["namespace"] = namespaces[t.name]
                items.append(item)
        comp.extra["items"] = items
        return items

    def _logprobs(self, c: Choice, req: ChatRequest) -> list[dict[str, Any]]:
        return self.token_entries(c, req) if req.logprobs else []

    def _response(self, comp: Completion, req: ChatRequest, status: str, output: list[dict[str, Any]],
                  usage: bool) -> dict[str, Any]:
        b = req.body
        c = comp.choices[0]
        incomplete = status == "incomplete" or (status == "final" and c.finish == "length")
        final_status = "incomplete" if incomplete else ("completed" if status == "final" else status)
        n_out = len(c.call.completion_ids)
        return {
            "id": comp.id, "object": "response", "created_at": comp.created, "status": final_status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "max_tool_calls": b.get("max_tool_calls"), "model": comp.model, "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None}, "store": b.get("store", True),
            "temperature": b.get("temperature", 1.0), "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"), "tools": b.get("tools") or [],
            "top_logprobs": b.get("top_logprobs", 0), "top_p": b.get("top_p", 1.0), "truncation": "disabled",
            "usage": {"input_tokens": comp.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": comp.prompt_tokens + n_out} if usage else None,
            "user": b.get("user"), "metadata": b.get("metadata") or {},
        }

    def answer(self, comp: Completion, req: ChatRequest) -> dict[str, Any]:
        return self._response(comp, req, "final", self._items_of(comp, req), usage=True)

    def stream(self, comp: Completion, req: ChatRequest) -> str:
        items = self._items_of(comp, req)
        events: list[dict[str, Any]] = []
        started = self._response(comp, req, "in_progress", [], usage=False)
        events.append({"type": "response.created", "response": started})
        events.append({"type": "response.in_progress", "response": started})
        for k, item in enumerate(items):
            iid = item["id"]
            if item["type"] == "message":
                part = item["content"][0]
                events.append({"type": "response.output_item.added", "output_index": k,
                               "item": {**item, "status": "in_progress", "content": []}})
                events.append({"type": "response.content_part.added", "item_id": iid, "output_index": k,
                               "content_index": 0, "part": {**part, "text": "", "logprobs": []}})
                events.append({"type": "response.output_text.delta", "item_id": iid, "output_index": k,
                               "content_index": 0, "delta": part["text"], "logprobs": part["logprobs"]})
                events.append({"type": "response.output_text.done", "item_id": iid, "output_index": k,
                               "content_index": 0, "text": part["text"], "logprobs": part["logprobs"]})
                events.append({"type": "response.content_part.done", "item_id": iid, "output_index": k,
                               "content_index": 0, "part": part})
            elif item["type"] == "reasoning":
                text = item["content"][0]["text"]
                events.append({"type": "response.output_item.added", "output_index": k,
                               "item": {**item, "status": "in_progress", "content": []}})
                events.append({"type": "response.reasoning_text.delta", "item_id": iid, "output_index": k,
                               "content_index": 0, "delta": text})
                events.append({"type": "response.reasoning_text.done", "item_id": iid, "output_index": k,
                               "content_index": 0, "text": text})
            elif item["type"] == "function_call":
                events.append({"type": "response.output_item.added", "output_index": k,
                               "item": {**item, "arguments": "", "status": "in_progress"}})
                events.append({"type": "response.function_call_arguments.delta", "item_id": iid,
                               "output_index": k, "delta": item["arguments"]})
                events.append({"type": "response.function_call_arguments.done", "item_id": iid,
                               "output_index": k, "name": item["name"], "arguments": item["arguments"]})
            else:
                events.append({"type": "response.output_item.added", "output_index": k,
                               "item": {**item, "input": "", "status": "in_progress"}})
                events.append({"type": "response.custom_tool_call_input.delta", "item_id": iid,
                               "output_index": k, "delta": item["input"]})
                events.append({"type": "response.custom_tool_call_input.done", "item_id": iid,
                               "output_index": k, "input": item["input"]})
            events.append({"type": "response.output_item.done", "output_index": k, "item": item})
        final = self._response(comp, req, "final", items, usage=True)
        done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append({"type": done, "response": final})
        return "".join(_sse({"type": e["type"], "sequence_number": i, **e}) for i, e in enumerate(events))

    # ---- errors ---------------------------------------------------------------------------------
    def stream_error(self, e: ProxyError) -> str:
        err = openai_error_body(e)["error"]
        return _sse({"type": "error", "sequence_number": 0, "code": err["code"], "message": err["message"],
                     "param": err["param"]})


def _text_of(content: Any, where: str, p: Problems) -> str | None:
    return p.content_text(content, where, TEXT_PARTS)


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its raw `reasoning_text` content, else its summary (encrypted content is opaque)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        texts = [x["text"] for x in parts if isinstance(x, dict) and isinstance(x.get("text"), str)] \
            if isinstance(parts, list) else []
        if texts:
            return "\n".join(texts)
    return ""


def _items(items: list[Any], p: Problems) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items not yet given to an assistant message

    def assistant(msg: dict[str, Any]) -> dict[str, Any]:
        """An assistant message, with the reasoning items before it."""
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        return msg

    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            p.add(where, f"{where} must be an object")
            continue
        kind = it.get("type") or ("message" if "role" in it else None)
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                p.add(f"{where}.role", f"{where}.role must be user, system, developer or assistant")
                continue
            text = _text_of(it.get("content"), f"{where}.content", p)
            if text is not None:
                msg = {"role": "system" if role == "developer" else role, "content": text}
                out.append(assistant(msg) if role == "assistant" else msg)
        elif kind in ("function_call", "custom_tool_call"):
            name, call_id = it.get("name"), it.get("call_id")
            raw = it.get("arguments") if kind == "function_call" else it.get("input")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(raw, str):
                field = "arguments" if kind == "function_call" else "input"
                p.add(where, f"{where} ({kind}) needs string 'name', 'call_id' and '{field}'")
                continue
            args: Any = raw if kind == "function_call" else {"input": raw}
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                assistant(out[-1]).setdefault("tool_calls", []).append(call)
            else:
                out.append(assistant({"role": "assistant", "content": None, "tool_calls": [call]}))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = it.get("call_id")
            text = _text_of(it.get("output"), f"{where}.output", p)
            if not isinstance(call_id, str):
                p.add(f"{where}.call_id", f"{where}.call_id must be a string")
                continue
            if text is not None:
                out.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            if _reasoning_text(it):
                reasoning.append(_reasoning_text(it))
        elif kind in SKIPPED_ITEMS:
            continue
        else:
            p.add(f"{where}.type", f"{where}: input items of type {kind!r} are not supported by this proxy "
                                   "(send message, function_call, function_call_output, custom_tool_call, "
                                   "custom_tool_call_output or reasoning items)")
    return out


def _tools(tools: Any, p: Problems) -> tuple[list[dict[str, Any]] | None, set[str], dict[str, str]]:
    custom: set[str] = set()
    namespaces: dict[str, str] = {}
    tools = p.tool_array(tools)
    if tools is None:
        return None, custom, namespaces
    out = []

    def add(t: dict[str, Any], where: str, ns: str | None) -> None:
        kind = t.get("type")
        if kind not in ("function", "custom"):
            return  # hosted tools (web_search, file_search, ...) are not offered to the model
        if not isinstance(t.get("name"), str):
            p.add(where, f"{where} must have a string 'name'")
            return
        if kind == "custom":
            custom.add(t["name"])
            params = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
            out.append(function_tool(t["name"], t.get("description"), params))
        else:
            out.append(function_tool(t["name"], t.get("description"), t.get("parameters")))
        if ns:
            namespaces[t["name"]] = ns

    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            p.add(f"tools[{i}]", f"tools[{i}] must be an object")
            continue
        if t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            for j, inner in enumerate(t["tools"]):
                if isinstance(inner, dict):
                    add(inner, f"tools[{i}].tools[{j}]", str(t.get("name") or ""))
        else:
            add(t, f"tools[{i}]", None)
    return out or None, custom, namespaces
