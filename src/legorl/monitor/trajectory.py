"""The trajectory viewer's data: one rollout, every call in order, token by token.

For each call: the *new* prompt part (the tokens after the parent call's prompt and
completion, or the whole prompt at a segment start), the sampled completion with a
logprob per token (and routed experts, if captured), the parsed tool calls, and the
tool results / harness notes read from the next call's request.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from legorl.monitor.behaviour import FORMAT_ERROR_FEEDBACK, analyse_turns, tool_required, turns_from_calls
from legorl.monitor.commands import classify_tool_call
from legorl.monitor.db import RunDB
from legorl.monitor.messages import conversation_items, new_messages
from legorl.records import MAIN_SESSION, LLMCall

MAX_PROMPT_CHARS = 40_000  # a segment start's full prompt can be long; the rest is elided


class TokenDecoder:
    """Token ids -> text with the run's own tokenizer (RUN_DIR/tokenizer), loaded on first use."""

    def __init__(self, tokenizer_dir: str | Path | None):
        self.dir = Path(tokenizer_dir) if tokenizer_dir else None
        self._tok: Any = None
        self._tried = False
        self._pieces: dict[int, str] = {}
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if not self._tried:
                self._tried = True
                if self.dir is not None and self.dir.is_dir():
                    try:
                        from legorl.models import load_tokenizer

                        self._tok = load_tokenizer(self.dir)
                    except Exception:  # noqa: BLE001 - a missing or foreign tokenizer: show ids instead of text
                        self._tok = None
            return self._tok

    def piece(self, token_id: int) -> str:
        p = self._pieces.get(token_id)
        if p is None:
            tok = self.tokenizer
            p = tok.decode([token_id], skip_special_tokens=False) if tok is not None else f"⟨{token_id}⟩"
            self._pieces[token_id] = p
        return p

    def text(self, ids: list[int]) -> str:
        tok = self.tokenizer
        if tok is None:
            return " ".join(f"⟨{i}⟩" for i in ids)
        return tok.decode(ids, skip_special_tokens=False)


def _experts(routes: list[list[list[int]]] | None, i: int) -> str | None:
    if not routes or i >= len(routes):
        return None
    return " ".join(f"L{layer}:{','.join(map(str, experts))}" for layer, experts in enumerate(routes[i]))


def new_prompt_start(call: LLMCall, by_index: dict[int, LLMCall]) -> int:
    """Where this call's new prompt tokens begin: after the parent's prompt + completion, else 0."""
    if call.parent_index is None or call.segment_break:
        return 0
    p = by_index.get(call.parent_index)
    if p is None:
        return 0
    n = len(p.prompt_ids) + len(p.completion_ids)
    return n if call.prompt_ids[:n] == p.prompt_ids + p.completion_ids else 0


def _pretty(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except (json.JSONDecodeError, TypeError):
        return arguments


def call_view(call: LLMCall, start: int, decoder: TokenDecoder, feedback: list[Any]) -> dict[str, Any]:
    new_ids = call.prompt_ids[start:]
    prompt_text = decoder.text(new_ids)
    elided = max(0, len(prompt_text) - MAX_PROMPT_CHARS)
    tools = []
    for tc in call.tool_calls:
        c = classify_tool_call(tc.name, tc.arguments)
        tools.append({"id": tc.id, "name": tc.name, "arguments": _pretty(tc.arguments), "kind": c.kind,
                      "valid": c.valid, "command": c.command})
    results = [{"tool_call_id": m.tool_call_id, "text": m.text, "is_error": m.is_error}
               for m in feedback if m.role == "tool"]
    notes = [{"role": m.role, "text": m.text} for m in feedback if m.role != "tool"]
    return {
        "index": call.index, "session": call.session, "parent_index": call.parent_index,
        "segment_break": call.segment_break,
        "weight_version": call.weight_version, "finish_reason": call.finish_reason, "wire_format": call.wire_format,
        "sampled_from_policy": call.sampled_from_policy, "naive_prompt_differs": call.naive_prompt_differs,
        "duration_s": (call.t_end - call.t_start) if call.t_end and call.t_start else None,
        "prompt_tokens": len(call.prompt_ids), "new_prompt_start": start, "new_prompt_tokens": len(new_ids),
        "new_prompt_text": prompt_text[elided:], "new_prompt_elided_chars": elided,
        "completion": {
            "ids": call.completion_ids,
            "pieces": [decoder.piece(i) for i in call.completion_ids],
            "logprobs": [round(x, 4) for x in call.completion_logprobs],
            "experts": [_experts(call.routed_experts, i) for i in range(len(call.completion_ids))]
            if call.routed_experts else None,
        },
        "completion_text": call.completion_text,
        "tool_calls": tools, "tool_results": results, "notes": notes,
        "format_error_note": any(FORMAT_ERROR_FEEDBACK.search(n["text"]) for n in notes),
    }


def trajectory(db: RunDB, rollout_id: str, decoder: TokenDecoder) -> dict[str, Any] | None:
    rollout = db.rollout(rollout_id)
    if rollout is None:
        return None
    every = db.calls(rollout_id)
    by_index = {c.index: c for c in every}
    views = []
    # Each session (the agent's, and each side session's: titles, checks, sub-agents) is its own conversation:
    # what a call's next prompt added is read within its session; the views are shown in call order.
    for name in dict.fromkeys(c.session for c in every):
        chain = [c for c in every if c.session == name]
        convs = [conversation_items(c.request, c.wire_format) for c in chain]
        for i, c in enumerate(chain):
            feedback = new_messages(convs[i], convs[i + 1], chain[i + 1].wire_format) if i + 1 < len(chain) else []
            views.append(call_view(c, new_prompt_start(c, by_index), decoder, feedback))
    views.sort(key=lambda v: v["index"])
    calls = [c for c in every if c.session == MAIN_SESSION]
    b = analyse_turns(turns_from_calls(calls), tool_required(rollout.get("harness") or ""))
    lps = [x for c in calls for x in c.completion_logprobs]
    summary = {
        "calls": len(calls), "turns": b.turns, "tool_calls": b.tool_calls, "text_only_turns": b.text_only_turns,
        "format_errors": b.format_errors, "submitted": b.submitted, "edits": b.edits,
        "verified_edits": b.verified_edits, "mix": dict(b.mix),
        "segments": sum(1 for c in calls if c.parent_index is None or c.segment_break),
        "completion_tokens": len(lps), "mean_logprob": sum(lps) / len(lps) if lps else None,
        "weight_versions": sorted({c.weight_version for c in calls}),
        "side_calls": dict(Counter(c.session for c in every if c.session != MAIN_SESSION)),
    }
    return {"rollout": rollout, "calls": views, "summary": summary}
