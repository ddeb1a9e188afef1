"""In-process torch engine: continuous batching over a slot KV cache, with prefix reuse.

One worker thread owns the model. Active sequences live in KV slots ``0..n-1``
(engine/fast.py for Qwen3-family models, engine/hf.py for anything else). Every step is one
forward over all of them: decoding rows feed their last sampled token, and requests joining the
batch feed their prompt after copying the longest cached prefix of it (from the prefix cache of
finished sequences, or from a running sequence with the same prompt, e.g. another sample of a
GRPO group: a request that shares a long prefix with one joining in the same step waits one step
to copy it), so only new tokens are computed. Then one sampling call draws every row's next
token with its own parameters and random stream. Finished sequences leave after the step: their
KV goes to the prefix cache, and the last slot moves into the hole; cancelled ones leave before
the next step, without being resolved.

Weight updates are applied by the worker when the batch is empty: while one is pending no
request is admitted, so a request never spans two weight versions; the prefix cache is cleared.

Logprobs follow ``legorl.engine.sampling`` (the definition the trainer imports). Async callers
wait on asyncio futures that the worker resolves with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import random
import threading
import time
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from legorl.config import EngineConfig
from legorl.engine.base import EngineError, Weights, check_prompt, no_conversations
from legorl.engine.fast import FastDecoder, check_support
from legorl.engine.hf import HFDecoder
from legorl.engine.prefix import PrefixCache, PrefixEntry, common_prefix
from legorl.engine.sampling import BatchParams, sample_batch
from legorl.models.chat_format import ChatFormat, ChatFormatError
from legorl.models.chat_format import chat_format as read_chat_format
from legorl.records import GenerationResult, SamplingParams

log = logging.getLogger(__name__)

Decoder = FastDecoder | HFDecoder
# A request waits one step to copy a prefix from a request joining now when that saves this many tokens.
_MIN_SHARED = 32


@dataclasses.dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    prompt_t: torch.Tensor  # CPU int64, for prefix matching
    params: SamplingParams
    top_k: int
    max_new: int
    stop_ids: frozenset[int]
    rng: random.Random  # the request's own stream: same samples alone or in any batch
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    version: int = 0  # the weights its first token was sampled under
    versions: list[int] = dataclasses.field(default_factory=list)  # each token's (an in-flight update moves it)
    completion: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None
    cancelled: bool = False
    n_cached: int = 0  # positions whose KV is in the request's slot
    feed: list[int] = dataclasses.field(default_factory=list)  # tokens the next step runs
    stop_window: int = 0  # tokens to decode when checking stop strings

    def add(self, token: int, logprob: float, version: int, tokenizer: PreTrainedTokenizerBase) -> None:
        """Record a sampled token (and the weights it came from) and decide whether the request is finished."""
        self.completion.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.stop_ids:
            self.finish = "stop"
        elif self.params.stop and _hits_stop(
            self.completion[-self.stop_window :], self.params.stop, tokenizer
        ):
            self.finish = "stop"  # keep every token up to the one completing the stop string
        elif len(self.completion) >= self.max_new:
            self.finish = "length"


@dataclasses.dataclass
class _Update:
    state_dict: dict[str, torch.Tensor]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[int]
    version: int | None  # the version the new weights carry (None: the current one + 1)
    in_flight: bool = False  # applied between decode steps, generations in progress continue under it


def _hits_stop(ids: list[int], stops: list[str], tokenizer: PreTrainedTokenizerBase) -> bool:
    # Checked after every token, so an occurrence ends in the last token; the window of ids covers
    # the longest stop string (every token is at least one byte).
    text = tokenizer.decode(ids, skip_special_tokens=False)
    return any(s and s in text for s in stops)


def _resolve(
    fut: asyncio.Future[Any],
    loop: asyncio.AbstractEventLoop,
    value: Any = None,
    error: BaseException | None = None,
) -> None:
    """Set a future's result from the worker thread; a closed loop or cancelled future is ignored."""

    def _set() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(_set)
    except RuntimeError:  # the caller's loop is gone
        pass


class _ThreadClock:
    """The calling thread's CPU seconds and its seconds runnable but waiting for a core (Linux schedstat,
    through a descriptor the measured thread opens once: a read is ~2 us, a fresh open ~15); elsewhere
    the CPU only."""

    def __init__(self) -> None:
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[float, float]:
        if self._fd is None:
            return time.thread_time(), 0.0
        cpu_ns, wait_ns, _ = os.pread(self._fd, 128, 0).split()
        return int(cpu_ns) / 1e9, int(wait_ns) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LocalEngine:
    """Engine running a transformers causal LM in a background thread (see module docstring).

    Its settings are the ``engine`` section's (``config``, default ``EngineConfig()``), single keys
    overridable by keyword: ``max_batch`` (concurrent sequences: KV slots, each ``max_context``
    long, preallocated), ``prefix_cache_mb`` (memory bound of the prefix cache; 0 turns prefix
    reuse off), ``torch_threads`` (torch intra-op threads, process-wide; 0 leaves torch's) and
    ``split_steps`` (each large step as two halves in two threads, fast path only: rows are
    independent, so results are the same; ~15% more CPU per token, so it pays only where a second
    core is idle).

    Args (not settings):
        stop_token_ids: engine-wide stop ids (default: `default_stop_ids`, the checkpoint's end-of-turn,
            eos and pad ids: ``<|im_end|>``, ``<|endoftext|>`` for the built-in tokenizer).
        chat_format: the checkpoint's chat format (default: read from the tokenizer), for the stop ids.
        fast: None = the fast forward when it covers the model (checked against the HF logits at
            start-up), True = require it, False = always the HF fallback.
        max_context: cap on the context (default: the model's ``max_position_embeddings``).
        prefill_chunk: prefill token budget between two decode steps (at least one request is
            admitted per step), so long prompts do not stall running sequences for long.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: EngineConfig | None = None,
        *,
        stop_token_ids: list[int] | None = None,
        chat_format: ChatFormat | None = None,
        fast: bool | None = None,
        max_context: int | None = None,
        prefill_chunk: int = 2048,
        **settings: Any,
    ) -> None:
        c = EngineConfig.model_validate({**(config or EngineConfig()).model_dump(), **settings})
        if c.torch_threads:
            torch.set_num_threads(c.torch_threads)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch = c.max_batch
        self.prefill_chunk = prefill_chunk
        self._weight_version = 0
        if stop_token_ids is None:
            stop_token_ids = default_stop_ids(model, tokenizer, chat_format)
        self.stop_token_ids = list(stop_token_ids)
        self._vocab = int(model.get_input_embeddings().weight.shape[0])
        self._device = next(model.parameters()).device
        self._max_context = int(model.config.max_position_embeddings)
        max_context = max_context or c.max_context
        if max_context is not None:
            self._max_context = min(self._max_context, max_context)
        self._split = c.split_steps
        self.decoder: Decoder = self._make_decoder(fast)
        self.backend = "fast" if isinstance(self.decoder, FastDecoder) else "hf"
        self._record_routes = self.decoder.routes is not None
        self.prefix = PrefixCache(int(c.prefix_cache_mb * 2**20))
        self._stats = collections.Counter[str]()
        self._seed_rng = random.Random()
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._updates: collections.deque[_Update] = collections.deque()
        self._closed = False
        self._clear_prefix = False
        self._active: list[_Request] = []  # worker thread only; index == KV slot
        self._params: BatchParams | None = None  # rebuilt when _active changes
        self._thread = threading.Thread(target=self._run, name="legorl-local-engine", daemon=True)
        self._thread.start()

    def _make_decoder(self, fast: bool | None) -> Decoder:
        reason = check_support(self.model) if fast is not False else "fast=False"
        if reason is None:
            dec = FastDecoder(self.model, self.max_batch, self._max_context, split_threads=self._split)
            reason = _verify(dec, self.model, self._vocab)
            if reason is None:
                return dec
            dec.close()
        if fast:
            raise EngineError(f"fast engine path unavailable for this model: {reason}")
        if fast is None:
            log.warning("LocalEngine: using the slow HF fallback (%s)", reason)
        return HFDecoder(self.model, self.max_batch, self._max_context)

    # ---- public API (event loop side): the Engine protocol ----

    takes_messages = False

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def weights(self) -> Weights:
        return Weights(self._weight_version)

    def follow(self, weights: Weights) -> None:
        raise EngineError("the embedded engine loads its own weights: call update_weights")

    def max_context(self) -> int:
        return self._max_context

    def stats(self) -> dict[str, Any]:
        """Counters since start: requests, prefill tokens computed/reused, generated tokens, steps and the
        rows they ran, requests cancelled by their caller (dropped while waiting or mid-generation), busy
        seconds (wall; of them the worker thread's CPU and its wait for a core), cache state."""
        s: dict[str, Any] = dict(self._stats)
        for key in (
            "requests",
            "prompt_tokens",
            "prefill_tokens_computed",
            "prefill_tokens_reused",
            "generated_tokens",
            "decode_steps",
            "step_rows",
            "cancelled",
        ):
            s.setdefault(key, 0)
        s["prefill_reuse_fraction"] = s["prefill_tokens_reused"] / max(1, s["prompt_tokens"])
        s.update(
            backend=self.backend,
            weight_version=self._weight_version,
            active=len(self._active),
            waiting=len(self._waiting),
            prefix_cache_entries=len(self.prefix),
            prefix_cache_bytes=self.prefix.nbytes,
            prefix_cache_evictions=self.prefix.evictions,
        )
        return s

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, rollout_id: str = ""
    ) -> GenerationResult:
        """Sample a completion for ``prompt_ids``.

        Stops on any of the engine's stop ids plus ``params.stop_token_ids`` (the stop token is kept,
        with its logprob), or when the decoded completion contains a ``params.stop`` string (tokens
        are kept up to and including the one that completed it: token fidelity over text trimming).
        ``params.seed`` makes sampling reproducible, also when batched with other requests.
        ``params.top_k`` is honoured when SamplingParams carries it (0 = off).
        """
        check_prompt(prompt_ids, self._vocab, self.max_context())
        if params.max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {params.max_tokens}")
        top_k = int(getattr(params, "top_k", 0) or 0)
        if top_k < 0 or not 0 < params.top_p <= 1 or params.temperature < 0:
            raise EngineError(
                f"bad sampling params: temperature {params.temperature} (>= 0), top_p {params.top_p} "
                f"(in (0, 1]), top_k {top_k} (>= 0)"
            )
        loop = asyncio.get_running_loop()
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        req = _Request(
            prompt_ids=list(prompt_ids),
            prompt_t=torch.tensor(prompt_ids, dtype=torch.long),
            params=params,
            top_k=top_k,
            max_new=min(params.max_tokens, self.max_context() - len(prompt_ids)),
            stop_ids=frozenset(self.stop_token_ids) | frozenset(params.stop_token_ids),
            rng=random.Random(seed),
            loop=loop,
            future=loop.create_future(),
            stop_window=max((len(s.encode()) for s in params.stop), default=0) + 2,
        )
        with self._cv:
            if self._closed:
                raise EngineError("engine is closed")
            self._waiting.append(req)
            self._cv.notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True  # the worker drops it at the next step
            raise

    async def generate_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            params: SamplingParams, *, rollout_id: str = "") -> GenerationResult:
        raise no_conversations(self)

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None, *,
                             in_flight: bool = False) -> int:
        """Apply ``state_dict`` (all or some parameters) once in-flight requests finish; new requests
        wait meanwhile, so every result is generated under exactly one version. Returns the new version
        (``version`` where given, else the current one + 1).

        ``in_flight`` (asynchronous RL): applied at the next step boundary instead, without draining; a
        generation in progress continues under the new weights (over the KV its earlier tokens left) and its
        result says which version sampled each token (``token_versions``), each token with its exact logprob."""
        # Validate here, before anything is copied: a half-applied update would be worse than none.
        current = self.model.state_dict()
        unexpected = set(state_dict) - set(current)
        if unexpected:
            raise EngineError(
                f"update_weights got {len(unexpected)} unknown keys, e.g. {sorted(unexpected)[:3]}"
            )
        bad = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(current[k].shape)]
        if bad:
            raise EngineError(f"update_weights failed: shape mismatch for {bad[:3]}")
        loop = asyncio.get_running_loop()
        upd = _Update(state_dict, loop, loop.create_future(), version, in_flight)
        with self._cv:
            if self._closed:
                raise EngineError("engine is closed")
            self._updates.append(upd)
            self._cv.notify()
        return await upd.future

    @property
    def closed(self) -> bool:
        return self._closed

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix (done by the worker before its next step)."""
        with self._cv:
            self._clear_prefix = True
            self._cv.notify()

    async def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join)

    # ---- worker thread ----

    def _run(self) -> None:
        clock = _ThreadClock()  # opened here: it measures this (the worker) thread
        try:
            while True:
                with self._cv:
                    while not (
                        self._closed or self._waiting or self._active or self._updates or self._clear_prefix
                    ):
                        self._cv.wait()
                    if self._closed:
                        break
                    if self._clear_prefix:
                        self.prefix.clear()
                        self._clear_prefix = False
                    admitted: list[_Request] = []
                    ready = self._updates and (self._updates[0].in_flight or not self._active)
                    update = self._updates.popleft() if ready else None
                    # admit nothing in an update's turn (it `continue`s before stepping: requests taken now would
                    # be lost), and nothing while a draining update waits for the batch to finish
                    if update is None and not self._updates:
                        while self._waiting and len(self._active) + len(admitted) < self.max_batch:
                            admitted.append(self._waiting.popleft())
                if update is not None:
                    self._apply_update(update)
                    continue
                t0, (c0, q0) = time.perf_counter(), clock.read()
                with torch.inference_mode():
                    self._step(admitted)
                # Busy wall = this thread's CPU + its wait for a core (run queue) + the rest (OpenMP barriers, the GIL).
                c1, q1 = clock.read()
                self._stats.update(busy_s=time.perf_counter() - t0, busy_cpu_s=c1 - c0, busy_runqueue_s=q1 - q0)
        except Exception:
            log.exception("engine worker died")
        finally:
            clock.close()
            with self._cv:  # also when the worker died: later calls fail fast instead of hanging
                self._closed = True
            self._fail_all(EngineError("engine closed"))
            if isinstance(self.decoder, FastDecoder):
                self.decoder.close()

    def _fail_all(self, error: EngineError) -> None:
        with self._cv:
            pending = list(self._waiting) + self._active
            self._waiting.clear()
            updates = list(self._updates)
            self._updates.clear()
        for req in pending:
            _resolve(req.future, req.loop, error=error)
        for upd in updates:
            _resolve(upd.future, upd.loop, error=error)
        self._active = []

    def _apply_update(self, upd: _Update) -> None:
        try:
            with torch.no_grad():
                self.model.load_state_dict(upd.state_dict, strict=False)
            self.decoder.load_weights()
            self.prefix.clear()  # KV of the old weights must never serve the new ones
            self._weight_version = upd.version if upd.version is not None else self._weight_version + 1
            _resolve(upd.future, upd.loop, self._weight_version)
        except Exception as e:  # unexpected backend failure
            log.exception("update_weights failed")
            _resolve(upd.future, upd.loop, error=EngineError(f"update_weights failed: {e}"))

    def _match(self, req: _Request) -> tuple[int, _Request | PrefixEntry | None]:
        """The longest cached prefix of the prompt: its length and where it is (a running row's slot or a
        prefix cache entry)."""
        if self.prefix.max_bytes <= 0:
            return 0, None
        limit = len(req.prompt_ids) - 1  # the last prompt token is always run: its logits are needed
        entry, n = self.prefix.match(req.prompt_t, limit)
        source: _Request | PrefixEntry | None = entry
        for other in self._active:  # e.g. another sample of the same group, already prefilled
            if other.version != self._weight_version:  # its KV is an older version's (an in-flight update)
                continue
            m = min(common_prefix(other.prompt_t, req.prompt_t), other.n_cached, limit)
            if m > n:
                source, n = other, m
        return n, source

    def _copy_prefix(self, source: _Request | PrefixEntry | None, n: int, slot: int) -> None:
        if isinstance(source, _Request):
            self.decoder.copy(self._active.index(source), slot, n)
        elif source is not None and n > 0:
            self.decoder.load(slot, source.k, source.v, source.routes, n)

    def _waits_for(self, req: _Request, joining: list[_Request], reused: int) -> bool:
        """True when a request joining this step shares a longer prefix with ``req`` than any cached KV:
        ``req`` then waits one step and copies it (e.g. the other samples of a GRPO group)."""
        if self.prefix.max_bytes <= 0:
            return False
        limit = len(req.prompt_ids) - 1
        best = max((min(common_prefix(o.prompt_t, req.prompt_t), limit) for o in joining), default=0)
        return best - reused >= _MIN_SHARED

    def _join(self, admitted: list[_Request]) -> None:
        """Place admitted requests in the next free slots with their reused prefix.

        Up to ``prefill_chunk`` prompt tokens join a step (at least one request); the rest, and requests
        that should copy a prefix from one joining now, go back to the front of the queue in order."""
        budget, joining, later = self.prefill_chunk, [], []
        for req in admitted:
            if req.cancelled:  # its caller went away while it waited: never prefilled
                self._stats["cancelled"] += 1
                continue
            if budget <= 0 and joining:
                later.append(req)
                continue
            reused, source = self._match(req)
            if joining and self._waits_for(req, joining, reused):
                later.append(req)
                continue
            self._copy_prefix(source, reused, len(self._active))
            req.version = self._weight_version
            req.n_cached = reused
            req.feed = req.prompt_ids[reused:]
            budget -= len(req.feed)
            self._active.append(req)
            joining.append(req)
            self._stats.update(
                requests=1,
                prompt_tokens=len(req.prompt_ids),
                prefill_tokens_computed=len(req.feed),
                prefill_tokens_reused=reused,
            )
        if later:
            with self._cv:
                self._waiting.extendleft(reversed(later))
        if joining:
            self._params = None

    def _step(self, admitted: list[_Request]) -> None:
        """One forward for every active row (decoding rows feed their last token, joining rows their
        prompt's uncached rest), then one sampling call; finished and cancelled rows leave afterwards."""
        gone = [i for i, r in enumerate(self._active) if r.cancelled]
        if gone:  # free their slots before the step: nothing of theirs is computed any more
            self._leave(gone)
        for r in self._active:
            r.feed = r.completion[-1:]
        self._join(admitted)
        rows = self._active
        if not rows:
            return
        try:
            logits = self.decoder.step([r.feed for r in rows], [r.n_cached for r in rows])
            for r in rows:
                r.n_cached += len(r.feed)
            if self._params is None:
                self._params = BatchParams(
                    [r.params.temperature for r in rows],
                    [r.params.top_p for r in rows],
                    [r.top_k for r in rows],
                    self._device,
                )
            live = [not r.finish for r in rows]
            uniforms = [
                r.rng.random() if ok and r.params.temperature > 0 else 0.0
                for r, ok in zip(rows, live, strict=True)
            ]
            toks, lps = sample_batch(logits, self._params, uniforms)
        except Exception as e:
            log.exception("engine step failed")
            for req in rows:
                _resolve(req.future, req.loop, error=EngineError(f"engine step failed: {e}"))
            self._active, self._params = [], None
            return
        done = []
        for i, r in enumerate(rows):
            if live[i]:
                r.add(toks[i], lps[i], self._weight_version, self.tokenizer)
                # MoE: a finished row runs once more so its last token's routes (and KV) are recorded.
                if r.finish and not self._record_routes:
                    done.append(i)
            else:
                done.append(i)
        self._stats["generated_tokens"] += sum(live)
        self._stats["decode_steps"] += 1
        self._stats["step_rows"] += len(rows)
        if done:
            self._leave(done)

    def _leave(self, indices: list[int]) -> None:
        """Resolve finished rows, keep their KV in the prefix cache, compact the remaining slots."""
        gone = set(indices)
        for i in sorted(gone):
            r = self._active[i]
            if r.cancelled:  # its caller went away: the slot is freed, its KV is not kept
                self._stats["cancelled"] += 1
                continue
            routes = self.decoder.get_routes(i, r.n_cached) if self._record_routes else None
            mixed = any(v != r.version for v in r.versions)
            result = GenerationResult(r.completion, r.logprobs, r.finish or "length", r.version,
                                      routed_experts=routes, token_versions=r.versions if mixed else None)
            _resolve(r.future, r.loop, result)
            self._store_prefix(r, i)
        keep_n = len(self._active) - len(gone)
        holes = [i for i in sorted(gone) if i < keep_n]
        movers = [j for j in range(keep_n, len(self._active)) if j not in gone]
        for hole, j in zip(holes, movers, strict=True):
            self.decoder.move(j, hole, self._active[j].n_cached)
            self._active[hole] = self._active[j]
        del self._active[keep_n:]
        self.decoder.release(keep_n)
        self._params = None

    def _store_prefix(self, r: _Request, slot: int) -> None:
        # KV computed under older weights (an in-flight update came) never serves the new ones
        if self.prefix.max_bytes <= 0 or r.n_cached == 0 or r.version != self._weight_version:
            return
        tokens = torch.tensor((r.prompt_ids + r.completion)[: r.n_cached], dtype=torch.long)
        nbytes = self._kv_bytes(r.n_cached)
        if self.prefix.would_store(tokens, nbytes):
            k, v, routes = self.decoder.export(slot, r.n_cached)
            self.prefix.add(PrefixEntry(tokens, k, v, routes, nbytes))

    def _kv_bytes(self, n: int) -> int:
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        elem = next(self.model.parameters()).element_size()
        return 2 * n * int(cfg.num_hidden_layers) * int(cfg.num_key_value_heads) * int(head_dim) * elem


def default_stop_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     chat_format: ChatFormat | None = None) -> list[int]:
    """The engine's stop ids: the chat format's (end-of-turn, eos ids of the tokenizer and of
    generation_config.json, pad), then the loaded model's own ``generation_config.eos_token_id``.

    A tokenizer without a usable chat template (a base model served by `legorl serve` takes token ids, not
    conversations) stops on its eos and the model's generation-config eos only."""
    try:
        ids = list((chat_format if chat_format is not None else read_chat_format(tokenizer)).stop_ids)
    except ChatFormatError as e:
        log.warning("LocalEngine: no chat format (%s); stopping on the eos ids only", e)
        ids = [tokenizer.eos_token_id]
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += gen if isinstance(gen, list) else [gen]
    return [t for t in dict.fromkeys(ids) if isinstance(t, int) and not isinstance(t, bool)]


def _verify(dec: FastDecoder, model: PreTrainedModel, vocab: int) -> str | None:
    """Compare the fast forward's logits with the HF model's on a short sequence; None when they agree."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (min(16, dec.max_len),), generator=gen).tolist()
    with torch.inference_mode():
        ref = model(torch.tensor([ids], device=dec.device)).logits[0].float()
        got = dec.prefill(0, ids, 0, all_logits=True)
    tol = 1e-3 if dec.dtype == torch.float32 else 5e-2
    err = float((ref - got).abs().max()) / max(1.0, float(ref.abs().max()))
    return None if err <= tol else f"fast forward disagrees with the HF model (relative error {err:.2e})"
