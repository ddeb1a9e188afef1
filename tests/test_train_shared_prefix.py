"""Shared-prefix training is exact: the same logprobs and the same gradients as per-sequence forwards."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import tiny_qwen3

from legorl.records import TrainingSequence
from legorl.train.batching import collate, plan_micro_batches
from legorl.train.logprobs import sequence_logprobs
from legorl.train.prefix import PrefixGroup, find_groups, shared_logprobs
from legorl.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEMP = 0.7
TOL = 1e-5
CPU = torch.device("cpu")


def tiny_model(seed: int = 0) -> transformers.Qwen3ForCausalLM:
    return tiny_qwen3(seed).float().eval()


def _ids(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, 300, (n,), generator=g).tolist()


def _sequence(
    model: torch.nn.Module, rid: str, ids: list[int], first_loss: int, adv: float, g: torch.Generator
) -> TrainingSequence:
    """Loss tokens from ``first_loss`` on, but a 'tool output' gap of 0s in the middle (multi-turn);
    rollout logprobs are the model's own plus sampler noise."""
    n = len(ids)
    mask = [0] * first_loss + [1] * (n - first_loss)
    for t in range(first_loss + 3, min(n, first_loss + 6)):
        mask[t] = 0
    with torch.no_grad():
        lp, _ = sequence_logprobs(model, torch.tensor([ids]), torch.ones(1, n, dtype=torch.long), TEMP)
    lp = lp[0] + 0.02 * torch.randn(n - 1, generator=g)
    lps = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp.tolist(), mask[1:])]
    return TrainingSequence(rid, ids, mask, lps, adv)


def grouped_batch(
    model: torch.nn.Module, groups: int = 2, size: int = 4, prompt: int = 80, seed: int = 1
) -> list[TrainingSequence]:
    """``groups`` groups of ``size`` rollouts sharing a ``prompt``-token first prompt, continuations of
    different lengths (the first few continuation tokens are prompt too: a chat template's header)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        shared = _ids(g, prompt + 7 * k)
        for i in range(size):
            ids = shared + _ids(g, 6 + 9 * i + 3 * k)
            adv = (-1.0) ** i * (0.5 + 0.25 * i)
            out.append(_sequence(model, f"g{k}r{i}", ids, len(shared) + 2, adv, g))
    return out


def unshared_batch(model: torch.nn.Module, n: int = 4, seed: int = 2) -> list[TrainingSequence]:
    g = torch.Generator().manual_seed(seed)
    return [_sequence(model, f"u{i}", _ids(g, 70 + 11 * i), 30, (-1.0) ** i, g) for i in range(n)]


def mixed_batch(model: torch.nn.Module) -> list[TrainingSequence]:
    """Two groups, unrelated sequences, and a group member whose loss starts inside the shared
    prompt (the prefix must be cut before it) next to one trained from its second token."""
    seqs = grouped_batch(model) + unshared_batch(model, 3)
    g = torch.Generator().manual_seed(3)
    prompt = seqs[0].token_ids[:80]
    seqs.append(_sequence(model, "early", prompt + _ids(g, 12), 70, 1.0, g))
    seqs.append(_sequence(model, "first", prompt + _ids(g, 5), 1, -1.0, g))
    return seqs


def grads(trainer: Trainer, seqs: list[TrainingSequence], sft: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter's accumulated gradient over one step (the optimizer never moves)."""
    trainer.optimizer.step = lambda *a, **k: None
    trainer.optimizer.zero_grad = lambda *a, **k: None
    metrics = trainer.sft_step(seqs, max_grad_norm=1.0) if sft else trainer.train_step(seqs)
    assert metrics.get("train/skipped", metrics.get("sft/skipped")) == 0.0
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def pair(seqs: list[TrainingSequence], **kw: object) -> tuple[dict, dict, Trainer]:
    """Gradients of shared-prefix and per-sequence training of the same model on the same batch."""
    on = Trainer(tiny_model(), temperature=TEMP, max_grad_norm=None, shared_prefix=True, **kw)
    off = Trainer(tiny_model(), temperature=TEMP, max_grad_norm=None, shared_prefix=False, **kw)
    return grads(on, seqs), grads(off, seqs), on


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= TOL, f"max |grad difference| {worst:.2e}"
    assert any(v.abs().max() > 1e-3 for v in a.values())  # a real gradient, not two zeros


def n_groups(trainer: Trainer, seqs: list[TrainingSequence]) -> int:
    return sum(len(mb.groups) for mb in trainer._micro_plan(seqs, list(range(len(seqs)))))


# ---- detection and planning -------------------------------------------------------------------


def test_groups_found_and_cut_before_the_first_loss_token() -> None:
    model = tiny_model()
    seqs = mixed_batch(model)
    groups = find_groups(seqs, list(range(len(seqs))), 64)
    by_member = {seqs[i].rollout_id: g for g in groups for i in g.members}
    assert len(groups) == 2
    assert by_member["g1r0"].length == 87 and len(by_member["g1r0"].members) == 4
    # "early" (loss from token 70: prefix <= 69) joins group 0 and shortens it; "first" joins nothing
    assert by_member["g0r0"].length == 69 and "early" in by_member and "first" not in by_member
    assert not any(r.startswith("u") for r in by_member)
    assert find_groups(unshared_batch(model), [0, 1, 2, 3], 64) == []


def test_a_common_system_prompt_does_not_merge_two_tasks() -> None:
    """Same 70-token 'system prompt', then two different 'tasks' of 60 tokens: two groups of the
    task prompts (130 tokens), not one group of the system prompt."""
    g = torch.Generator().manual_seed(4)
    system = _ids(g, 70)
    tasks = [system + _ids(g, 60) for _ in range(2)]
    seqs = [
        TrainingSequence(f"t{t}r{i}", tasks[t] + _ids(g, 20), [0] * 131 + [1] * 19, [0.0] * 150, 1.0)
        for t in range(2)
        for i in range(3)
    ]
    groups = find_groups(seqs, list(range(6)), 64)
    assert sorted((len(g.members), g.length) for g in groups) == [(3, 130), (3, 130)]


def test_micro_batches_count_the_prefix_once() -> None:
    model = tiny_model()
    seqs = grouped_batch(model, groups=1, size=4, prompt=100)  # continuations of 6, 15, 24, 33 tokens
    groups = find_groups(seqs, [0, 1, 2, 3], 64)
    assert groups == [PrefixGroup(groups[0].members, 100)]
    # 100 + 4 x 33 = 232 tokens fit a 240-token budget (per sequence: 4 x 133 = 532 would not)
    assert plan_micro_batches(seqs, [0, 1, 2, 3], 240, groups) == [
        ([3, 2, 1, 0], [PrefixGroup((3, 2, 1, 0), 100)])
    ]
    # 180 tokens: sub-groups recompute the prefix (100 + 2 x 33, then 100 + 2 x 15)
    plan = plan_micro_batches(seqs, [0, 1, 2, 3], 180, groups)
    assert [g for _, gs in plan for g in gs] == [PrefixGroup((3, 2), 100), PrefixGroup((1, 0), 100)]


# ---- exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [{}, {"top_p": 0.9, "top_k": 50}], ids=["plain", "nucleus"])
def test_logprobs_equal_per_sequence(sampling: dict) -> None:
    model = tiny_model()
    seqs = mixed_batch(model)
    idx = list(range(len(seqs)))
    ((rows, groups),) = plan_micro_batches(seqs, idx, 10**6, find_groups(seqs, idx, 64))
    mb = collate(seqs, rows, 0, CPU, groups=groups)
    assert len(mb.groups) == 2
    kw = {"top_p": sampling.get("top_p", 1.0), "top_k": sampling.get("top_k", 0)}
    with torch.no_grad():
        ref, ref_ent = sequence_logprobs(
            model, mb.input_ids, mb.attention_mask, TEMP, loss_mask=mb.mask, **kw
        )
        got, got_ent = shared_logprobs(model, mb.input_ids, mb.attention_mask, mb.mask, mb.groups, TEMP, **kw)
    assert (got[~mb.mask] == 0).all() and (got[mb.mask] != 0).all()
    assert (got - ref).abs().max() <= TOL and (got_ent - ref_ent).abs().max() <= TOL


@pytest.mark.parametrize(
    ("batch", "expect_groups"),
    [(grouped_batch, 2), (unshared_batch, 0), (mixed_batch, 2)],
    ids=["groups", "no-shared-prefix", "mixed"],
)
def test_gradients_equal_per_sequence(batch, expect_groups: int) -> None:
    seqs = batch(tiny_model())
    on, off, trainer = pair(seqs)
    assert n_groups(trainer, seqs) == expect_groups
    assert_same_grads(on, off)


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["shared", "per-sequence"])
def test_fused_forward_gradients_equal_the_model_forward(shared_prefix: bool) -> None:
    """train/fast_forward.py (its prefix_cache for groups) against HF's own forward and KV cache."""
    seqs = mixed_batch(tiny_model())
    kw = {"temperature": TEMP, "max_grad_norm": None, "shared_prefix": shared_prefix}
    fast = Trainer(tiny_model(), fast_forward=True, **kw)
    model_forward = Trainer(tiny_model(), fast_forward=False, **kw)
    assert fast.fast_forward[id(fast.model)] and n_groups(fast, seqs) == (2 if shared_prefix else 0)
    assert_same_grads(grads(fast, seqs), grads(model_forward, seqs))


def test_gradients_equal_across_micro_batches_and_decoupled_passes() -> None:
    """Small micro-batches split groups (the prefix recomputed per sub-group), two mini-batches,
    two epochs (old-logprob pass), token rejection, KL to a reference and an entropy bonus."""
    seqs = mixed_batch(tiny_model())
    kw = {
        "micro_batch_tokens": 200,
        "mini_batches": 2,
        "ppo_epochs": 2,
        "token_mask": (0.9, 1.1),
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
        "loss_agg": "seq-mean-token-mean",
    }
    on, off, trainer = pair(seqs, **kw)
    assert n_groups(trainer, seqs) >= 2
    assert_same_grads(on, off)


def test_metrics_equal_per_sequence() -> None:
    seqs = mixed_batch(tiny_model())
    kw = {"temperature": TEMP, "ppo_epochs": 2, "kl_coef": 0.1, "lr": 1e-3}
    on = Trainer(tiny_model(), shared_prefix=True, **kw).train_step(seqs)
    off = Trainer(tiny_model(), shared_prefix=False, **kw).train_step(seqs)
    for key in ("train/mismatch_k3_kl", "train/entropy", "train/kl_ref", "train/is_weight_mean"):
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key


def test_sft_gradients_equal_per_sequence() -> None:
    seqs = grouped_batch(tiny_model())
    on = grads(Trainer(tiny_model(), max_grad_norm=None, shared_prefix=True), seqs, sft=True)
    off = grads(Trainer(tiny_model(), max_grad_norm=None, shared_prefix=False), seqs, sft=True)
    assert_same_grads(on, off)


def test_moe_without_routing_replay_shares_and_with_it_falls_back() -> None:
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    moe = transformers.Qwen3MoeForCausalLM(cfg).float().eval()
    seqs = grouped_batch(moe, groups=1)
    on = Trainer(moe, temperature=TEMP, max_grad_norm=None)
    assert on.shared_prefix and n_groups(on, seqs) == 1
    with torch.no_grad():
        mb = on._micro_plan(seqs, list(range(len(seqs))))[0]
        got, _ = on._logprobs(moe, mb)
        ref, _ = sequence_logprobs(moe, mb.input_ids, mb.attention_mask, TEMP, loss_mask=mb.mask)
    assert (got - ref).abs().max() <= TOL
    assert not Trainer(moe, routing_replay="R3").shared_prefix


def test_fallbacks() -> None:
    assert not Trainer(tiny_model(), shared_prefix=False).shared_prefix
    assert not Trainer(tiny_model(), gradient_checkpointing=True).shared_prefix
    assert Trainer(tiny_model()).shared_prefix


def test_a_group_over_a_loss_token_is_refused() -> None:
    model = tiny_model()
    seqs = grouped_batch(model, groups=1, size=2)
    mb = collate(seqs, [0, 1], 0, CPU)
    too_long = [PrefixGroup((0, 1), 82)]  # token 82 is a loss token: its logit is at position 81
    with pytest.raises(ValueError, match="loss tokens"):
        shared_logprobs(model, mb.input_ids, mb.attention_mask, mb.mask, too_long, TEMP)
