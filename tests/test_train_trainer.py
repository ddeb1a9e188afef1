"""Trainer fidelity: decoupled policies, LR=0 invariants, rejection, KL/entropy, schedules, checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import transformers
from helpers import tiny_qwen3

from legorl.records import TrainingSequence
from legorl.train.logprobs import sequence_logprobs
from legorl.train.schedule import LRSchedule
from legorl.train.trainer import Trainer

TEMP = 0.7


tiny_model = tiny_qwen3


def sampled(
    model: torch.nn.Module, advantages: list[float], noise: float = 0.0, rollout_ids: list[str] | None = None
) -> list[TrainingSequence]:
    """Sequences whose rollout logprobs come from the model itself (+ optional sampler noise)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, adv in enumerate(advantages):
        n = 12 + 5 * i
        ids = torch.randint(1, 300, (1, n), generator=g)
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), TEMP)
        lp = lp[0] + noise * torch.randn(n - 1, generator=g)
        mask = [0] * 4 + [1] * (n - 4)
        lps = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp.tolist(), mask[1:])]
        rid = rollout_ids[i] if rollout_ids else f"r{i}"
        out.append(TrainingSequence(rid, ids[0].tolist(), mask, lps, adv))
    return out


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def grads_of(trainer: Trainer, seqs: list[TrainingSequence]) -> torch.Tensor:
    """The accumulated gradient of one train_step (the optimizer step is disabled)."""
    trainer.optimizer.step = lambda *a, **k: None
    trainer.optimizer.zero_grad = lambda *a, **k: None
    trainer.train_step(seqs)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


# ---- LR = 0 ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"ppo_epochs": 2, "mini_batches": 2, "token_mask": (0.5, 2.0), "seq_mask": (0.9, 1.1)},
    ],
    ids=["fused", "decoupled"],
)
def test_lr_zero_ppo_kl_exactly_zero_and_mismatch_does_not_grow(kw: dict) -> None:
    model = tiny_model()
    seqs = sampled(model, [1.0, -0.5, 0.25, -0.75], noise=0.02)
    before = params(model)
    tr = Trainer(model, lr=0.0, temperature=TEMP, micro_batch_tokens=40, **kw)
    history = [tr.train_step(seqs) for _ in range(3)]
    first = history[0]
    assert (
        first["train/ppo_kl"] == 0.0 and first["train/ratio_mean"] == 1.0 and first["train/clip_frac"] == 0.0
    )
    assert first["train/mismatch_k3_kl"] > 0.0 and first["train/logprob_pearson"] > 0.99
    for m in history[1:]:
        assert m["train/ppo_kl"] == 0.0
        for key in ("train/mismatch_k3_kl", "train/mismatch_abs_dlogp_mean", "train/is_ess"):
            assert m[key] == first[key]
    n_updates = kw.get("ppo_epochs", 1) * kw.get("mini_batches", 1)
    assert first["train/updates"] == n_updates and tr.step == 3 * n_updates
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---- three policies, several updates ----------------------------------------------------------


def test_ppo_epochs_keep_old_and_rollout_apart() -> None:
    model = tiny_model()
    seqs = sampled(model, [1.0, -1.0])
    # the sampler ran 1.5x less likely on every loss token: IS weight old/rollout = 1.5 in every epoch
    for s in seqs:
        s.rollout_logprobs = [
            x - math.log(1.5) if m else 0.0 for x, m in zip(s.rollout_logprobs, s.loss_mask)
        ]
    tr = Trainer(model, lr=1e-3, temperature=TEMP, ppo_epochs=3, tis_cap=None)
    m = tr.train_step(seqs)
    assert m["train/is_weight_mean"] == pytest.approx(1.5, rel=1e-4)
    assert m["train/updates"] == 3 and tr.step == 3 and tr.policy_updates == 3
    # the later epochs moved away from the old policy; the first had ratio 1
    assert m["train/ppo_kl"] > 0.0 and m["train/ratio_mean"] != 1.0


def test_token_rejection_equals_dropping_the_tokens() -> None:
    model = tiny_model()
    seqs = sampled(model, [1.0, -0.5, 0.5])
    bad = [(0, 6), (0, 9), (2, 15)]  # (sequence, position) whose sampler logprob is off by log 3
    perturbed = [
        TrainingSequence(s.rollout_id, s.token_ids, s.loss_mask, list(s.rollout_logprobs), s.advantage)
        for s in seqs
    ]
    dropped = [
        TrainingSequence(s.rollout_id, s.token_ids, list(s.loss_mask), s.rollout_logprobs, s.advantage)
        for s in seqs
    ]
    for i, t in bad:
        perturbed[i].rollout_logprobs[t] -= math.log(3.0)
        dropped[i].loss_mask[t] = 0
    for agg, budget in (("token-mean", 30), ("seq-mean-token-mean", 4096)):
        kw = {
            "lr": 0.0,
            "temperature": TEMP,
            "max_grad_norm": None,
            "loss_agg": agg,
            "micro_batch_tokens": budget,
        }
        tr = Trainer(tiny_model(), token_mask=(0.5, 2.0), **kw)
        g_rej = grads_of(tr, perturbed)
        g_ref = grads_of(Trainer(tiny_model(), **kw), dropped)
        assert torch.allclose(g_rej, g_ref, atol=1e-7, rtol=1e-5), agg
    m = Trainer(tiny_model(), lr=0.0, temperature=TEMP, token_mask=(0.5, 2.0)).train_step(perturbed)
    n_loss = sum(sum(s.loss_mask[1:]) for s in seqs)
    assert m["train/is_rejected_frac"] == pytest.approx(3 / n_loss)


def test_mini_batches_keep_rollouts_whole() -> None:
    from legorl.train.batching import mini_batches

    model = tiny_model()
    seqs = sampled(model, [1.0, 1.0, -1.0, 0.5], rollout_ids=["a", "a", "b", "c"])
    bins = mini_batches(seqs, 2)
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3]
    assert any({0, 1} <= set(b) for b in bins)
    assert len(mini_batches(seqs, 10)) == 3  # never more bins than rollouts


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_zero_advantage_sequences_are_not_forwarded_and_the_gradient_is_unchanged(agg: str) -> None:
    """Reward-0 rollouts under reinforce: counted in the loss's mean, never forwarded (no KL/entropy term)."""
    model = tiny_model()
    advs = [1.0, 0.0, 0.5, 0.0, 0.0]
    seqs = sampled(model, advs, noise=0.02)
    # The same batch with the zeros a hair above zero: every sequence forwarded, the same maths to ~1e-30
    forwarded = [dataclasses.replace(s, advantage=s.advantage or 1e-30) for s in seqs]
    tr = Trainer(copy.deepcopy(model), lr=1e-3, temperature=TEMP, loss_agg=agg)
    ref = Trainer(copy.deepcopy(model), lr=1e-3, temperature=TEMP, loss_agg=agg)
    g, g_ref = grads_of(tr, seqs), grads_of(ref, forwarded)
    assert g.abs().max() > 1e-4
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-7)
    assert tr.train_step(seqs)["train/zero_advantage_skipped"] == 3.0
    assert ref.train_step(forwarded)["train/zero_advantage_skipped"] == 0.0
    # A KL term gives every sequence a gradient: all are forwarded
    assert Trainer(copy.deepcopy(model), lr=1e-3, temperature=TEMP, kl_coef=0.1).train_step(
        seqs)["train/zero_advantage_skipped"] == 0.0


# ---- KL, entropy ------------------------------------------------------------------------------


def test_kl_to_initial_weights_grows_from_zero() -> None:
    model = tiny_model()
    seqs = sampled(model, [1.0, -1.0])
    tr = Trainer(model, lr=3e-3, temperature=TEMP, kl_coef=0.1)
    m0 = tr.train_step(seqs)
    assert m0["train/kl_ref"] == 0.0  # the reference is a frozen copy of the initial weights
    for _ in range(3):
        m = tr.train_step(seqs)
    assert m["train/kl_ref"] > 1e-4
    assert all(not p.requires_grad for p in tr.ref_model.parameters())


def test_reset_reference_anchors_kl_to_the_warm_start() -> None:
    """After SFT the pipeline resets the reference: KL then measures drift from the SFT policy."""
    model = tiny_model()
    seqs = sampled(model, [1.0, 1.0])
    tr = Trainer(model, lr=3e-3, temperature=TEMP, kl_coef=0.1)
    for _ in range(3):
        tr.sft_step(seqs, max_grad_norm=1.0)
    assert tr.train_step(seqs)["train/kl_ref"] > 1e-4  # still the untrained weights
    tr.reset_reference()
    assert all(torch.equal(a, b) for a, b in zip(tr.model.parameters(), tr.ref_model.parameters(), strict=True))
    assert tr.train_step(seqs)["train/kl_ref"] == 0.0
    assert all(not p.requires_grad for p in tr.ref_model.parameters())


def test_entropy_bonus_trains_even_with_zero_advantages() -> None:
    model = tiny_model()
    seqs = sampled(model, [0.0, 0.0])
    tr = Trainer(model, lr=1e-3, temperature=TEMP, entropy_coef=0.1)
    h0 = tr.train_step(seqs)["train/entropy"]
    for _ in range(3):
        m = tr.train_step(seqs)
    assert m["train/skipped"] == 0.0 and m["train/entropy"] > h0


# ---- schedule, checkpoints ----------------------------------------------------------


def test_lr_schedule_values() -> None:
    s = LRSchedule("cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    # warmup 1/3, 2/3; then cosine from 1 to 0.1 over 4 updates
    expected = [1 / 3, 2 / 3, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55]
    assert [s.factor(i) for i in range(5)] == pytest.approx(expected)
    assert s.factor(6) == pytest.approx(0.1) and s.factor(100) == pytest.approx(0.1)
    assert LRSchedule().factor(7) == 1.0
    with pytest.raises(ValueError, match="total_steps"):
        LRSchedule("cosine")


def test_checkpoint_round_trip_with_schedule_and_reference(tmp_path) -> None:
    model = tiny_model()
    seqs = sampled(model, [1.0, -1.0])
    kw = {
        "lr": 1e-3,
        "temperature": TEMP,
        "lr_schedule": "cosine",
        "warmup_steps": 1,
        "total_steps": 5,
        "kl_coef": 0.05,
    }
    tr = Trainer(model, **kw)
    tr.train_step(seqs)
    tr.train_step(seqs)
    assert tr.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # update 1: warmup done
    tr.save(tmp_path / "ckpt")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())

    other = Trainer(tiny_model(seed=3), **kw)
    other.load(tmp_path / "ckpt")
    assert (other.step, other.policy_updates) == (2, 2)
    ref_a, ref_b = tr.ref_model.state_dict(), other.ref_model.state_dict()
    assert all(torch.equal(v, ref_b[k]) for k, v in ref_a.items())  # the initial weights, not seed 3's
    torch.manual_seed(123)  # RNG state is restored by load
    tr.load(tmp_path / "ckpt")
    r1 = torch.rand(3)
    other.load(tmp_path / "ckpt")
    assert torch.equal(torch.rand(3), r1)
    m1, m2 = tr.train_step(seqs), other.train_step(seqs)
    assert m1["train/lr"] == m2["train/lr"] == pytest.approx(1e-3 * LRSchedule("cosine", 1, 5).factor(2))
    assert m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-6)
    assert all(torch.equal(v, other.model.state_dict()[k]) for k, v in tr.model.state_dict().items())


def test_schedule_survives_external_lr_changes() -> None:
    model = tiny_model()
    seqs = sampled(model, [1.0, -1.0])
    tr = Trainer(model, lr=1e-3, temperature=TEMP, warmup_steps=3)
    for g in tr.optimizer.param_groups:
        g["lr"] = 5e-2  # e.g. the pipeline's SFT phase
    tr.sft_step(seqs, max_grad_norm=1.0)
    assert tr.policy_updates == 0 and tr.step == 1
    assert tr.train_step(seqs)["train/lr"] == pytest.approx(1e-3 / 4)


# ---- GPU path options on CPU --------------------------------------------------------------------


def test_checkpoint_without_reference_takes_the_warm_start_as_reference(tmp_path) -> None:
    """A run extended with a KL it did not have: the reference is the warm start, not the build's weights."""
    seqs = sampled(tiny_model(), [1.0, 1.0])
    tr = Trainer(tiny_model(), lr=3e-3, temperature=TEMP)  # no KL: checkpoints carry no reference/
    tr.sft_step(seqs, max_grad_norm=1.0)
    tr.save(tmp_path / "sft")
    tr.train_step(seqs)
    tr.save(tmp_path / "step")
    warm = {k: v.clone() for k, v in transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sft").state_dict().items()}

    with_kl = Trainer(tiny_model(seed=3), lr=3e-3, temperature=TEMP, kl_coef=0.1)
    with_kl.load(tmp_path / "step", reference=tmp_path / "sft")
    assert all(torch.equal(v, warm[k]) for k, v in with_kl.ref_model.state_dict().items() if k in warm)
    assert not torch.equal(with_kl.ref_model.state_dict()["lm_head.weight"], with_kl.model.state_dict()["lm_head.weight"])


def test_bf16_autocast_and_gradient_checkpointing() -> None:
    seqs = sampled(tiny_model(), [1.0, -0.5])
    m = Trainer(tiny_model(), lr=0.0, temperature=TEMP, autocast="bf16").train_step(seqs)
    # bf16 matmuls vs an fp32 sampler: a real but small mismatch
    assert 0.0 < m["train/mismatch_abs_dlogp_mean"] < 0.1 and m["train/logprob_pearson"] > 0.99
    kw = {"lr": 0.0, "temperature": TEMP, "max_grad_norm": None}
    g_ref = grads_of(Trainer(tiny_model(), **kw), seqs)
    tr = Trainer(tiny_model(), gradient_checkpointing=True, **kw)
    assert tr.model.model.gradient_checkpointing
    assert torch.allclose(grads_of(tr, seqs), g_ref, atol=1e-7, rtol=1e-5)


def test_fsdp_requires_several_ranks() -> None:
    with pytest.raises(RuntimeError, match="torchrun"):
        Trainer(tiny_model(), fsdp=True)
