"""IS corrections, rejection, aggregation, KL and entropy terms against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from legorl.train.losses import (
    aggregate,
    is_correction,
    k3,
    policy_loss,
    policy_terms,
    sequence_weights,
)

L = math.log


def _ones(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.bool)


def test_three_policies_ratio_is_cur_over_old_and_weight_old_over_rollout() -> None:
    old = torch.zeros(1, 1)
    cur = torch.full((1, 1), L(1.5), requires_grad=True)
    rollout = torch.full((1, 1), L(0.5))  # old / rollout = 2 (at the cap, not truncated)
    loss, m = policy_loss(cur, old, rollout, torch.tensor([1.0]), _ones(1, 1), clip_high=0.28)
    # ratio 1.5 clipped to 1.28 (positive advantage), weighted by 2
    assert float(loss.detach()) == pytest.approx(-2 * 1.28)
    assert m["ratio_mean"] == pytest.approx(1.5) and m["is_weight_mean"] == pytest.approx(2.0)
    assert m["is_truncated_frac"] == 0.0 and m["clip_frac"] == 1.0
    # the known mistake: old taken as rollout would give ratio 3 and weight 1
    wrong, _ = policy_loss(cur, rollout, rollout, torch.tensor([1.0]), _ones(1, 1), tis_cap=None)
    assert float(wrong.detach()) == pytest.approx(-1.28)


def test_token_mis_rejects_above_cap_and_leaves_denominator() -> None:
    cur = torch.zeros(1, 3)
    rollout = torch.tensor([[L(4.0), -L(3.0), 0.0]])  # w = 0.25, 3, 1
    loss, m = policy_loss(cur, None, rollout, torch.tensor([1.0]), _ones(1, 3), is_mode="mis", tis_cap=2.0)
    assert float(loss.detach()) == pytest.approx(-(0.25 + 1.0) / 2)  # the w=3 token left num. and denom.
    assert m["is_rejected_frac"] == pytest.approx(1 / 3) and m["tokens"] == 2.0
    assert m["is_weight_mean"] == pytest.approx((0.25 + 1.0) / 2)


def test_sequence_level_tis_and_mis() -> None:
    cur = torch.zeros(2, 2)
    # row 0: ratios 2 and 1.5 -> sequence ratio 3; row 1: ratio 0.5 on its only loss token
    rollout = torch.tensor([[-L(2.0), -L(1.5)], [L(2.0), 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])
    loss, m = policy_loss(cur, None, rollout, adv, mask, is_mode="seq-tis", tis_cap=2.0)
    assert float(loss.detach()) == pytest.approx(-(2.0 + 2.0 + 0.5) / 3)
    assert m["is_truncated_frac"] == pytest.approx(2 / 3)
    loss, _ = policy_loss(cur, None, rollout, adv, mask, is_mode="seq-tis", tis_cap=None)
    assert float(loss.detach()) == pytest.approx(-(3.0 + 3.0 + 0.5) / 3)
    loss, m = policy_loss(cur, None, rollout, adv, mask, is_mode="seq-mis", tis_cap=2.0)
    assert float(loss.detach()) == pytest.approx(-0.5) and m["is_rejected_frac"] == pytest.approx(2 / 3)
    loss, m = policy_loss(cur, None, rollout, adv, mask, is_mode="none")
    assert float(loss.detach()) == pytest.approx(-1.0) and m["is_weight_mean"] == 1.0


def test_token_masking_bounds() -> None:
    cur = torch.zeros(1, 4)
    rollout = -torch.log(torch.tensor([[0.4, 1.0, 2.5, 2.0]]))  # ratios 0.4, 1, 2.5, 2
    c = is_correction(cur, rollout, _ones(1, 4), "tis", 2.0, token_mask=(0.5, 2.0))
    assert c.keep.tolist() == [[False, True, False, True]]
    loss, m = policy_loss(cur, None, rollout, torch.tensor([1.0]), _ones(1, 4), token_mask=(0.5, 2.0))
    assert float(loss.detach()) == pytest.approx(-(1.0 + 2.0) / 2)
    assert m["is_rejected_frac"] == 0.5


def test_geometric_sequence_masking() -> None:
    cur = torch.zeros(2, 2)
    # row 0: log-ratios +0.02, -0.02 -> geometric mean 1 (kept); row 1: 0.03, 0 -> exp(0.015) (rejected)
    rollout = torch.tensor([[-0.02, 0.02], [-0.03, 0.0]])
    c = is_correction(cur, rollout, _ones(2, 2), "none", None, seq_mask=(0.99, 1.01))
    assert c.keep.tolist() == [[True, True], [False, False]]
    # a masked (prompt) token does not enter the geometric mean
    mask = torch.tensor([[1, 1], [0, 1]], dtype=torch.bool)
    c = is_correction(cur, rollout, mask, "none", None, seq_mask=(0.99, 1.01))
    assert c.keep.tolist() == [[True, True], [False, True]]
    adv = torch.tensor([1.0, -3.0])
    loss, m = policy_loss(cur, None, rollout, adv, _ones(2, 2), is_mode="none", seq_mask=(0.99, 1.01))
    assert float(loss.detach()) == pytest.approx(-1.0) and m["is_rejected_frac"] == 0.5


def test_rejected_tokens_get_no_gradient_and_leave_denominator() -> None:
    cur = torch.zeros(1, 3, requires_grad=True)
    rollout = torch.tensor([[0.0, -L(5.0), 0.0]])  # middle token ratio 5 -> rejected by [0.5, 2]
    loss, _ = policy_loss(cur, None, rollout, torch.tensor([1.0]), _ones(1, 3), token_mask=(0.5, 2.0))
    loss.backward()
    assert cur.grad[0].tolist() == pytest.approx([-0.5, 0.0, -0.5])


def test_seq_mean_token_sum_and_weights_match_aggregate() -> None:
    tok = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0], [7.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]], dtype=torch.bool)
    ids = torch.tensor([0, 0, 1])
    # rollout 0 sums 1 + 1 + 1 + 4 = 7, rollout 1 sums 7 -> mean 7
    assert float(aggregate(tok, mask, "seq-mean-token-sum", ids)) == pytest.approx(7.0)
    assert float(aggregate(tok, mask, "seq-mean-token-mean", ids)) == pytest.approx((1.75 + 7) / 2)
    counts, groups = [3, 1, 1], ["a", "a", "b"]
    assert sequence_weights(counts, groups, "token-mean") == pytest.approx([0.2] * 3)
    assert sequence_weights(counts, groups, "seq-mean-token-mean") == pytest.approx([1 / 8, 1 / 8, 1 / 2])
    assert sequence_weights(counts, groups, "seq-mean-token-sum") == pytest.approx([0.5] * 3)
    # a group whose tokens were all rejected leaves the mean over groups
    assert sequence_weights([3, 0], ["a", "b"], "seq-mean-token-sum") == pytest.approx([1.0, 0.0])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        w = torch.tensor(sequence_weights([3, 1, 1], ["0", "0", "1"], agg))
        via_weights = float((torch.where(mask, tok, 0.0) * w[:, None]).sum())
        assert via_weights == pytest.approx(float(aggregate(tok, mask, agg, ids)))
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        aggregate(tok, mask, "mean")


def test_k3_kl_to_reference_value_and_gradient() -> None:
    cur = torch.full((1, 2), L(0.5), requires_grad=True)
    ref = torch.full((1, 2), L(0.25))
    # exp(ref - cur) - (ref - cur) - 1 = 0.5 + ln 2 - 1
    assert k3(cur, ref).detach()[0].tolist() == pytest.approx([0.5 + L(2) - 1] * 2)
    assert float(k3(ref, ref).abs().max()) == 0.0
    loss, m = policy_loss(
        cur, None, cur.detach(), torch.tensor([0.0]), _ones(1, 2), ref_logp=ref, kl_coef=0.1
    )
    assert float(loss.detach()) == pytest.approx(0.1 * (0.5 + L(2) - 1))
    assert m["kl_ref"] == pytest.approx(0.5 + L(2) - 1)
    loss.backward()
    # d/dcur = kl_coef * (1 - exp(ref - cur)) / n_tokens = 0.1 * 0.5 / 2
    assert cur.grad[0].tolist() == pytest.approx([0.025, 0.025])


def test_entropy_bonus() -> None:
    cur = torch.zeros(1, 2)
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)
    terms = policy_terms(cur, None, cur, torch.tensor([0.0]), entropy=ent, entropy_coef=0.01)
    loss = aggregate(terms.token_loss, terms.keep)
    assert float(loss.detach()) == pytest.approx(-0.01 * 2.0)
    loss.backward()
    assert ent.grad[0].tolist() == pytest.approx([-0.005, -0.005])


def test_unknown_is_mode() -> None:
    with pytest.raises(ValueError, match="unknown IS mode"):
        is_correction(torch.zeros(1, 1), torch.zeros(1, 1), mode="ppo")


def test_mismatch_metrics_hand_computed() -> None:
    from legorl.train.metrics import effective_sample_size, mismatch_metrics

    trainer = torch.tensor([L(0.5), L(0.25), L(0.1)])
    sampler = torch.tensor([L(0.25), L(0.25), L(0.2)])  # dlogp = ln 2, 0, -ln 2
    m = mismatch_metrics(trainer, sampler, torch.tensor([1.0, 2.0]))
    assert m["train/mismatch_abs_dlogp_mean"] == pytest.approx(2 * L(2) / 3)
    assert m["train/mismatch_abs_dlogp_max"] == pytest.approx(L(2))
    # k3 = exp(r) - 1 - r: (1 - ln 2) + 0 + (0.5 - 1 + ln 2), mean over 3 tokens
    assert m["train/mismatch_k3_kl"] == pytest.approx((1 - L(2) + 0.5 - 1 + L(2)) / 3)
    # Pearson of p: (0.5, 0.25, 0.1) vs (0.25, 0.25, 0.2)
    a, b = torch.tensor([0.5, 0.25, 0.1]), torch.tensor([0.25, 0.25, 0.2])
    da, db = a - a.mean(), b - b.mean()
    assert m["train/logprob_pearson"] == pytest.approx(float((da * db).sum() / (da.norm() * db.norm())))
    # ESS (sum w)^2 / (n sum w^2) = 9 / (2 * 5)
    assert m["train/is_ess"] == pytest.approx(0.9) and m["train/is_weight_mean"] == pytest.approx(1.5)
    assert effective_sample_size(torch.ones(7)) == pytest.approx(1.0)
    empty = mismatch_metrics(torch.zeros(0), torch.zeros(0), torch.zeros(0))
    assert empty["train/logprob_pearson"] == 1.0 and empty["train/is_ess"] == 1.0
