"""Fallback backend: any transformers causal LM, one DynamicCache per slot.

Used when the fast forward (engine/fast.py) does not cover the architecture. It implements the
same slot interface as FastDecoder so the scheduler, sampling and prefix cache are shared, but a
decode step runs one forward per active sequence (correct for every model, not fast). For MoE
models with transformers top-k routers (Qwen3-MoE, Mixtral, OLMoE) the experts of every token are
recorded with ``legorl.models.routing.record_routing``.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from transformers import DynamicCache, PreTrainedModel

from legorl.models.routing import find_routers, record_routing


class HFDecoder:
    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int) -> None:
        self.model = model
        self.num_slots, self.max_len = num_slots, max_len
        self.device = next(model.parameters()).device
        # transformers renamed past_key_values -> cache; accept both so the engine survives upgrades.
        self._cache_kw = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self.caches: list[DynamicCache | None] = [None] * num_slots
        # Per slot: routed experts of every cached position [n, moe_layers, top_k] (MoE models only).
        self.routes: list[torch.Tensor | None] | None = [None] * num_slots if find_routers(model) else None

    def load_weights(self) -> None:  # the HF model is used directly: nothing to rebuild
        pass

    def _kv(self, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cache = self.caches[slot]
        assert cache is not None, f"slot {slot} has no cache"
        return [(layer.keys[:, :, :n], layer.values[:, :, :n]) for layer in cache.layers]

    def _forward(self, slot: int, ids: list[int], start: int) -> torch.Tensor:
        cache = self.caches[slot] if start > 0 else None
        if cache is None:
            assert start == 0, "prefill from a non-zero start needs a cached prefix"
            cache = DynamicCache()
        elif cache.get_seq_length() != start:
            cache.crop(start)
        self.caches[slot] = cache
        x = torch.tensor([ids], device=self.device)
        pos = torch.arange(start, start + len(ids), device=self.device).unsqueeze(0)
        recording = record_routing(self.model) if self.routes is not None else contextlib.nullcontext()
        with recording as rec:
            out = self.model(input_ids=x, position_ids=pos, use_cache=True, **{self._cache_kw: cache})
        if self.routes is not None:
            new = rec.pop()[0].to(torch.int16)  # [T, layers, top_k]
            old = self.routes[slot]
            self.routes[slot] = new if start == 0 or old is None else torch.cat([old[:start], new])
        return out.logits[0].float()

    def prefill(self, slot: int, ids: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        logits = self._forward(slot, ids, start)
        return logits if all_logits else logits[-1]

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        return torch.stack(
            [self._forward(i, [t], p)[-1] for i, (t, p) in enumerate(zip(tokens, positions, strict=True))]
        )

    def step(self, ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        """One engine step over slots ``0..n-1``: logits of each row's last token [n, vocab]."""
        return torch.stack(
            [self._forward(i, x, s)[-1] for i, (x, s) in enumerate(zip(ids, starts, strict=True))]
        )

    def _slot_routes(self, slot: int, n: int) -> torch.Tensor | None:
        if self.routes is None or self.routes[slot] is None:
            return None
        return self.routes[slot][:n]  # type: ignore[index]

    def copy(self, src: int, dst: int, n: int) -> None:
        if src == dst or n <= 0:
            return
        k, v, routes = self.export(src, n)
        self.load(dst, k, v, routes, n)

    def move(self, src: int, dst: int, n: int) -> None:
        self.caches[dst], self.caches[src] = self.caches[src], None
        if self.routes is not None:
            self.routes[dst], self.routes[src] = self.routes[src], None

    def release(self, first_free: int) -> None:
        """Drop the caches of slots >= first_free (they hold finished sequences)."""
        for i in range(first_free, self.num_slots):
            self.caches[i] = None
            if self.routes is not None:
                self.routes[i] = None

    def export(self, slot: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
        kv = self._kv(slot, n)
        routes = self._slot_routes(slot, n)
        return (
            [k.clone() for k, _ in kv],
            [v.clone() for _, v in kv],
            None if routes is None else routes.clone(),
        )

    def load(
        self, slot: int, k: list[torch.Tensor], v: list[torch.Tensor], routes: torch.Tensor | None, n: int
    ) -> None:
        self.caches[slot] = DynamicCache(
            ddp_cache_data=[(a[:, :, :n].clone(), b[:, :, :n].clone()) for a, b in zip(k, v, strict=True)]
        )
        if self.routes is not None:
            self.routes[slot] = None if routes is None else routes[:n].clone()

    def get_routes(self, slot: int, n: int) -> list[list[list[int]]] | None:
        routes = self._slot_routes(slot, n)
        return None if routes is None else routes.tolist()
