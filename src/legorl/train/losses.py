"""Policy-gradient loss: PPO-clip (asymmetric) with token-level truncated IS.

Three policies are kept apart (LESSONS.md, "Sampler/trainer mismatch"):
- rollout: the sampler's logprobs (engine numerics, maybe stale weights),
- old: the trainer's logprobs before this update (the PPO anchor),
- current: the trainer's logprobs with gradients.
ratio = exp(cur - old) is clipped to [1 - clip_low, 1 + clip_high]; the sampler/trainer
mismatch is corrected by a detached weight w = min(exp(old - rollout), tis_cap).
With one update per batch, old is cur.detach() (pass old_logp=None): the ratio is then
exactly 1 in value and only its gradient is used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "token-sum")


@dataclass
class PolicyTerms:
    token_loss: Tensor  # [B, T], not yet masked
    ratio: Tensor  # [B, T], detached
    is_weight: Tensor  # [B, T], detached
    clipped: Tensor  # [B, T] bool: the clipped branch was active (no gradient flows)
    truncated: Tensor  # [B, T] bool: the IS weight hit its cap


def policy_terms(
    cur_logp: Tensor,
    old_logp: Tensor | None,
    rollout_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = 2.0,
) -> PolicyTerms:
    """Per-token PPO-clip loss terms (no masking, no aggregation)."""
    old = cur_logp.detach() if old_logp is None else old_logp.detach()
    adv = advantages.to(cur_logp.dtype)
    if adv.dim() == cur_logp.dim() - 1:
        adv = adv.unsqueeze(-1)  # one advantage per sequence -> every token
    adv = adv.expand_as(cur_logp)
    # Bounded log-ratio: exp() of a wild (e.g. masked) token must not make inf, whose
    # backward through where()/masking would give 0 * inf = nan.
    ratio = torch.exp((cur_logp - old).clamp(-20.0, 20.0))
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped_obj = ratio * adv
    clipped_obj = clipped_ratio * adv
    obj = torch.minimum(unclipped_obj, clipped_obj)
    with torch.no_grad():
        log_w = old - rollout_logp.detach().to(old.dtype)
        # Clamp the exponent so a wild masked/padding token cannot overflow to inf (inf * 0 = nan).
        w = torch.exp(log_w.clamp(max=30.0))
        truncated = torch.zeros_like(w, dtype=torch.bool)
        if tis_cap is not None:
            truncated = w > tis_cap
            w = w.clamp(max=tis_cap)
        clipped = clipped_obj < unclipped_obj
    return PolicyTerms(
        token_loss=-(w * obj),
        ratio=ratio.detach(),
        is_weight=w,
        clipped=clipped,
        truncated=truncated,
    )


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def aggregate(
    token_loss: Tensor, mask: Tensor, agg: str = "token-mean", seq_ids: Tensor | None = None
) -> Tensor:
    """Reduce per-token losses; masked tokens leave numerator AND denominator.

    - token-mean: mean over all unmasked tokens of the batch.
    - seq-mean-token-mean: mean per group of ``seq_ids`` ([B] or [B, T], e.g. a rollout index,
      so a rollout split into several sequences is one group), then mean over groups.
    - token-sum: plain sum (normalise by a constant outside, Dr. GRPO style).
    """
    m = mask.to(token_loss.dtype)
    # where() rather than multiply: a masked token holding inf/nan must not leak in.
    masked = torch.where(mask.bool(), token_loss, torch.zeros_like(token_loss))
    if agg == "token-mean":
        return masked.sum() / m.sum().clamp(min=1.0)
    if agg == "token-sum":
        return masked.sum()
    if agg == "seq-mean-token-mean":
        ids = torch.arange(token_loss.shape[0], device=token_loss.device) if seq_ids is None else seq_ids
        if ids.dim() == 1:
            ids = ids.unsqueeze(-1).expand_as(token_loss)
        _, inv = torch.unique(ids, return_inverse=True)
        n_groups = int(inv.max().item()) + 1
        sums = torch.zeros(n_groups, dtype=token_loss.dtype, device=token_loss.device)
        counts = torch.zeros_like(sums)
        sums = sums.index_add(0, inv.flatten(), masked.flatten())
        counts = counts.index_add(0, inv.flatten(), m.flatten())
        present = counts > 0
        if not bool(present.any()):
            return masked.sum()  # zero, but keeps the graph
        return (sums[present] / counts[present]).mean()
    raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGGREGATIONS}")


def policy_loss(
    cur_logp: Tensor,
    old_logp: Tensor | None,
    rollout_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = 2.0,
    agg: str = "token-mean",
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip loss with truncated IS, aggregated over unmasked tokens; returns (loss, metrics)."""
    terms = policy_terms(cur_logp, old_logp, rollout_logp, advantages, clip_low, clip_high, tis_cap)
    loss = aggregate(terms.token_loss, mask, agg, seq_ids)
    b = mask.bool()
    with torch.no_grad():
        metrics = {
            "loss": float(loss.detach()),
            "clip_frac": float(masked_mean(terms.clipped.float(), b)),
            "ratio_mean": float(masked_mean(terms.ratio, b)),
            "ratio_max": float(terms.ratio[b].max()) if bool(b.any()) else 1.0,
            "is_weight_mean": float(masked_mean(terms.is_weight, b)),
            "is_truncated_frac": float(masked_mean(terms.truncated.float(), b)),
            "tokens": float(b.sum()),
        }
    return loss, metrics
