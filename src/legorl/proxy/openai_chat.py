"""OpenAI Chat Completions (`POST /v1/chat/completions`), streaming and not."""

from __future__ import annotations

import json
from typing import Any

from legorl.proxy.core import Choice, Completion, new_id
from legorl.proxy.errors import ProxyError, openai_error_body
from legorl.proxy.logprobs import TokenTexts
from legorl.proxy.request import MAX_N, MAX_TOP_LOGPROBS, ChatRequest, Problems, function_tool, require_object

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


def _sse(obj: Any) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class OpenAIChat:
    name = "openai_chat"
    tool_id_prefix = "call_"

    def __init__(self, tokenizer: Any, strict_fields: bool = True):
        self.texts = TokenTexts(tokenizer)
        self.strict_fields = strict_fields
        self.eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def new_id(self) -> str:
        return new_id("chatcmpl-")

    # ---- request --------------------------------------------------------------------------------
    def parse(self, body: Any, headers: Any = None) -> ChatRequest:
        body = require_object(body)
        p = Problems()
        if self.strict_fields:
            p.unknown(body, KNOWN)
        model = p.typed(body, "model", str, "a string", required=True)
        raw = body.get("messages")
        messages: list[dict[str, Any]] = []
        if not isinstance(raw, list) or not raw:
            p.add("messages", "'messages' must be a non-empty array of message objects")
        else:
            for i, m in enumerate(raw):
                msg = _message(m, i, p)
                if msg is not None:
                    messages.append(msg)
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
        choice = body.get("tool_choice")
        if choice is not None and not (choice in ("none", "auto", "required") or isinstance(choice, dict)):
            p.add("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or an object")
        p.raise_if_any()
        return ChatRequest(
            wire_format=self.name, body=body, messages=messages, tools=tools, model=model or "",
            max_tokens=max_tokens, stop=stop, seed=seed, n=n, stream=stream,
            parse_tools=bool(tools) and choice != "none", logprobs=logprobs, top_logprobs=top,
            extra={"include_usage": bool(opts.get("include_usage"))},
        )

    # ---- answers --------------------------------------------------------------------------------
    def _logprobs(self, choice: Choice, req: ChatRequest) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        ids, lps = choice.call.completion_ids, choice.call.completion_logprobs
        if ids and ids[-1] == self.eos_id:
            ids, lps = ids[:-1], lps[:-1]
        return {"content": self.texts.entries(ids, lps, req.top_logprobs), "refusal": None}

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
            return _sse(obj)

        out = []
        for i, c in enumerate(comp.choices):
            out.append(chunk(i, {"role": "assistant", "content": "", "refusal": None}))
            lp = self._logprobs(c, req)
            if c.content or lp:
                out.append(chunk(i, {"content": c.content or ""}, logprobs=lp))
            for k, t in enumerate(c.tool_calls):
                out.append(chunk(i, {"tool_calls": [{"index": k, "id": t.id, "type": "function",
                                                     "function": {"name": t.name, "arguments": ""}}]}))
                out.append(chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": t.arguments}}]}))
            out.append(chunk(i, {}, finish=self._finish(c)))
        if include_usage:
            out.append(_sse({**head, "choices": [], "usage": self._usage(comp)}))
        out.append("data: [DONE]\n\n")
        return "".join(out)

    # ---- errors ---------------------------------------------------------------------------------
    def error_body(self, e: ProxyError) -> dict[str, Any]:
        return openai_error_body(e)

    def stream_error(self, e: ProxyError) -> str:
        return _sse(openai_error_body(e)) + "data: [DONE]\n\n"


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
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                p.add(f"{where}.content[{j}]", f"{where}.content[{j}] must be an object with a 'type'")
                return None
            if part["type"] in ("text", "input_text", "output_text"):
                if not isinstance(part.get("text"), str):
                    p.add(f"{where}.content[{j}].text", f"{where}.content[{j}].text must be a string")
                    return None
                texts.append(part["text"])
            elif part["type"] == "refusal" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
        content = "".join(texts)
    if role == "developer":
        role = "system"
    out: dict[str, Any] = {"role": "tool" if role == "function" else role, "content": content}
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
    if tools is None:
        funcs = body.get("functions")  # the legacy form
        if isinstance(funcs, list):
            tools = [{"type": "function", "function": f} for f in funcs]
        else:
            return None
    if not isinstance(tools, list):
        p.add("tools", "'tools' must be an array")
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
