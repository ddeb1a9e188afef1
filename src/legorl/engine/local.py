"""In-process torch engine with continuous batching, for CPU and single-GPU runs.

One worker thread owns the model. Each new request is prefilled alone (exactly what it
would see unbatched), then joins the running batch: its KV cache is left-padded to the
batch length and stacked with the others. Every decode step runs one batched forward for
all active requests (2D attention mask hides the padding; position ids are per row), and
finished requests leave between steps. Async callers wait on asyncio futures that the
worker resolves with ``loop.call_soon_threadsafe``.

Weight updates are applied by the worker when the batch is empty: while one is pending no
request is admitted, so a request never spans two weight versions.

Logprobs follow ``legorl.engine.sampling`` (the definition the trainer imports).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import logging
import random
import threading
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from legorl.engine.base import EngineError, check_prompt
from legorl.engine.sampling import sample_token
from legorl.records import GenerationResult, SamplingParams

log = logging.getLogger(__name__)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [batch, kv_heads, time, head_dim]


@dataclasses.dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    stop_ids: frozenset[int]
    generator: torch.Generator
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    version: int = 0
    completion: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish: str | None = None
    cancelled: bool = False

    def add(self, token: int, logprob: float, tokenizer: PreTrainedTokenizerBase) -> None:
        """Record a sampled token and decide whether the request is finished."""
        self.completion.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish = "stop"
        elif self.params.stop and _hits_stop(self.completion, self.params.stop, tokenizer):
            self.finish = "stop"  # keep every token up to the one completing the stop string
        elif len(self.completion) >= self.max_new:
            self.finish = "length"


@dataclasses.dataclass
class _Update:
    state_dict: dict[str, torch.Tensor]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[int]


def _hits_stop(ids: list[int], stops: list[str], tokenizer: PreTrainedTokenizerBase) -> bool:
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


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad dim -2 (time) of a [batch, heads, time, dim] tensor to ``length``."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0))


class LocalEngine:
    """Engine running a transformers causal LM in a background thread (see module docstring)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        max_batch: int = 8,
        stop_token_ids: list[int] | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.weight_version = 0
        if stop_token_ids is None:
            stop_token_ids = [
                t
                for t in (
                    tokenizer.convert_tokens_to_ids("<|im_end|>"),
                    tokenizer.convert_tokens_to_ids("<|endoftext|>"),
                )
                if isinstance(t, int) and t != tokenizer.unk_token_id
            ]
        self.stop_token_ids = list(stop_token_ids)
        self._vocab = int(model.get_input_embeddings().weight.shape[0])
        self._device = next(model.parameters()).device
        # transformers renamed past_key_values -> cache; accept both so the engine survives upgrades.
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self._seed_rng = random.Random()
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._updates: collections.deque[_Update] = collections.deque()
        self._closed = False
        # Batch state, touched only by the worker thread.
        self._rows: list[_Request] = []
        self._kv: KV = []
        self._cache: DynamicCache | None = None  # wraps _kv; rebuilt only when rows join or leave
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self._device)
        self._thread = threading.Thread(target=self._run, name="legorl-local-engine", daemon=True)
        self._thread.start()

    # ---- public API (event loop side) ----

    def max_context(self) -> int:
        return int(self.model.config.max_position_embeddings)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, rollout_id: str = ""
    ) -> GenerationResult:
        """Sample a completion for ``prompt_ids``.

        Stops on any of the engine's stop ids (default ``<|im_end|>``, ``<|endoftext|>``) plus
        ``params.stop_token_ids`` (the stop token is kept, with its logprob), or when the decoded
        completion contains a ``params.stop`` string (tokens are kept up to and including the one that
        completed it: token fidelity over text trimming). ``params.seed`` makes sampling reproducible,
        also when batched with other requests.
        """
        check_prompt(prompt_ids, self._vocab, self.max_context())
        if params.max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {params.max_tokens}")
        loop = asyncio.get_running_loop()
        gen = torch.Generator(device=self._device)
        gen.manual_seed(params.seed if params.seed is not None else self._seed_rng.getrandbits(63))
        req = _Request(
            prompt_ids=list(prompt_ids),
            params=params,
            max_new=min(params.max_tokens, self.max_context() - len(prompt_ids)),
            stop_ids=frozenset(self.stop_token_ids) | frozenset(params.stop_token_ids),
            generator=gen,
            loop=loop,
            future=loop.create_future(),
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

    async def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Apply ``state_dict`` (all or some parameters) once in-flight requests finish; new requests
        wait meanwhile, so every result is generated under exactly one version. Returns the new version."""
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
        upd = _Update(state_dict, loop, loop.create_future())
        with self._cv:
            if self._closed:
                raise EngineError("engine is closed")
            self._updates.append(upd)
            self._cv.notify()
        return await upd.future

    async def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        await asyncio.to_thread(self._thread.join)

    # ---- worker thread ----

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._closed or self._waiting or self._rows or self._updates):
                        self._cv.wait()
                    if self._closed:
                        break
                    admitted: list[_Request] = []
                    update = self._updates.popleft() if self._updates and not self._rows else None
                    if not self._updates:  # drain the batch before a pending update
                        while self._waiting and len(self._rows) + len(admitted) < self.max_batch:
                            admitted.append(self._waiting.popleft())
                if update is not None:
                    self._apply_update(update)
                    continue
                for req in admitted:
                    if not req.cancelled:
                        self._prefill(req)
                if self._rows:
                    self._decode_step()
        finally:
            with self._cv:  # also when the worker died: later calls fail fast instead of hanging
                self._closed = True
            self._fail_all(EngineError("engine closed"))

    def _fail_all(self, error: EngineError) -> None:
        with self._cv:
            pending = list(self._waiting) + self._rows
            self._waiting.clear()
            updates = list(self._updates)
            self._updates.clear()
        for req in pending:
            _resolve(req.future, req.loop, error=error)
        for upd in updates:
            _resolve(upd.future, upd.loop, error=error)
        self._reset_batch()

    def _reset_batch(self) -> None:
        self._rows, self._kv, self._cache = [], [], None
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self._device)

    def _apply_update(self, upd: _Update) -> None:
        try:
            with torch.no_grad():
                self.model.load_state_dict(upd.state_dict, strict=False)
            self.weight_version += 1
            _resolve(upd.future, upd.loop, self.weight_version)
        except Exception as e:  # unexpected backend failure
            log.exception("update_weights failed")
            _resolve(upd.future, upd.loop, error=EngineError(f"update_weights failed: {e}"))

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor | None, cache: DynamicCache
    ) -> torch.Tensor:
        kwargs = {self._cache_kw: cache}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **kwargs)
        return out.logits[:, -1, :].float()

    def _finish(self, req: _Request) -> None:
        result = GenerationResult(req.completion, req.logprobs, req.finish or "length", req.version)
        _resolve(req.future, req.loop, result)

    def _prefill(self, req: _Request) -> None:
        """Run the prompt alone, sample the first token, then merge the request into the batch."""
        req.version = self.weight_version
        try:
            cache = DynamicCache()
            ids = torch.tensor([req.prompt_ids], dtype=torch.long, device=self._device)
            with torch.inference_mode():
                logits = self._forward(ids, None, None, cache)
            tok, lp = sample_token(logits[0], req.params.temperature, req.params.top_p, req.generator)
            req.add(tok, lp, self.tokenizer)
        except Exception as e:
            log.exception("prefill failed")
            _resolve(req.future, req.loop, error=EngineError(f"prefill failed: {e}"))
            return
        if req.finish:
            self._finish(req)
            return
        new_kv = [(layer.keys, layer.values) for layer in cache.layers]
        t_new, t_old = new_kv[0][0].shape[-2], self._mask.shape[1]
        length = max(t_new, t_old)
        new_mask = torch.ones(1, t_new, dtype=torch.long, device=self._device)
        if not self._rows:
            self._kv, self._mask = new_kv, new_mask
            self._cache = cache
        else:
            self._cache = None
            self._kv = [
                (
                    torch.cat([_left_pad(k, length), _left_pad(nk, length)]),
                    torch.cat([_left_pad(v, length), _left_pad(nv, length)]),
                )
                for (k, v), (nk, nv) in zip(self._kv, new_kv, strict=True)
            ]
            self._mask = torch.cat(
                [F.pad(self._mask, (length - t_old, 0)), F.pad(new_mask, (length - t_new, 0))]
            )
        self._rows.append(req)

    def _decode_step(self) -> None:
        """One batched forward for all active rows; finished and cancelled rows leave afterwards."""
        try:
            ids = torch.tensor(
                [[r.completion[-1]] for r in self._rows], dtype=torch.long, device=self._device
            )
            pos = self._mask.sum(dim=1, keepdim=True)  # real tokens so far = position of the fed token
            mask = torch.cat([self._mask, torch.ones_like(pos)], dim=1)
            cache = self._cache if self._cache is not None else DynamicCache(ddp_cache_data=self._kv)
            with torch.inference_mode():
                logits = self._forward(ids, mask, pos, cache)
            self._kv = [(layer.keys, layer.values) for layer in cache.layers]
            self._cache, self._mask = cache, mask
            for i, req in enumerate(self._rows):
                if not req.cancelled:
                    tok, lp = sample_token(logits[i], req.params.temperature, req.params.top_p, req.generator)
                    req.add(tok, lp, self.tokenizer)
        except Exception as e:
            log.exception("decode step failed")
            for req in self._rows:
                _resolve(req.future, req.loop, error=EngineError(f"decode failed: {e}"))
            self._reset_batch()
            return
        self._evict()

    def _evict(self) -> None:
        keep = []
        for i, req in enumerate(self._rows):
            if req.finish:
                self._finish(req)
            elif not req.cancelled:
                keep.append(i)
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep, device=self._device)
        mask = self._mask.index_select(0, idx)
        start = int((mask.sum(dim=0) > 0).nonzero()[0])  # drop columns that are padding in every row
        self._mask = mask[:, start:]
        self._kv = [
            (k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in self._kv
        ]
        self._rows = [self._rows[i] for i in keep]
        self._cache = None
