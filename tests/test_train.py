"""Training math and the trainer, on hand-computed values and a tiny real Qwen3 model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import tiny_qwen3

from legorl.records import LLMCall, Rollout, TrainingSequence
from legorl.train.advantages import carries_signal, group_advantages
from legorl.train.logprobs import sequence_logprobs
from legorl.train.losses import aggregate, policy_loss
from legorl.train.sequences import build_batch, build_sequences, merge_stats
from legorl.train.trainer import Trainer

# ---- advantages -------------------------------------------------------------------------------


def test_grpo_with_masked_rollout() -> None:
    adv = group_advantages([1.0, None, 0.0, 0.0, 1.0], method="grpo")
    assert adv == [0.5, None, -0.5, -0.5, 0.5]


def test_grpo_normalized_std() -> None:
    # mean 0.25, population std sqrt(0.1875)
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], normalize_std=True, eps=0.0)
    std = math.sqrt(0.1875)
    assert adv == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])


def test_drgrpo_ignores_std() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 0.0], method="drgrpo", normalize_std=True) == pytest.approx(
        [0.75, -0.25, -0.25, -0.25]
    )


def test_rloo_leave_one_out() -> None:
    # 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5; masked one excluded from every baseline
    assert group_advantages([1.0, 0.0, None, 0.0], method="rloo") == pytest.approx([1.0, -0.5, None, -0.5])


def test_small_groups_get_zero() -> None:
    assert group_advantages([1.0, None, None]) == [0.0, None, None]
    assert group_advantages([None, None]) == [None, None]
    assert group_advantages([]) == []


def test_reinforce_has_no_baseline() -> None:
    # Only resolved rollouts train; a lone or all-resolved group still does; masked stay masked.
    assert group_advantages([1.0, 0.0, None, 1.0], "reinforce") == [1.0, 0.0, None, 1.0]
    assert group_advantages([1.0], "reinforce") == [1.0]


def test_unknown_method() -> None:
    with pytest.raises(ValueError, match="unknown advantage method"):
        group_advantages([1.0, 0.0], method="ppo")


# ---- policy loss ------------------------------------------------------------------------------


def _two_seq_example() -> tuple[torch.Tensor, ...]:
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0])
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-0.3, -1.2, -0.7]])
    return logp, adv, mask


def test_ratio_one_gives_minus_mean_advantage() -> None:
    logp, adv, mask = _two_seq_example()
    cur = logp.clone().requires_grad_(True)
    loss, m = policy_loss(cur, None, logp, adv, mask)
    # unmasked tokens: two with adv 1, one with adv -2 -> -(1 + 1 - 2) / 3 = 0
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-7)
    assert m["ratio_mean"] == 1.0 and m["clip_frac"] == 0.0 and m["is_weight_mean"] == 1.0
    loss.backward()
    # d loss / d cur = -adv / n_tokens on unmasked tokens, 0 elsewhere
    expected = torch.tensor([[0.0, -1 / 3, -1 / 3], [0.0, 2 / 3, 0.0]])
    assert torch.allclose(cur.grad, expected)


def test_clip_high_caps_positive_advantage() -> None:
    old = torch.zeros(1, 2)
    cur = torch.full((1, 2), math.log(1.5), requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(cur, old, old, torch.tensor([2.0]), mask, clip_high=0.28)
    assert float(loss.detach()) == pytest.approx(-1.28 * 2.0)
    assert m["clip_frac"] == 1.0 and m["ratio_mean"] == pytest.approx(1.5)
    loss.backward()
    assert torch.all(cur.grad == 0)  # clipped: no gradient
    # negative advantage with ratio 1.5: the unclipped branch is the pessimistic one
    loss, m = policy_loss(cur, old, old, torch.tensor([-1.0]), mask)
    assert float(loss.detach()) == pytest.approx(1.5) and m["clip_frac"] == 0.0
    # clip_low: ratio 0.5, negative advantage -> clipped at 0.8
    cur_low = torch.full((1, 2), math.log(0.5))
    loss, m = policy_loss(cur_low, old, old, torch.tensor([-1.0]), mask, clip_low=0.2)
    assert float(loss.detach()) == pytest.approx(0.8) and m["clip_frac"] == 1.0


def test_masked_tokens_leave_numerator_and_denominator() -> None:
    logp, adv, mask = _two_seq_example()
    base, _ = policy_loss(logp, None, logp, adv, mask)
    # one more column, masked, with absurd values everywhere
    cur2 = torch.cat([logp, torch.tensor([[1e4], [-1e4]])], dim=1)
    roll2 = torch.cat([logp, torch.tensor([[-1e4], [1e4]])], dim=1)
    mask2 = torch.cat([mask, torch.zeros(2, 1, dtype=torch.bool)], dim=1)
    old2 = torch.cat([logp, torch.tensor([[-5e3], [3e3]])], dim=1)
    for old in (None, old2):
        for agg in ("token-mean", "seq-mean-token-mean", "token-sum"):
            ref, _ = policy_loss(logp, None if old is None else logp, logp, adv, mask, agg=agg)
            got, m = policy_loss(cur2, old, roll2, adv, mask2, agg=agg)
            assert torch.isfinite(got) and float(got) == pytest.approx(float(ref), abs=1e-6)
            assert m["tokens"] == 3.0
    assert float(base) == pytest.approx(0.0, abs=1e-7)
    # gradients stay finite too
    cur2 = cur2.clone().requires_grad_(True)
    loss, _ = policy_loss(cur2, old2, roll2, adv, mask2)
    loss.backward()
    assert torch.isfinite(cur2.grad).all()


def test_tis_weight_is_capped() -> None:
    cur = torch.zeros(1, 3)
    rollout = torch.tensor([[math.log(4.0), -math.log(3.0), math.log(1.0)]])  # w = 0.25, 3, 1
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, m = policy_loss(cur, None, rollout, torch.tensor([1.0]), mask, tis_cap=2.0)
    assert float(loss.detach()) == pytest.approx(-(0.25 + 2.0 + 1.0) / 3)
    assert m["is_weight_mean"] == pytest.approx((0.25 + 2.0 + 1.0) / 3)
    assert m["is_truncated_frac"] == pytest.approx(1 / 3)
    loss, _ = policy_loss(cur, None, rollout, torch.tensor([1.0]), mask, tis_cap=None)
    assert float(loss.detach()) == pytest.approx(-(0.25 + 3.0 + 1.0) / 3)


def test_seq_mean_token_mean_groups_by_ids() -> None:
    tok = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0], [7.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    # rows 0 and 1 are one rollout: mean(1, 1, 1, 4) = 1.75; row 2: 7 -> (1.75 + 7) / 2
    got = aggregate(tok, mask, "seq-mean-token-mean", torch.tensor([0, 0, 1]))
    assert float(got) == pytest.approx((1.75 + 7.0) / 2)
    assert float(aggregate(tok, mask, "token-mean")) == pytest.approx(14 / 5)


# ---- sequence building ------------------------------------------------------------------------


def _call(index: int, prompt: list[int], completion: list[int], parent: int | None = None, **kw) -> LLMCall:
    return LLMCall(
        rollout_id="r1",
        index=index,
        wire_format="openai_chat",
        request={},
        prompt_ids=prompt,
        completion_ids=completion,
        completion_logprobs=[-0.1 * (index + 1) - 0.01 * k for k in range(len(completion))],
        finish_reason="stop",
        weight_version=0,
        completion_text="",
        parent_index=parent,
        **kw,
    )


def _chain() -> list[LLMCall]:
    c0 = _call(0, [1, 2, 3], [10, 11])
    c1 = _call(1, [1, 2, 3, 10, 11, 4, 5], [12], parent=0)  # bridge 4, 5
    c2 = _call(2, [1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14, 15], parent=1)  # bridge 6
    return [c0, c1, c2]


def test_three_chained_calls_merge_into_one_sequence() -> None:
    calls = _chain()
    seqs = build_sequences("r1", list(reversed(calls)), advantage=0.5)  # order by index, not list order
    assert len(seqs) == 1
    s = seqs[0]
    assert s.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14, 15]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert s.rollout_logprobs == pytest.approx([0, 0, 0, -0.1, -0.11, 0, 0, -0.2, 0, -0.3, -0.31, -0.32])
    assert s.advantage == 0.5 and s.n_sequences_in_rollout == 1 and s.rollout_id == "r1"
    stats = merge_stats(calls, seqs)
    assert stats["tokens_trained"] == 12 and stats["tokens_unmerged"] == 5 + 8 + 12
    assert stats["compression"] == pytest.approx(12 / 25)
    assert stats["loss_tokens"] == 6


def test_segment_break_starts_new_sequence() -> None:
    c0, c1, _ = _chain()
    # the harness condensed history: the prompt no longer extends the earlier tokens
    c2 = _call(2, [1, 2, 99, 5, 12, 6], [13, 14], parent=None, segment_break="history rewritten")
    seqs = build_sequences("r1", [c0, c1, c2], advantage=-1.0)
    assert len(seqs) == 2
    assert [s.n_sequences_in_rollout for s in seqs] == [2, 2]
    assert seqs[1].token_ids == [1, 2, 99, 5, 12, 6, 13, 14]
    assert seqs[1].loss_mask == [0, 0, 0, 0, 0, 0, 1, 1]
    # even a prefix-extending prompt starts a new sequence when the proxy flagged a break
    c2b = _call(2, [1, 2, 3, 10, 11, 4, 5, 12], [7], segment_break="template changed")
    assert len(build_sequences("r1", [c0, c1, c2b], 1.0)) == 2
    # and a non-prefix prompt without a flag does too
    c2c = _call(2, [1, 2, 3, 10, 99], [7])
    seqs = build_sequences("r1", [c0, c1, c2c], 1.0)
    assert len(seqs) == 2 and seqs[1].loss_mask == [0, 0, 0, 0, 0, 1]
    stats = merge_stats([c0, c1, c2c], seqs)
    assert stats["compression"] == pytest.approx((8 + 6) / (5 + 8 + 6))


def test_interleaved_subagent_calls_still_merge() -> None:
    c0 = _call(0, [1, 2], [10])
    sub = _call(1, [50, 51], [60])
    c2 = _call(2, [1, 2, 10, 3], [11], parent=0)
    sub2 = _call(3, [50, 51, 60, 52], [61], parent=1)
    seqs = build_sequences("r1", [c0, sub, c2, sub2], 1.0)
    assert [s.token_ids for s in seqs] == [[1, 2, 10, 3, 11], [50, 51, 60, 52, 61]]


def test_unsampled_calls_masked_unless_sft() -> None:
    c0 = _call(0, [1, 2], [10, 11], sampled_from_policy=False)
    c1 = _call(1, [1, 2, 10, 11, 3], [12], parent=0)
    (s,) = build_sequences("r1", [c0, c1], 1.0)
    assert s.loss_mask == [0, 0, 0, 0, 0, 1] and s.rollout_logprobs[2:4] == [0.0, 0.0]
    (s,) = build_sequences("r1", [c0, c1], 1.0, include_unsampled=True)
    assert s.loss_mask == [0, 0, 1, 1, 0, 1]
    # a rollout made only of unsampled calls yields nothing to train on
    assert build_sequences("r1", [c0], 1.0) == []


def test_routed_experts_keep_sampling_time_routes() -> None:
    c0 = _call(0, [1, 2], [10], routed_experts=[[[0]], [[1]], [[2]]])
    c1 = _call(1, [1, 2, 10, 3], [11], parent=0, routed_experts=[[[0]], [[1]], [[9]], [[3]], [[4]]])
    (s,) = build_sequences("r1", [c0, c1], 1.0)
    assert s.routed_experts == [[[0]], [[1]], [[2]], [[3]], [[4]]]  # token 10 keeps its decode route


def test_build_batch_skips_masked_rollouts() -> None:
    rollouts = [
        Rollout(id=f"r{i}", step=0, task_id="t", group_id="g", sample_index=i, harness="h") for i in range(3)
    ]
    for r in rollouts:
        r.calls = [_call(0, [1, 2], [10])]
    seqs = build_batch(rollouts, [0.5, None, -0.5])
    assert [(s.rollout_id, s.advantage) for s in seqs] == [("r0", 0.5), ("r2", -0.5)]


def test_bad_capture_is_rejected() -> None:
    bad = _call(0, [1], [10, 11])
    bad.completion_logprobs = [-0.1]
    with pytest.raises(ValueError, match="invalid_capture"):
        build_sequences("r1", [bad], 1.0)


# ---- logprobs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("temperature", "top_p"), [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0), (0.7, 0.9)])
def test_logprobs_match_engine_definition(temperature: float, top_p: float) -> None:
    from legorl.engine.sampling import token_logprobs
    from legorl.train.logprobs import token_logprobs_and_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 300, generator=g) * 3
    ids = torch.argmax(logits, dim=-1)  # always inside any nucleus
    got, ent = token_logprobs_and_entropy(logits, ids, temperature, top_p)
    assert torch.equal(got, token_logprobs(logits, ids, temperature, top_p))
    if top_p == 1.0:
        scaled = logits / temperature if temperature > 0 else logits
        assert torch.allclose(got, torch.log_softmax(scaled, -1).gather(-1, ids[..., None])[..., 0])
    assert torch.isfinite(ent).all() and (ent >= 0).all()


def test_token_outside_trainer_nucleus_stays_finite() -> None:
    from legorl.train.logprobs import token_logprobs_and_entropy

    logits = torch.tensor([[[5.0, 0.0, -5.0]]])
    logp, _ = token_logprobs_and_entropy(logits, torch.tensor([[2]]), 1.0, top_p=0.5)
    assert torch.isfinite(logp).all()


# ---- trainer ----------------------------------------------------------------------------------

TEMP = 0.7


_tiny_model = tiny_qwen3


def _sampled_sequences(model: torch.nn.Module, advantages: list[float]) -> list[TrainingSequence]:
    """Sequences whose rollout logprobs were computed by the model itself (a perfect sampler)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, adv in enumerate(advantages):
        n = 12 + 5 * i
        ids = torch.randint(1, 300, (1, n), generator=g)
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), TEMP)
        mask = [0] * 4 + [1] * (n - 4)
        if i == 1:
            mask[7] = 0  # a bridging token inside the sequence
        lps = [0.0] + [float(x) if m else 0.0 for x, m in zip(lp[0].tolist(), mask[1:])]
        out.append(
            TrainingSequence(
                rollout_id=f"r{i}",
                token_ids=ids[0].tolist(),
                loss_mask=mask,
                rollout_logprobs=lps,
                advantage=adv,
            )
        )
    return out


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lr_zero_first_step_has_exact_mismatch_and_no_change() -> None:
    model = _tiny_model()
    seqs = _sampled_sequences(model, [1.0, -0.5, 0.25])
    before = _params(model)
    # a tiny micro-batch budget forces padding and gradient accumulation across micro-batches
    tr = Trainer(model, lr=0.0, temperature=TEMP, micro_batch_tokens=40)
    m = tr.train_step(seqs)
    assert all(isinstance(v, float) for v in m.values())
    assert m["train/logprob_pearson"] == pytest.approx(1.0, abs=1e-6)
    assert abs(m["train/mismatch_k3_kl"]) < 1e-9
    assert m["train/mismatch_abs_dlogp_max"] < 1e-4
    assert m["train/ratio_mean"] == 1.0 and m["train/clip_frac"] == 0.0
    assert m["train/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["train/is_ess"] == pytest.approx(1.0, abs=1e-6)
    assert m["train/skipped"] == 0.0 and m["train/grad_norm"] > 0.0
    assert m["train/tokens"] == sum(len(s.token_ids) for s in seqs)
    loss_tokens = sum(sum(s.loss_mask[1:]) for s in seqs)
    assert m["train/masked_frac"] == pytest.approx(1 - loss_tokens / m["train/tokens"])
    assert m["train/entropy"] > 0.0
    assert tr.step == 1
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_grad_norm_is_the_mean_over_the_steps_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_model()
    seqs = _sampled_sequences(model, [1.0, -0.5, 0.25, -1.0])
    tr = Trainer(model, lr=1e-2, temperature=TEMP, mini_batches=2, ppo_epochs=2)
    norms: list[float] = []
    clip = tr._clip_grads
    monkeypatch.setattr(tr, "_clip_grads", lambda max_norm: norms.append(clip(max_norm)) or norms[-1])
    m = tr.train_step(seqs)
    assert len(norms) == 4 and m["train/updates"] == 4.0 and len(set(norms)) == 4, norms
    assert m["train/grad_norm"] == pytest.approx(sum(norms) / 4) and m["train/grad_norm_max"] == max(norms)


def test_accumulation_matches_full_batch_gradient() -> None:
    seqs = _sampled_sequences(_tiny_model(), [1.0, -0.5, 0.25])
    grads = []
    for budget in (10_000, 30):
        model = _tiny_model()
        tr = Trainer(model, lr=0.0, temperature=TEMP, micro_batch_tokens=budget, max_grad_norm=None)
        tr.optimizer.step = lambda *a, **k: None  # keep the gradients for inspection
        tr.optimizer.zero_grad = lambda *a, **k: None
        tr.train_step(seqs)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_positive_advantage_raises_sequence_logprob() -> None:
    model = _tiny_model()
    (seq,) = _sampled_sequences(model, [1.0])
    ids = torch.tensor([seq.token_ids])
    mask = torch.tensor(seq.loss_mask[1:], dtype=torch.bool)

    def seq_logp() -> float:
        with torch.no_grad():
            lp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), TEMP)
        return float(lp[0][mask].sum())

    start = seq_logp()
    tr = Trainer(model, lr=1e-3, temperature=TEMP)
    for _ in range(4):
        m = tr.train_step([seq])
        assert m["train/skipped"] == 0.0
    assert seq_logp() > start + 1.0
    assert tr.step == 4


def test_all_zero_advantages_skip_the_step() -> None:
    model = _tiny_model()
    seqs = _sampled_sequences(model, [0.0, 0.0])
    before = _params(model)
    tr = Trainer(model, lr=1e-2, temperature=TEMP)
    m = tr.train_step(seqs)
    assert m["train/skipped"] == 1.0 and tr.step == 0
    assert m["train/logprob_pearson"] == pytest.approx(1.0, abs=1e-6)  # metrics still reported
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rollout_mean_weighs_split_rollouts_like_one() -> None:
    # one rollout split in two sequences (3 + 1 tokens) and another with 1 token
    model = _tiny_model()
    tr = Trainer(model, loss_agg="rollout-mean")

    def mk(rid: str, n_loss: int) -> TrainingSequence:
        return TrainingSequence(rid, [1] * (n_loss + 1), [0] + [1] * n_loss, [0.0] * (n_loss + 1), 1.0)

    w = tr._sequence_weights([mk("a", 3), mk("a", 1), mk("b", 1)])
    assert w == pytest.approx([1 / 8, 1 / 8, 1 / 2])
    tr.loss_agg = "token-mean"
    assert tr._sequence_weights([mk("a", 3), mk("a", 1), mk("b", 1)]) == pytest.approx([0.2] * 3)


def test_sft_step_lowers_loss() -> None:
    model = _tiny_model()
    seqs = _sampled_sequences(model, [0.0, 0.0])
    tr = Trainer(model, lr=3e-3)
    losses = [tr.sft_step(seqs, max_grad_norm=1.0)["sft/loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.5
    assert tr.step == 5


def test_state_dict_for_engine_is_detached_copy() -> None:
    model = _tiny_model()
    tr = Trainer(model)
    sd = tr.state_dict_for_engine()
    key = "model.embed_tokens.weight"
    assert not sd[key].requires_grad
    sd[key].zero_()
    assert not torch.equal(sd[key], model.state_dict()[key])
    fresh = _tiny_model(seed=5)
    fresh.load_state_dict(tr.state_dict_for_engine())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_save_load_round_trip(tmp_path) -> None:
    model = _tiny_model()
    seqs = _sampled_sequences(model, [1.0, -1.0])
    tr = Trainer(model, lr=1e-3, temperature=TEMP)
    tr.train_step(seqs)
    tr.train_step(seqs)
    tr.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    ref = _params(model)

    other = Trainer(_tiny_model(seed=3), lr=1e-3, temperature=TEMP)
    other.load(tmp_path / "ckpt")
    assert other.step == 2
    assert all(torch.equal(ref[k], v) for k, v in other.model.state_dict().items())
    # tied embeddings stay tied after loading
    assert other.model.lm_head.weight.data_ptr() == other.model.model.embed_tokens.weight.data_ptr()
    s_ref = tr.optimizer.state_dict()["state"]
    s_new = other.optimizer.state_dict()["state"]
    assert s_ref.keys() == s_new.keys()
    for k in s_ref:
        assert all(torch.equal(torch.as_tensor(s_ref[k][n]), torch.as_tensor(s_new[k][n])) for n in s_ref[k])
    # the next step is identical from both
    m1, m2 = tr.train_step(seqs), other.train_step(seqs)
    assert m1["train/loss"] == pytest.approx(m2["train/loss"], rel=1e-6)
    assert all(torch.equal(v, other.model.state_dict()[k]) for k, v in model.state_dict().items())


def test_untrained_calls_stay_in_the_sequence_without_loss():
    """A teacher's deliberate slip is context for the turns after it, never a target."""
    calls = [_call(0, [1, 2], [3, 4]), _call(1, [1, 2, 3, 4, 5], [6, 7], 0), _call(2, [1, 2, 3, 4, 5, 6, 7, 8], [9], 1)]
    for c in calls:
        c.sampled_from_policy = False
    (seq,) = build_sequences("r1", calls, 1.0, include_unsampled=True, untrained={1})
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert seq.loss_mask == [0, 0, 1, 1, 0, 0, 0, 0, 1]


def test_rloo_positive_trains_only_successes_of_mixed_groups() -> None:
    # a success weighs the share of the others that failed; failures and all-solved groups weigh 0
    assert group_advantages([1.0, 0.0, 0.0, None], "rloo-positive") == pytest.approx([1.0, 0.0, 0.0, None])
    assert group_advantages([1.0, 1.0, 0.0], "rloo-positive") == pytest.approx([0.5, 0.5, 0.0])
    assert group_advantages([1.0, 1.0], "rloo-positive") == [0.0, 0.0]
    assert not carries_signal([1.0, 1.0], "rloo-positive") and carries_signal([1.0, 0.0], "rloo-positive")


def test_is_weight_quantiles_for_the_dashboard() -> None:
    from legorl.train.metrics import mismatch_metrics

    w = torch.arange(1, 101, dtype=torch.float32) / 50  # 0.02 ... 2.0
    m = mismatch_metrics(torch.zeros(100), torch.zeros(100), w)
    assert m["train/is_weight_max"] == pytest.approx(2.0)
    assert m["train/is_weight_p50"] == pytest.approx(float(torch.quantile(w.double(), 0.5)))
    assert m["train/is_weight_p05"] == pytest.approx(float(torch.quantile(w.double(), 0.05)))
    assert m["train/is_weight_p95"] == pytest.approx(float(torch.quantile(w.double(), 0.95)))
    empty = mismatch_metrics(torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert empty["train/is_weight_p50"] == 1.0
