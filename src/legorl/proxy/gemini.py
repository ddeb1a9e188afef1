"""The Gemini API (`POST /v1beta/models/{model}:generateContent`, `:streamGenerateContent?alt=sse`,
`:countTokens`), streaming and not. Gemini CLI and Google's genai SDKs speak it.

The model comes from the path, streaming from the method. Request parsing is in gemini_request.py;
here the answer is rendered: `candidates[i].content.parts` (a reasoning model's reasoning as a part with
`thought: true`, a text part, then one `functionCall` part per tool call, args as an object), `finishReason`, `usageMetadata`, `modelVersion`,
`responseId`. A stream is one SSE `data:` chunk per part, the last one carrying `finishReason` and
`usageMetadata`; its keep-alives are blank lines (Google's SDKs read any non-`data:` line as JSON).
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from legorl.proxy.errors import ProxyError, gemini_error_body
from legorl.proxy.gemini_request import (
    GEMINI,
    calling_mode,
    content_text,
    contents_messages,
    generation,
    get,
    spellings,
    tools,
    unknown_fields,
)
from legorl.proxy.request import ChatRequest, Problems, require_object
from legorl.proxy.wire import Choice, Completion, WireFormat, sse

KNOWN = spellings({"contents", "systemInstruction", "tools", "toolConfig", "generationConfig", "safetySettings",
                   "cachedContent", "labels", "serviceTier", "store", "model"})
COUNT_KNOWN = spellings({"contents", "generateContentRequest", "model"})
FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP", "stop_sequence": "STOP"}
OVERFLOW = re.compile(r"maximum context length is (\d+) tokens\. However, your \w+ resulted in ((?:at least )?\d+)")


class Gemini(WireFormat):
    name = "gemini"
    id_prefix = ""
    dialect = GEMINI
    keepalive = "\n"  # a blank line: Google's SDKs take an SSE comment line for a JSON error

    def new_id(self) -> str:
        return secrets.token_urlsafe(16)  # responseId: Google's are opaque url-safe strings

    # ---- request --------------------------------------------------------------------------------
    def parse(self, body: Any, headers: Any = None, *, model: str = "", stream: bool = False,
              alt: str | None = None, count_only: bool = False) -> ChatRequest:
        body = require_object(body)
        p = Problems(GEMINI)
        if count_only and isinstance(get(body, "generateContentRequest"), dict):
            body = get(body, "generateContentRequest")  # countTokens of a whole request: its model is the path's
        elif self.strict_fields:
            unknown_fields(body, COUNT_KNOWN if count_only else KNOWN, p)
        if stream and alt != "sse":
            p.add("alt", f"streamGenerateContent is answered as server-sent events only: add ?alt=sse to the URL "
                         f"(got alt={alt!r})")
        messages: list[dict[str, Any]] = []
        system = get(body, "systemInstruction")
        if system is not None:
            text = content_text(system, "systemInstruction", p)
            if text:
                messages.append({"role": "system", "content": text})
        raw = get(body, "contents")
        if not isinstance(raw, list) or not raw:
            p.add("contents", "contents must be a non-empty array of Content objects {role: 'user' | 'model', "
                              "parts: [...]}")
        else:
            for i, c in enumerate(raw):
                if isinstance(c, dict) and c.get("role") == "system":
                    p.add(f"contents[{i}].role", f"contents[{i}].role must be 'user' or 'model' (the system "
                                                 "prompt goes in systemInstruction)")
            messages += contents_messages(raw, p)
        offered = tools(get(body, "tools"), p)
        mode = calling_mode(body, p)
        gen = generation(body, p)
        p.raise_if_any()
        return ChatRequest(
            wire_format=self.name, body=body, messages=messages, tools=offered, model=model,
            max_tokens=gen.max_tokens, stop=gen.stop, seed=gen.seed, n=gen.n, stream=stream,
            parse_tools=bool(offered) and mode != "NONE", logprobs=gen.logprobs, top_logprobs=gen.top_logprobs,
        )

    @staticmethod
    def conversation(body: dict[str, Any]) -> list[Any]:
        items = get(body, "contents")
        system = get(body, "systemInstruction")
        if isinstance(system, str):
            system = {"parts": [{"text": system}]}
        head = [{**system, "role": "system"}] if isinstance(system, dict) else []
        return head + (list(items) if isinstance(items, list) else [])

    @staticmethod
    def messages(items: list[Any], p: Problems | None = None) -> list[dict[str, Any]]:
        return contents_messages(items, p or Problems(GEMINI))

    @staticmethod
    def offered_tools(body: dict[str, Any]) -> list[dict[str, Any]]:
        return tools(get(body, "tools"), Problems(GEMINI)) or []

    @staticmethod
    def failed_tool_results(items: list[Any]) -> set[str]:
        """Tool results whose response is `{"error": ...}` (Google's convention for a failed call)."""
        failed: set[str] = set()
        contents_messages(items, Problems(GEMINI), failed)
        return failed

    # ---- answers --------------------------------------------------------------------------------
    def _candidate(self, c: Choice, req: ChatRequest, index: int) -> dict[str, Any]:
        cand: dict[str, Any] = {"content": {"role": "model", "parts": self._parts(c)},
                                "finishReason": FINISH[c.finish], "index": index}
        if req.logprobs:
            entries = self.token_entries(c, req)
            ids = c.call.completion_ids
            chosen = [{"token": e["token"], "tokenId": tid, "logProbability": e["logprob"]}
                      for e, tid in zip(entries, ids)]
            cand["logprobsResult"] = {"chosenCandidates": chosen,
                                      "topCandidates": [{"candidates": [x]} for x in chosen]
                                      if req.top_logprobs else []}
            cand["avgLogprobs"] = sum(e["logprob"] for e in entries) / len(entries) if entries else 0.0
        return cand

    @staticmethod
    def _parts(c: Choice) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if c.reasoning:
            parts.append({"text": c.reasoning, "thought": True})
        if c.content or not c.tool_calls:
            parts.append({"text": c.content or ""})
        for t in c.tool_calls:
            parts.append({"functionCall": {"id": t.id, "name": t.name, "args": json.loads(t.arguments)}})
        return parts

    @staticmethod
    def _usage(comp: Completion) -> dict[str, Any]:
        completion = sum(len(c.call.completion_ids) for c in comp.choices)
        return {"promptTokenCount": comp.prompt_tokens, "candidatesTokenCount": completion,
                "totalTokenCount": comp.prompt_tokens + completion,
                "promptTokensDetails": [{"modality": "TEXT", "tokenCount": comp.prompt_tokens}]}

    def answer(self, comp: Completion, req: ChatRequest) -> dict[str, Any]:
        return {"candidates": [self._candidate(c, req, i) for i, c in enumerate(comp.choices)],
                "usageMetadata": self._usage(comp), "modelVersion": comp.model, "responseId": comp.id}

    def stream(self, comp: Completion, req: ChatRequest) -> str:
        """One chunk per part of each candidate; a candidate's last chunk has its finishReason (and its
        logprobs), the very last chunk the usage."""
        head = {"modelVersion": comp.model, "responseId": comp.id}
        out = []
        for i, c in enumerate(comp.choices):
            last = self._candidate(c, req, i)
            parts = last["content"]["parts"]
            for part in parts[:-1]:
                out.append({"candidates": [{"content": {"role": "model", "parts": [part]}, "index": i}], **head})
            last["content"]["parts"] = parts[-1:]
            out.append({"candidates": [last], **head})
        out[-1]["usageMetadata"] = self._usage(comp)
        return "".join(sse(o) for o in out)

    # ---- errors ---------------------------------------------------------------------------------
    def error_body(self, e: ProxyError) -> dict[str, Any]:
        if e.kind == "context_overflow":  # Google's wording of it, and how to get under it
            m = OVERFLOW.search(e.message)
            what = f"({m.group(2)}) exceeds the maximum number of tokens allowed ({m.group(1)})" if m else \
                f"exceeds the maximum number of tokens allowed ({e.message})"
            e = ProxyError(f"The input token count {what}. Shorten 'contents' (drop or summarise earlier turns) "
                           "or 'systemInstruction'.", e.kind, param="contents", status=e.status)
        return gemini_error_body(e)

    def stream_error(self, e: ProxyError) -> str:
        return sse(self.error_body(e))
