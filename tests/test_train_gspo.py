"""GSPO (trainer.loss: gspo): the sequence-level ratio and clip against a direct computation."""

from __future__ import annotations

import pytest
import torch
from test_train_trainer import TEMP, grads_of, sampled, tiny_model

from legorl.config import ConfigError, TrainerConfig, load_config
from legorl.train.losses import gspo_ratio, policy_loss, policy_terms
from legorl.train.trainer import Trainer

LOW, HIGH = 3e-4, 4e-4  # the paper's clip range, trainer.gspo_clip_low / gspo_clip_high


def _batch(log_ratio_rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cur with grad, old, mask) in float64, rows right-padded; cur - old = the given log ratios."""
    width = max(len(r) for r in log_ratio_rows) + 1  # one padding column at least
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(len(log_ratio_rows), width, generator=g, dtype=torch.float64) * 3
    delta = torch.zeros_like(old)
    mask = torch.zeros_like(old, dtype=torch.bool)
    for i, row in enumerate(log_ratio_rows):
        delta[i, : len(row)] = torch.tensor(row, dtype=torch.float64)
        mask[i, : len(row)] = True
    cur = (old + delta).requires_grad_(True)
    return cur, old, mask


def direct_gspo(
    cur: torch.Tensor, old: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor, seq_weight: torch.Tensor,
    token_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """The paper's objective, by hand: s_i = exp(mean_t (cur - old)) over the sequence's tokens,
    -sum_i seq_weight_i * min(s_i A_i, clip(s_i) A_i). With IS weights w_t the sequence's term is
    the mean of w_t over its tokens times that (a detached per-token weight)."""
    losses = []
    for i in range(cur.shape[0]):
        m = mask[i]
        s = torch.exp((cur[i][m] - old[i][m]).mean())
        obj = torch.minimum(s * adv[i], torch.clamp(s, 1 - LOW, 1 + HIGH) * adv[i])
        w = 1.0 if token_weight is None else token_weight[i][m].mean()
        losses.append(-seq_weight[i] * w * obj)
    return torch.stack(losses).sum()


def _grad(loss: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, cur)
    return g


# Rows: s inside the range; above it (A > 0: clipped); above (A < 0: not clipped); below (A < 0:
# clipped); below (A > 0: not clipped); and token ratios far outside the range whose mean is inside.
ROWS = [
    [1e-4, -2e-4, 5e-5],
    [9e-4, 6e-4, 3e-4, 1e-3],
    [7e-4, 5e-4],
    [-6e-4, -8e-4, -5e-4, -7e-4, -9e-4],
    [-1e-3, -4e-4, -7e-4],
    [0.05, -0.05, 0.02, -0.02],
]
ADV = [0.7, 1.3, -0.4, -1.1, 0.9, -0.6]


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_loss_and_gradient_equal_the_direct_computation(agg: str) -> None:
    cur, old, mask = _batch(ROWS)
    adv = torch.tensor(ADV, dtype=torch.float64)
    n = mask.sum(-1).to(torch.float64)
    # Each aggregation's weight on a sequence's term: per sequence, per token, per sequence x length.
    seq_weight = {"seq-mean-token-mean": torch.full_like(n, 1 / len(n)), "token-mean": n / n.sum(),
                  "seq-mean-token-sum": n / len(n)}[agg]
    loss, m = policy_loss(cur, old, old, adv, mask, LOW, HIGH, agg=agg, is_mode="none", loss="gspo")
    want = direct_gspo(cur, old, mask, adv, seq_weight)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), abs=1e-9)
    assert torch.allclose(_grad(loss, cur), _grad(want, cur), atol=1e-6, rtol=0)
    assert m["gspo_clip_frac"] == pytest.approx(2 / 6)


def test_clipping_is_per_sequence_on_both_sides() -> None:
    cur, old, mask = _batch(ROWS)
    adv = torch.tensor(ADV, dtype=torch.float64)
    loss, m = policy_loss(cur, old, old, adv, mask, LOW, HIGH, agg="seq-mean-token-mean", is_mode="none",
                          loss="gspo")
    g = _grad(loss, cur)
    moved = [bool((g[i][mask[i]] != 0).all()) for i in range(len(ROWS))]
    # clipped above with A > 0 (row 1) and below with A < 0 (row 3): no gradient; every other
    # sequence, row 5 included (token ratios of 0.95-1.05, geometric mean inside), trains every token
    assert moved == [True, False, True, False, True, True]
    s = [float(torch.exp(torch.tensor(r, dtype=torch.float64).mean())) for r in ROWS]
    assert m["gspo_ratio_min"] == pytest.approx(min(s)) and m["gspo_ratio_max"] == pytest.approx(max(s))
    assert m["gspo_ratio_mean"] == pytest.approx(sum(s) / len(s))
    assert m["gspo_clip_frac"] == pytest.approx(2 / 6)
    # the token-level objective, same range: row 5's tokens are clipped one by one, row 1 partly
    ppo, _ = policy_loss(cur, old, old, adv, mask, LOW, HIGH, agg="seq-mean-token-mean", is_mode="none")
    gp = _grad(ppo, cur)
    assert bool((gp[5][mask[5]] == 0).any()) and float(ppo.detach()) != pytest.approx(float(loss.detach()))


def test_sequence_ratio_is_a_geometric_mean_whatever_the_length() -> None:
    base = [0.01, -0.003, 0.02]
    cur, old, mask = _batch([base, base * 3])  # the same tokens' ratios, once and three times
    ratio, s = gspo_ratio(cur, old, mask)
    assert float(s[0]) == pytest.approx(float(s[1]), rel=1e-12)
    assert float(s[0]) == pytest.approx(float(torch.exp(torch.tensor(base).mean())), rel=1e-6)
    assert torch.allclose(ratio.detach()[1][mask[1]], s[1].expand(9), rtol=1e-12)  # every token carries s
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    terms = policy_terms(cur, old, old, adv, 0.2, 0.28, mask=mask, is_mode="none", loss="gspo")
    # Under seq-mean-token-mean both sequences weigh the same, and the long one spreads the same
    # gradient over three times the tokens.
    loss, _ = policy_loss(cur, old, old, adv, mask, 0.2, 0.28, agg="seq-mean-token-mean", is_mode="none",
                          loss="gspo")
    g = _grad(loss, cur)
    assert torch.allclose(g[1][:3] * 3, g[0][:3], atol=1e-12)
    assert torch.allclose(terms.token_loss.detach()[0][:3], terms.token_loss.detach()[1][:3], rtol=1e-12)


def test_is_weights_combine_per_token() -> None:
    """The detached IS weight w_t scales token t's term, as under ppo: token t's gradient is
    -w_t A s grad log p_t / (B n) when its sequence is not clipped, else 0."""
    cur, old, mask = _batch(ROWS[:3])
    adv = torch.tensor(ADV[:3], dtype=torch.float64)
    rollout = old.clone()
    rollout[0, 1] -= 0.3  # w = 1.35 on that token (tis, under the cap)
    rollout[2, 0] += 0.3  # w = 0.74
    w = torch.where(mask, torch.exp(old - rollout), 0.0)
    loss, _ = policy_loss(cur, old, rollout, adv, mask, LOW, HIGH, agg="seq-mean-token-mean", is_mode="tis",
                          loss="gspo")
    want = direct_gspo(cur, old, mask, adv, torch.full((3,), 1 / 3, dtype=torch.float64), token_weight=w)
    assert float(loss.detach()) == pytest.approx(float(want.detach()), abs=1e-7)  # IS weights are float32
    n = mask.sum(-1, keepdim=True)
    s = torch.exp(torch.where(mask, cur - old, 0.0).sum(-1, keepdim=True) / n).detach()
    unclipped = torch.tensor([[True], [False], [True]])  # row 1: s above the range with A > 0
    by_hand = torch.where(mask & unclipped, -w * adv.unsqueeze(-1) * s / (3 * n), 0.0)
    assert torch.allclose(_grad(loss, cur), by_hand, atol=1e-6, rtol=0)


def test_rejected_token_leaves_the_sequence_ratio() -> None:
    cur, old, mask = _batch(ROWS[:3])
    adv = torch.tensor(ADV[:3], dtype=torch.float64)
    # a rejected token leaves the sequence's ratio as well as the loss: as if it were never sampled
    rollout = old.clone()
    rollout[2, 0] -= 2.0  # ratio old / rollout = 7.4, outside token_mask; s moves from e^6e-4 to e^5e-4
    rejected, _ = policy_loss(cur, old, rollout, adv, mask, LOW, HIGH, agg="seq-mean-token-mean",
                              is_mode="none", token_mask=(0.5, 2.0), loss="gspo")
    dropped = mask.clone()
    dropped[2, 0] = False
    want = direct_gspo(cur, old, dropped, adv, torch.full((3,), 1 / 3, dtype=torch.float64))
    assert float(rejected.detach()) == pytest.approx(float(want.detach()), abs=1e-9)
    assert torch.allclose(_grad(rejected, cur), _grad(want, cur), atol=1e-6, rtol=0)


def test_ppo_is_still_the_default_token_level_objective() -> None:
    cur, old, mask = _batch(ROWS)
    adv = torch.tensor(ADV, dtype=torch.float64)
    default = policy_terms(cur, old, old, adv, 0.2, 0.28, mask=mask)
    ppo = policy_terms(cur, old, old, adv, 0.2, 0.28, mask=mask, loss="ppo")
    assert torch.equal(default.token_loss, ppo.token_loss) and default.seq_ratio is None
    # per token: exp(cur - old), not the sequence's ratio
    assert torch.allclose(ppo.ratio[mask], torch.exp(cur - old).detach()[mask])
    with pytest.raises(ValueError, match="unknown loss"):
        policy_terms(cur, old, old, adv, mask=mask, loss="cispo")


# ---- the trainer ------------------------------------------------------------------------------


def test_trainer_one_update_gspo_gradient_equals_ppo() -> None:
    """On-policy (one update: old is cur detached) s = 1 and both objectives have the same
    gradient, sum_t A grad log p_t; GSPO differs only once the policy moved from old."""
    model = tiny_model()
    seqs = sampled(model, [1.0, -0.5, 0.25], noise=0.02)
    g_ppo = grads_of(Trainer(model, lr=1e-3, temperature=TEMP), seqs)
    g_gspo = grads_of(Trainer(model, lr=1e-3, temperature=TEMP, loss="gspo"), seqs)
    assert torch.allclose(g_ppo, g_gspo, atol=1e-7, rtol=1e-5)


def test_trainer_gspo_metrics_and_clip_range() -> None:
    model = tiny_model()
    seqs = sampled(model, [1.0, -0.5, 0.25, -0.75], noise=0.02)
    tr = Trainer(model, lr=1e-3, temperature=TEMP, loss="gspo", ppo_epochs=3, micro_batch_tokens=40)
    assert (tr.clip_low, tr.clip_high) == (LOW, HIGH)
    m = tr.train_step(seqs)
    assert m["train/updates"] == 3.0
    # 4 sequences x 3 updates; the first update's ratios are 1, the later ones moved
    assert m["train/gspo_ratio_min"] < 1.0 < m["train/gspo_ratio_max"]
    assert 0.0 < m["train/gspo_clip_frac"] <= 2 / 3 + 1e-6
    assert "train/clip_frac" in m and "train/ratio_mean" in m
    lr0 = Trainer(tiny_model(), lr=0.0, temperature=TEMP, loss="gspo", ppo_epochs=2).train_step(seqs)
    assert lr0["train/gspo_ratio_min"] == lr0["train/gspo_ratio_max"] == 1.0
    assert lr0["train/gspo_clip_frac"] == 0.0
    assert "train/gspo_clip_frac" not in Trainer(tiny_model(), lr=0.0, temperature=TEMP).train_step(seqs)


# ---- configuration ----------------------------------------------------------------------------


def test_each_loss_refuses_the_other_loss_clip_range(tmp_path) -> None:
    assert TrainerConfig().loss == "ppo"
    assert TrainerConfig(loss="gspo", gspo_clip_high=1e-3).gspo_clip_high == 1e-3
    with pytest.raises(ValueError, match="trainer.clip_low is not honoured by trainer.loss gspo"):
        TrainerConfig(loss="gspo", clip_low=0.1)
    with pytest.raises(ValueError, match="trainer.gspo_clip_high is not honoured by trainer.loss ppo"):
        TrainerConfig(gspo_clip_high=1e-3)
    with pytest.raises(ValueError, match="trainer.clip_high is not honoured"):
        Trainer(tiny_model(), loss="gspo", clip_high=0.3)
    path = tmp_path / "c.yaml"
    path.write_text("trainer:\n  loss: gspo\n  clip_high: 0.3\n")
    with pytest.raises(ConfigError, match="clip_high"):
        load_config(path)
