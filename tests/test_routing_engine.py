"""End to end: the engine records routes, the sequence builder merges them, the trainer replays them."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from legorl.engine import LocalEngine
from legorl.models import ModelSpec, build_model
from legorl.records import LLMCall, SamplingParams
from legorl.train.sequences import build_sequences
from legorl.train.trainer import Trainer


@pytest.fixture(scope="module")
def moe(tokenizer):
    return build_model(
        ModelSpec(num_layers=2, moe=True, num_experts=4, num_experts_per_tok=2, seed=4), tokenizer
    )


def _generate(model, tokenizer, prompts: list[list[int]]) -> list:
    async def main():
        eng = LocalEngine(model, tokenizer, stop_token_ids=[])
        try:
            out = []
            for p in prompts:  # sequential: the second prompt extends the first call (prefix reuse)
                out.append(await eng.generate(p, SamplingParams(temperature=1.0, max_tokens=12, seed=3)))
            return out
        finally:
            await eng.close()

    return asyncio.run(main())


def test_engine_routes_replayed_by_the_trainer(moe, tokenizer) -> None:
    g = torch.Generator().manual_seed(0)
    p0 = torch.randint(10, 2000, (20,), generator=g).tolist()
    (r0,) = _generate(copy.deepcopy(moe), tokenizer, [p0])
    p1 = p0 + r0.completion_ids + torch.randint(10, 2000, (6,), generator=g).tolist()
    (r1,) = _generate(copy.deepcopy(moe), tokenizer, [p1])
    calls = [
        LLMCall(
            "r",
            i,
            "openai_chat",
            {},
            p,
            r.completion_ids,
            r.logprobs,
            r.finish_reason,
            0,
            "",
            parent_index=None if i == 0 else 0,
            routed_experts=r.routed_experts,
        )
        for i, (p, r) in enumerate([(p0, r0), (p1, r1)])
    ]
    (seq,) = build_sequences("r", calls, advantage=1.0)
    assert seq.routed_experts is not None and len(seq.routed_experts) == len(seq.token_ids)
    assert all(x >= 0 for row in seq.routed_experts for layer in row for x in layer)  # nothing missing
    m = {
        mode: Trainer(copy.deepcopy(moe), lr=0.0, temperature=1.0, routing_replay=mode).train_step([seq])
        for mode in ("off", "R3")
    }
    r3 = m["R3"]
    assert r3["train/routing_replayed_frac"] == 1.0
    # same fp32 weights: the engine's fast path and the trainer agree to float noise, with or without R3
    assert r3["train/logprob_pearson"] > 0.999 and r3["train/mismatch_abs_dlogp_max"] < 1e-3
    assert r3["train/mismatch_k3_kl"] <= m["off"]["train/mismatch_k3_kl"] + 1e-9
