"""Routing replay inside the trainer (R2 / R3) and through sequence building, on a tiny Qwen3-MoE."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from legorl.models.routing import find_routers, record_routing
from legorl.records import LLMCall, TrainingSequence
from legorl.train.logprobs import sequence_logprobs
from legorl.train.sequences import build_sequences
from legorl.train.trainer import Trainer

TEMP = 1.0


def tiny_moe(seed: int = 0) -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=256,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for r in find_routers(model):
            r.weight.normal_(0, 0.3)
    return model.eval()


def sampler_sequences(
    trainer_model: torch.nn.Module, router_noise: float, n: int = 3
) -> list[TrainingSequence]:
    """Sequences 'sampled' by a copy of the model whose routers are perturbed (another kernel's
    numerics), with that sampler's logprobs and recorded routes."""
    sampler = copy.deepcopy(trainer_model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for r in find_routers(sampler):
            r.weight.add_(router_noise * torch.randn(r.weight.shape, generator=g))
    out = []
    for i in range(n):
        length = 10 + 4 * i
        ids = torch.randint(1, 300, (1, length), generator=g)
        with torch.no_grad(), record_routing(sampler) as rec:
            lp, _ = sequence_logprobs(sampler, ids, torch.ones_like(ids), TEMP)
        routes = rec.pop()[0].tolist()
        mask = [0] * 3 + [1] * (length - 3)
        lps = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp[0].tolist(), mask[1:])]
        out.append(
            TrainingSequence(
                f"r{i}", ids[0].tolist(), mask, lps, [1.0, -1.0, 0.5][i % 3], routed_experts=routes
            )
        )
    return out


def test_r3_with_own_routes_is_exact_and_replays_everything() -> None:
    model = tiny_moe()
    seqs = sampler_sequences(model, router_noise=0.0)
    m = Trainer(model, lr=0.0, temperature=TEMP, routing_replay="R3").train_step(seqs)
    assert m["train/routing_replayed_frac"] == 1.0 and m["train/routing_diff_frac"] == 0.0
    assert m["train/mismatch_abs_dlogp_max"] < 1e-5


def test_r3_removes_routing_mismatch_and_cuts_kl() -> None:
    model = tiny_moe()
    seqs = sampler_sequences(model, router_noise=0.05)
    off = Trainer(model, lr=0.0, temperature=TEMP).train_step(seqs)
    r3 = Trainer(model, lr=0.0, temperature=TEMP, routing_replay="R3").train_step(seqs)
    assert r3["train/routing_token_diff_frac"] > 0.0  # the trainer's own routes differ from the sampler's
    assert r3["train/mismatch_k3_kl"] < 0.5 * off["train/mismatch_k3_kl"]
    assert r3["train/logprob_pearson"] >= off["train/logprob_pearson"]


def test_router_gets_gradients_under_r3_and_checkpointing_replays_routes() -> None:
    seqs = sampler_sequences(tiny_moe(), router_noise=0.1)
    grads = []
    for ckpt in (False, True):
        tr = Trainer(
            tiny_moe(),
            lr=0.0,
            temperature=TEMP,
            routing_replay="R3",
            max_grad_norm=None,
            gradient_checkpointing=ckpt,
        )
        tr.optimizer.step = lambda *a, **k: None
        tr.optimizer.zero_grad = lambda *a, **k: None
        tr.train_step(seqs)
        routers = find_routers(tr.model)
        assert all(r.weight.grad is not None and float(r.weight.grad.abs().sum()) > 0 for r in routers)
        grads.append(torch.cat([p.grad.flatten() for p in tr.model.parameters() if p.grad is not None]))
    # activation recomputation in backward replays the same routes: same gradient
    assert torch.allclose(grads[0], grads[1], atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_replay_with_several_updates_lr_zero_is_exact(mode: str) -> None:
    model = tiny_moe()
    seqs = sampler_sequences(model, router_noise=0.05)
    tr = Trainer(model, lr=0.0, temperature=TEMP, routing_replay=mode, ppo_epochs=2, mini_batches=2)
    m = tr.train_step(seqs)
    assert m["train/ppo_kl"] == 0.0 and m["train/updates"] == 4
    assert m["train/routing_replayed_frac"] == 1.0
    if mode == "R2":  # R2 replays the trainer's own old-pass routes: nothing differs
        assert m["train/routing_diff_frac"] == 0.0


def test_r3_needs_an_moe_model() -> None:
    dense = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    with pytest.raises(ValueError, match="routing_replay='R3' needs an MoE model"):
        Trainer(dense, routing_replay="R3")


def _call(index: int, prompt: list[int], completion: list[int], routes, parent: int | None = None) -> LLMCall:
    return LLMCall(
        "r1",
        index,
        "openai_chat",
        {},
        prompt,
        completion,
        [-0.5] * len(completion),
        "stop",
        0,
        "",
        parent_index=parent,
        routed_experts=routes,
    )


def test_sequence_routes_fill_gaps_with_sentinel_and_train() -> None:
    r = [[[1, 2], [3, 4]]]  # one token: 2 layers x top-2
    # call 0: the engine has no route for its last sampled token (never fed back)
    c0 = _call(0, [5, 6], [7, 8], routes=r * 3)
    # call 1: prefix-cached prompt (no routes for it), routes for the new bridge + completion only
    c1 = _call(
        1, [5, 6, 7, 8, 9], [10, 11], routes=[[[-1, -1], [-1, -1]]] * 4 + [[[5, 6], [7, 0]]] * 2, parent=0
    )
    c2 = _call(2, [5, 6, 7, 8, 9, 10, 11, 12], [13], routes=None, parent=1)  # a call without routes
    (s,) = build_sequences("r1", [c0, c1, c2], 1.0)
    pad = [[-1, -1], [-1, -1]]
    assert s.routed_experts == r * 3 + [pad] + [[[5, 6], [7, 0]]] * 2 + [pad] * 3
    assert len(s.routed_experts) == len(s.token_ids)
    # no recorded route anywhere: None (nothing to replay)
    (s2,) = build_sequences("r1", [_call(0, [1], [2], routes=None)], 1.0)
    assert s2.routed_experts is None
    # the trainer takes such a sequence under R3 (-1 rows route freely)
    model = tiny_moe()
    m = Trainer(model, lr=0.0, temperature=TEMP, routing_replay="R3").train_step([s, s2])
    assert 0.0 < m["train/routing_replayed_frac"] < 1.0
