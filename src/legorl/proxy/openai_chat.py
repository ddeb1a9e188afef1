"""OpenAI Chat Completions (`POST /v1/chat/completions`), streaming and not."""

from __future__ import annotations

from typing import Any

from legorl.proxy.errors import ProxyError, openai_error_body
from legorl.proxy.request import MAX_N, MAX_TOP_LOGPROBS, ChatRequest, Problems, function_tool
from legorl.proxy.wire import Choice, Completion, WireFormat, sse

ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
KNOWN = frozenset({
    "model", "messages", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "service_tier", "stop",
    "stream", "stream_options", "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", "user",
    "function_call", "functions", "metadata", "modalities", "audio", "prediction", "reasoning_effort", "store",
    "web_search_options", "verbosity", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
    # vLLM / SGLang sampling extensions some harnesses send
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "skip_special_tokens", "min_tokens",
    "include_stop_str_in_output", "ignore_eos", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "echo", "return_tokens_as_token_ids", "thinking", "reasoning",
})
TEXT_PARTS = ("text", "input_text", "output_text")


class OpenAIChat(WireFormat):
    name = "openai_chat"
    id_prefix = "chatcmpl-"

    # ---- request --------------------------------------------------------------------------------
    def parse(self, body: Any, headers: Any = None) -> ChatRequest:
        body, p, model = self.begin(body, KNOWN)
        raw = body.get("messages")
        messages: list[dict[str, Any]] = []
        if not isinstance(raw, list) or not raw:
            p.add("messages", "'messages' must be a non-empty array of message objects")
        else:
            messages = self.messages(raw, p)
        tools = _tools(body, p)
        p.number(body, "temperature", 0, 2)
        p.number(body, "top_p", 0, 1)
        max_tokens = p.integer(body, "max_completion_tokens", 1) or p.integer(body, "max_tokens", 1)
        n = p.integer(body, "n", 1, MAX_N) or 1
        stream = p.boolean(body, "stream")
        logprobs = p.boolean(body, "logprobs")
        top = p.integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not logprobs:
            p.add("top_logprobs", "'top_logprobs' requires 'logprobs': true")
        seed = p.integer(body, "seed")
        stop = p.stop_list(body, "stop", limit=4)
        opts = p.typed(body, "stream_options", dict, "an object") or {}
        choice = p.openai_tool_choice(body)
        p.raise_if_any()
        return ChatRequest(
            wire_format=self.name, body=body, messages=messages, tools=tools, model=model or "",
            max_tokens=max_tokens, stop=stop, seed=seed, n=n, stream=stream,
            parse_tools=bool(tools) and choice != "none", logprobs=logprobs, top_logprobs=top,
            extra={"include_usage": bool(opts.get("include_usage"))},
        )

    @staticmethod
    def conversation(body: dict[str, Any]) -> list[Any]:
        items = body.get("messages")
        return list(items) if isinstance(items, list) else []

    @staticmethod
    def messages(items: list[Any], p: Problems | None = None) -> list[dict[str, Any]]:
        p = p or Problems()
        return [msg for i, m in enumerate(items) if (msg := _message(m, i, p)) is not None]

    @staticmethod
    def offered_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
        return _tools(body, Problems()) or []

    # ---- answers --------------------------------------------------------------------------------
    def _logprobs(self, choice: Choice, req: ChatRequest) -> dict[str, Any] | None:
        return {"content": self.token_entries(choice, req), "refusal": None} if req.logprobs else None

    @staticmethod
    def _finish(c: Choice) -> str:
        return "stop" if c.finish == "stop_sequence" else c.finish

    @staticmethod
    def _usage(comp: Completion) -> dict[str, Any]:
        completion = sum(len(c.call.completion_ids) for c in comp.choices)
        return {"prompt_tokens": comp.prompt_tokens, "completion_tokens": completion,
                "total_tokens": comp.prompt_tokens + completion}

    @staticmethod
    def _tool_calls(c: Choice) -> list[dict[str, Any]]:
        return [{"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                for t in c.tool_calls]

    def answer(self, comp: Completion, req: ChatRequest) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(comp.choices):
            msg: dict[str, Any] = {"role": "assistant", "content": c.content, "refusal": None}
            if c.reasoning:  # vLLM's and DeepSeek's field for it
                msg["reasoning_content"] = c.reasoning
            if c.tool_calls:
                msg["tool_calls"] = self._tool_calls(c)
            choices.append({"index": i, "message": msg, "logprobs": self._logprobs(c, req),
                            "finish_reason": self._finish(c)})
        return {"id": comp.id, "object": "chat.completion", "created": comp.created, "model": comp.model,
                "choices": choices, "usage": self._usage(comp), "system_fingerprint": None}

    def stream(self, comp: Completion, req: ChatRequest) -> str:
        include_usage = req.extra.get("include_usage", False)
        head = {"id": comp.id, "object": "chat.completion.chunk", "created": comp.created, "model": comp.model,
                "system_fingerprint": None}

        def chunk(i: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
            obj = {**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return sse(obj)

        out = []
        for i, c in enumerate(comp.choices):
            out.append(chunk(i, {"role": "assistant", "content": "", "refusal": None}))
            if c.reasoning:
                out.append(chunk(i, {"reasoning_content": c.reasoning}))
            lp = self._logprobs(c, req)
            if c.content or lp:
                out.append(chunk(i, {"content": c.content or ""}, logprobs=lp))
            for k, t in enumerate(c.tool_calls):
                out.append(chunk(i, {"tool_calls": [{"index": k, "id": t.id, "type": "function",
                                                     "function": {"name": t.name, "arguments": ""}}]}))
                out.append(chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": t.arguments}}]}))
            out.append(chunk(i, {}, finish=self._finish(c)))
        if include_usage:
            out.append(sse({**head, "choices": [], "usage": self._usage(comp)}))
        out.append("data: [DONE]\n\n")
        return "".join(out)

    # ---- errors ---------------------------------------------------------------------------------
    def stream_error(self, e: ProxyError) -> str:
        return sse(openai_error_body(e)) + "data: [DONE]\n\n"


def _message(m: Any, i: int, p: Problems) -> dict[str, Any] | None:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        p.add(where, f"{where} must be an object with a role of system, developer, user, assistant or tool")
        return None
    role = m["role"]
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
        p.add(f"{where}.content", f"{where}.content must be a string, an array of content parts or null")
        return None
    if isinstance(content, list):
        content = p.content_text(content, f"{where}.content", TEXT_PARTS)
        if content is None:
            return None
    if role == "developer":
        role = "system"
    out: dict[str, Any] = {"role": "tool" if role == "function" else role, "content": content}
    reasoning = m.get("reasoning_content", m.get("reasoning"))  # sent back with an earlier reply (vLLM spells both)
    if role == "assistant" and isinstance(reasoning, str) and reasoning:
        out["reasoning_content"] = reasoning
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            p.add(f"{where}.tool_calls", f"{where}.tool_calls must be an array on an assistant message")
            return None
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                    not isinstance(fn.get("arguments", ""), (str, dict)):
                p.add(f"{where}.tool_calls[{j}]",
                      f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': {{'name', "
                      "'arguments'}}}")
                return None
        if calls:
            out["tool_calls"] = calls
    if role in ("tool", "function"):
        tcid = m.get("tool_call_id", m.get("name"))
        if role == "tool" and not isinstance(tcid, str):
            p.add(f"{where}.tool_call_id", f"{where}.tool_call_id must be a string on a tool message")
            return None
        out["tool_call_id"] = tcid
    return out


def _tools(body: dict[str, Any], p: Problems) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None and isinstance(body.get("functions"), list):  # the legacy form
        tools = [{"type": "function", "function": f} for f in body["functions"]]
    tools = p.tool_array(tools)
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            if isinstance(t, dict) and t.get("type") not in (None, "function"):
                continue  # a hosted tool (custom, web search): not renderable, not offered to the model
            p.add(f"tools[{i}]", f"tools[{i}] must be {{'type': 'function', 'function': {{'name', ...}}}}")
            continue
        out.append(function_tool(fn["name"], fn.get("description"), fn.get("parameters")))
    return out or None
