"""The part every wire format shares: bridge the prompt, call the engine, parse, record.

A wire-format module parses its request into a `ChatRequest`, hands it to `CallCore.complete`,
and renders the returned `Completion` (wire.py; JSON or an SSE stream built from it). The call is recorded
(`on_call`) before the harness sees a byte of the answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from legorl.config import SamplingConfig
from legorl.engine.base import ContextOverflowError
from legorl.proxy.bridge import PastCall, TokenBridge, normalize_message, reply_message
from legorl.proxy.errors import ProxyError
from legorl.proxy.request import ChatRequest
from legorl.proxy.sessions import Session
from legorl.proxy.toolcalls import ToolCallParser
from legorl.proxy.wire import Choice, Completion, new_id
from legorl.records import GenerationResult, LLMCall, SamplingParams

TEXTS_KEPT = 4


# The run's sampling (the config's `sampling:` section): what the harness asks for is recorded, this is
# what is used, max_tokens as a cap on what the harness asks for.
SamplingOverride = SamplingConfig


class CallCore:
    def __init__(self, engine: Any, tokenizer: Any, *, sampling: SamplingOverride, parser: ToolCallParser,
                 model_name: str, on_call: Callable[[LLMCall], None] | None):
        self.engine = engine
        self.tok = tokenizer
        self.bridge = TokenBridge(tokenizer)
        self.sampling = sampling
        self.parser = parser
        self.model_name = model_name
        self.on_call = on_call
        self.by_format: dict[str, int] = {}
        self._special_ids = set(getattr(tokenizer, "all_special_ids", []) or []) | {self.bridge.eos_id}

    def sampling_params(self, req: ChatRequest) -> SamplingParams:
        cap = self.sampling.max_tokens
        max_tokens = min(req.max_tokens, cap) if req.max_tokens and req.max_tokens > 0 else cap
        # The harness's seed is recorded with its request but not used: a fixed seed would make
        # every sample of a GRPO group identical.
        return SamplingParams(temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                              top_k=self.sampling.top_k, max_tokens=max_tokens, stop=list(req.stop))

    async def complete(self, session: Session, req: ChatRequest, tool_id_prefix: str = "call_") -> Completion:
        t_start = time.time()
        tools_key = self.bridge.tools_key(req.tools)
        bridged = self.bridge.build(req.messages, req.tools, session.history, tools_key)
        params = self.sampling_params(req)
        engine = self.engine

        def one() -> Any:
            if getattr(engine, "takes_messages", False):  # a hosted teacher: it takes the conversation
                return engine.generate_chat(req.messages, req.tools, params, rollout_id=session.rollout_id)
            return engine.generate(bridged.prompt_ids, params, rollout_id=session.rollout_id)

        try:
            results = list(await asyncio.gather(*(one() for _ in range(req.n))))
            for r in results:
                _check_result(r)
        except ContextOverflowError as e:
            session.errors.append("context_overflow")
            limit = engine.max_context() if hasattr(engine, "max_context") else None
            raise ProxyError(_overflow_message(req.wire_format, len(bridged.prompt_ids), limit, e),
                             "context_overflow", param="messages") from None
        except Exception as e:  # noqa: BLE001 - the engine failed: a 500, and the rollout is an engine_error
            session.errors.append("engine_error")
            raise ProxyError(f"engine error: {type(e).__name__}: {e}", "engine_error") from None
        t_end = time.time()
        choices = []
        for j, result in enumerate(results):
            choices.append(self._record(session, req, bridged, result, j, t_start, t_end, tool_id_prefix,
                                        tools_key))
        self.by_format[req.wire_format] = self.by_format.get(req.wire_format, 0) + 1
        return Completion(id="", created=int(t_start), model=req.model or self.model_name,
                          prompt_tokens=len(bridged.prompt_ids), choices=choices)

    def _record(self, session: Session, req: ChatRequest, bridged: Any, result: GenerationResult, j: int,
                t_start: float, t_end: float, tool_id_prefix: str, tools_key: str) -> Choice:
        text = self.tok.decode(result.completion_ids, skip_special_tokens=False)
        last = result.completion_ids[-1]
        ended = last in self._special_ids  # stopped on an end-of-turn / end-of-text token
        body_text = text.removesuffix(self.tok.convert_ids_to_tokens(last)) if ended else text
        stop_sequence = None
        if result.finish_reason == "stop" and not ended:
            hits = [(body_text.find(s), s) for s in req.stop if s in body_text]
            if hits:
                at, stop_sequence = min(hits)
                body_text = body_text[:at]
        if req.parse_tools:
            content, tool_calls = self.parser.parse(body_text)
            for c in tool_calls:
                c.id = new_id(tool_id_prefix)
        else:
            content, tool_calls = (body_text or None), []
        finish = ("tool_calls" if tool_calls else "length" if result.finish_reason == "length"
                  else "stop_sequence" if stop_sequence else "stop")
        first = j == 0
        call = LLMCall(
            rollout_id=session.rollout_id, index=session.n_calls, wire_format=req.wire_format, request=req.body,
            prompt_ids=bridged.prompt_ids, completion_ids=list(result.completion_ids),
            completion_logprobs=list(result.logprobs), finish_reason=result.finish_reason,
            weight_version=result.weight_version, completion_text=text, tool_calls=tool_calls,
            parent_index=bridged.parent_index, segment_break=bridged.segment_break if first else None,
            naive_prompt_differs=bridged.naive_differs, sampled_from_policy=result.sampled_from_policy,
            routed_experts=result.routed_experts, t_start=t_start, t_end=t_end,
        )
        if self.on_call is not None:
            self.on_call(call)  # persisted before the harness sees the answer
        # counted per recorded call, as `legorl report` counts them
        session.segments += bridged.parent_index is None
        session.bridge_hits += bridged.parent_index is not None
        session.drift_prevented += bool(bridged.naive_differs)
        if len(session.history) >= TEXTS_KEPT:  # rendered texts are only worth keeping for recent calls
            session.history[-TEXTS_KEPT].prompt_text = ""
        session.history.append(PastCall(
            index=call.index, messages=[normalize_message(m) for m in req.messages],
            tools_key=tools_key, reply=normalize_message(reply_message(content, tool_calls)),
            prompt_ids=call.prompt_ids, completion_ids=call.completion_ids, prompt_text=bridged.prompt_text))
        session.n_calls += 1
        return Choice(call=call, content=content, tool_calls=tool_calls, finish=finish,
                      stop_sequence=stop_sequence)


def _check_result(r: GenerationResult) -> None:
    """Validate engine output on arrival: ids silently lost as strings or empty (docs/design.md,
    "Capturing tokens")."""
    ids, lps = r.completion_ids, r.logprobs
    if not ids or len(ids) != len(lps) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"engine returned an invalid completion: {len(ids)} ids, {len(lps)} logprobs "
                         "(ids must be a non-empty list of ints with one logprob each)")


def _overflow_message(wire_format: str, n_prompt: int, limit: int | None, e: Exception) -> str:
    if wire_format == "anthropic_messages":
        return f"prompt is too long: {n_prompt} tokens > {limit if limit is not None else '?'} maximum"
    if limit is not None:
        return (f"This model's maximum context length is {limit} tokens. However, your messages resulted in "
                f"{n_prompt} tokens. Please reduce the length of the messages.")
    return f"This model's maximum context length was exceeded: {e}"
