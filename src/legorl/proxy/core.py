"""The part every wire format shares: bridge the prompt, call the engine, parse, record.

A wire-format module parses its request into a `ChatRequest`, hands it to `CallCore.complete`,
and renders the returned `Completion` (wire.py; JSON or an SSE stream built from it). The call is recorded
(`on_call`) before the harness sees a byte of the answer.

A prompt that cannot fit the context is refused before it is tokenized whole (`_refuse_if_too_long`);
large prompts are rendered and tokenized in a worker thread, so they do not stall other sessions. A call
cancelled before its answer (the client went away) is recorded as abandoned (finish_reason ABANDONED).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from legorl.config import SamplingConfig
from legorl.engine.base import ContextOverflowError
from legorl.models.chat_format import ChatFormat
from legorl.models.toolformats import ParsedReply, ToolCallParser
from legorl.proxy.bridge import (
    BridgeResult,
    PastCall,
    TokenBridge,
    content_text,
    normalize_message,
    reply_message,
)
from legorl.proxy.errors import ProxyError
from legorl.proxy.reasoning import REASONING_DROPPED, prompt_opens_reasoning, split_reasoning
from legorl.proxy.request import ChatRequest
from legorl.proxy.sessions import Session
from legorl.proxy.wire import Choice, Completion, new_id
from legorl.records import ABANDONED, GenerationResult, LLMCall, SamplingParams

log = logging.getLogger("legorl.proxy")

TEXTS_KEPT = 4
# Requests with more message text than this (characters) are rendered and tokenized in a worker thread
# (the tokenizer releases the GIL), so other sessions are served meanwhile: text not seen before costs about
# 1 ms per kB to tokenize on a busy machine. Smaller ones stay on the loop, where they cost less than the
# thread hop (~0.2 ms).
INLINE_CHARS = 1 << 13
# Message text beyond this many characters per token of context is probably too long: its tokens are
# counted piecewise (stopping past the context) before the prompt is built. Text is ~3-4 characters per
# token, so prompts that fit rarely pay for the count.
SUSPECT_CHARS_PER_TOKEN = 5
COUNT_PIECE_CHARS = 1 << 15
# The field each wire format carries its conversation in (named by the context-overflow error).
CONVERSATION_FIELD = {"openai_responses": "input"}


# The run's sampling (the config's `sampling:` section): what the harness asks for is recorded, this is
# what is used, max_tokens as a cap on what the harness asks for.
SamplingOverride = SamplingConfig


class CallCore:
    """Shared by every session; each call goes to the engine its session was opened with."""

    def __init__(self, tokenizer: Any, *, sampling: SamplingOverride, parser: ToolCallParser,
                 model_name: str, on_call: Callable[[LLMCall], None] | None, chat_format: ChatFormat | None = None):
        self.tok = tokenizer
        self.bridge = TokenBridge(tokenizer, chat_format)
        self.format = self.bridge.format
        self.sampling = sampling
        self.parser = parser
        self.model_name = model_name
        self.on_call = on_call
        self.by_format: dict[str, int] = {}
        # a completion ending on one of these stopped on an end-of-turn / end-of-text token (not shown as text)
        self._special_ids = set(getattr(tokenizer, "all_special_ids", []) or []) | set(self.format.stop_ids)
        self._max_token_bytes: int | None = None  # computed on first need (max_token_bytes)

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
        params = self.sampling_params(req)
        engine = session.engine
        takes_messages = engine.takes_messages  # a hosted teacher: it takes the conversation, not token ids
        limit = None if takes_messages else engine.max_context()  # a hosted model enforces its own
        try:
            chars = _chars(req.messages)
            if limit is not None and chars >= limit:  # the verbatim text is part of these characters
                await self._refuse_if_too_long(session, req, _verbatim_texts(req.messages), limit)
            if chars > INLINE_CHARS:  # a large prompt: render and tokenize off the loop
                bridged = await asyncio.to_thread(self.bridge.build, req.messages, req.tools, session.history,
                                                  tools_key)
            else:
                bridged = self.bridge.build(req.messages, req.tools, session.history, tools_key)
        except asyncio.CancelledError:  # the client went away (server.py) before the engine was asked
            self._abandon(session, req, None, t_start)
            raise

        def one() -> Any:
            if takes_messages:
                return engine.generate_chat(req.messages, req.tools, params, rollout_id=session.rollout_id)
            return engine.generate(bridged.prompt_ids, params, rollout_id=session.rollout_id)

        try:
            results = list(await asyncio.gather(*(one() for _ in range(req.n))))
            for r in results:
                _check_result(r)
        except asyncio.CancelledError:  # the client went away (server.py): the engine stops generating
            self._abandon(session, req, bridged, t_start)
            raise
        except ContextOverflowError as e:
            session.errors.append("context_overflow")
            raise ProxyError(_overflow_message(req.wire_format, len(bridged.prompt_ids), limit, e),
                             "context_overflow", param=CONVERSATION_FIELD.get(req.wire_format, "messages")) from None
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

    # ---- prompts that cannot fit -----------------------------------------------------------------
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token covers, so text of N bytes (at least N characters)
        is at least N / max_token_bytes tokens. From the vocabulary, once: a byte-level BPE token's string
        has one character per byte; any other token's UTF-8 length is at least the bytes it stands for."""
        if self._max_token_bytes is None:
            backend = getattr(self.tok, "backend_tokenizer", None)
            byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
            vocab = self.tok.get_vocab()
            self._max_token_bytes = max(1, max((len(t) if byte_level else len(t.encode()) for t in vocab), default=1))
        return self._max_token_bytes

    async def count(self, session: Session, req: ChatRequest) -> int:
        """The rendered prompt's tokens (Anthropic count_tokens): large prompts are tokenized off the loop,
        and one that cannot fit the session engine's context is refused without tokenizing it (not a session
        error)."""
        texts = _verbatim_texts(req.messages)
        if not session.engine.takes_messages:
            await self._refuse_if_too_long(None, req, texts, session.engine.max_context())
        if _chars(req.messages) > INLINE_CHARS:
            return await asyncio.to_thread(self.bridge.count, req.messages, req.tools)
        return self.bridge.count(req.messages, req.tools)

    async def _refuse_if_too_long(self, session: Session | None, req: ChatRequest, texts: list[str],
                                  limit: int) -> None:
        """Refuse, before tokenizing the whole prompt, a request whose message text alone cannot fit `limit`.

        `texts` is text the template renders verbatim (system, user and tool messages), so the prompt has
        at least as many tokens as it. First without tokenizing: N characters are at least N bytes, so at
        least N / max_token_bytes tokens. Then, for text long enough to be suspect, its tokens are counted
        piecewise in a worker thread, stopping once past the context. Prompts that pass are built and
        checked exactly (the engine's ContextOverflowError) as before.
        """
        chars = sum(map(len, texts))
        if chars < limit:  # fewer characters than the context (nearly every call): nothing to prove cheaply
            return
        lower = -(-chars // self.max_token_bytes())
        counted = False
        if lower < limit and chars > SUSPECT_CHARS_PER_TOKEN * limit:
            lower = await asyncio.to_thread(self._count_at_least, texts, limit)
            counted = True
        if lower >= limit:  # the engine needs len(prompt) + 1 <= limit
            if session is not None:
                session.errors.append("context_overflow")
            raise ProxyError(_overflow_message(req.wire_format, lower, limit, None, at_least=True),
                             "context_overflow", param=CONVERSATION_FIELD.get(req.wire_format, "messages"))
        if counted:
            log.debug("a suspect prompt of %d characters fits (at least %d tokens counted)", chars, lower)

    def _count_at_least(self, texts: list[str], limit: int) -> int:
        """A lower bound on the tokens of `texts`: pieces are counted until the sum passes `limit`.

        Cutting text into pieces (at whitespace where there is some) can split a token in two, so each
        cut takes back two tokens. Runs in a worker thread: the fast tokenizer's batch call releases the GIL.
        """
        backend = getattr(self.tok, "backend_tokenizer", None)
        total = cuts = 0
        for text in texts:
            start = 0
            while start < len(text):
                end = min(len(text), start + COUNT_PIECE_CHARS)
                if end < len(text):
                    space = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
                    end = space if space > start else end
                    cuts += 1
                piece = text[start:end]
                if backend is not None:
                    total += len(backend.encode_batch([piece], add_special_tokens=False)[0].ids)
                else:
                    total += len(self.tok.encode(piece, add_special_tokens=False))
                start = end
                if total - 2 * cuts >= limit:
                    return total - 2 * cuts
        return max(0, total - 2 * cuts)

    # ---- calls whose client went away --------------------------------------------------------------
    def _abandon(self, session: Session, req: ChatRequest, bridged: BridgeResult | None, t_start: float) -> None:
        """Record an attempt whose client went away before its answer: no completion, never trained.

        It takes the index the next answered call of the rollout will take (a retry of it), so the
        answered calls stay 0..n-1; readers of answered calls leave it out (Store.calls_for)."""
        session.errors.append(ABANDONED)
        call = LLMCall(
            rollout_id=session.rollout_id, index=session.index.next, wire_format=req.wire_format, request=req.body,
            prompt_ids=list(bridged.prompt_ids) if bridged is not None else [], completion_ids=[],
            completion_logprobs=[], finish_reason=ABANDONED, weight_version=session.engine.weight_version,
            completion_text="", parent_index=bridged.parent_index if bridged is not None else None,
            segment_break=bridged.segment_break if bridged is not None else None,
            naive_prompt_differs=bool(bridged.naive_differs) if bridged is not None else False,
            t_start=t_start, t_end=time.time(), session=session.kind,
        )
        if self.on_call is not None:
            try:
                self.on_call(call)
            except Exception:
                log.exception("could not record an abandoned call of %s", session.rollout_id)

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
        # reasoning first (it may mention tool calls), then the tool calls; a tool call that does not parse is
        # answered as text and recorded as malformed
        split = split_reasoning(body_text, self.format.reasoning,
                                opened=prompt_opens_reasoning(bridged.prompt_text, self.format.reasoning))
        parsed = self.parser.parse(split.rest, req.tools) if req.parse_tools else ParsedReply(split.rest or None)
        content, tool_calls = parsed.content, parsed.calls
        reasoning = split.reasoning or parsed.reasoning
        for c in tool_calls:
            c.id = new_id(tool_id_prefix)
        finish = ("tool_calls" if tool_calls else "length" if result.finish_reason == "length"
                  else "stop_sequence" if stop_sequence else "stop")
        first = j == 0
        call = LLMCall(
            rollout_id=session.rollout_id, index=session.index.next, wire_format=req.wire_format, request=req.body,
            prompt_ids=bridged.prompt_ids, completion_ids=list(result.completion_ids),
            completion_logprobs=list(result.logprobs), finish_reason=result.finish_reason,
            weight_version=result.weight_version, completion_text=text, tool_calls=tool_calls,
            parent_index=bridged.parent_index, segment_break=bridged.segment_break if first else None,
            naive_prompt_differs=bridged.naive_differs, sampled_from_policy=result.sampled_from_policy,
            routed_experts=result.routed_experts, t_start=t_start, t_end=t_end, session=session.kind,
            malformed_tool_call=parsed.malformed, token_versions=result.token_versions,
        )
        if self.on_call is not None:
            self.on_call(call)  # persisted before the harness sees the answer
        # counted per recorded call, as `legorl report` counts them
        session.segments += bridged.parent_index is None
        session.bridge_hits += bridged.parent_index is not None
        session.drift_prevented += bool(bridged.naive_differs)
        session.malformed_tool_calls += parsed.malformed is not None
        session.reasoning_dropped += call.segment_break == REASONING_DROPPED
        if len(session.history) >= TEXTS_KEPT:  # rendered texts are only worth keeping for recent calls
            session.history[-TEXTS_KEPT].prompt_text = ""
        session.history.append(PastCall(
            index=call.index,
            messages=bridged.norm if bridged.norm is not None else [normalize_message(m) for m in req.messages],
            tools_key=tools_key, reply=normalize_message(reply_message(content, tool_calls)),
            prompt_ids=call.prompt_ids, completion_ids=call.completion_ids, prompt_text=bridged.prompt_text,
            reasoning=reasoning))
        session.n_calls += 1
        session.index.next += 1
        return Choice(call=call, content=content, tool_calls=tool_calls, finish=finish,
                      stop_sequence=stop_sequence, reasoning=reasoning)


def _check_result(r: GenerationResult) -> None:
    """Validate engine output on arrival: ids silently lost as strings or empty (docs/design.md,
    "Capturing tokens")."""
    ids, lps = r.completion_ids, r.logprobs
    if not ids or len(ids) != len(lps) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"engine returned an invalid completion: {len(ids)} ids, {len(lps)} logprobs "
                         "(ids must be a non-empty list of ints with one logprob each)")
    if r.token_versions is not None and len(r.token_versions) != len(ids):
        raise ValueError(f"engine returned {len(r.token_versions)} token weight versions for {len(ids)} ids")


def _verbatim_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The text of the system, user and tool messages: what a chat template renders verbatim (assistant
    text may be trimmed or have its reasoning dropped). The prompt holds at least these tokens."""
    return [content_text(m.get("content")) for m in messages if m.get("role") in ("system", "user", "tool")]


def _chars(messages: list[dict[str, Any]]) -> int:
    """The characters of every message's text (what rendering and tokenizing a prompt cost scales with)."""
    return sum(len(content_text(m.get("content"))) for m in messages)


def _overflow_message(wire_format: str, n_prompt: int, limit: int | None, e: Exception | None,
                      at_least: bool = False) -> str:
    if wire_format == "anthropic_messages":  # Anthropic's exact wording (harnesses match it), a bound or not
        return f"prompt is too long: {n_prompt} tokens > {limit if limit is not None else '?'} maximum"
    n = f"at least {n_prompt}" if at_least else str(n_prompt)
    what = CONVERSATION_FIELD.get(wire_format, "messages")
    if limit is not None:
        return (f"This model's maximum context length is {limit} tokens. However, your {what} resulted in "
                f"{n} tokens. Please reduce the length of the {what}.")
    return f"This model's maximum context length was exceeded: {e}"
