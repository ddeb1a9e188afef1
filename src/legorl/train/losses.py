"""Policy-gradient loss: PPO-clip (asymmetric) with sampler/trainer importance-sampling corrections.

Three policies are kept apart (docs/design.md, "Sampler/trainer mismatch and its bounds"):
- rollout: the sampler's logprobs (engine numerics, maybe stale weights),
- old: the trainer's logprobs before this update (the PPO anchor, computed once, no grad),
- current: the trainer's logprobs with gradients.
ratio = exp(cur - old) is clipped to [1 - clip_low, 1 + clip_high]; the sampler/trainer mismatch
is corrected by a detached weight built from exp(old - rollout) (see :func:`is_correction`).
With one update per batch, old is cur.detach() (pass old_logp=None): the ratio is then exactly 1
in value and only its gradient is used.

Rejected tokens (IS masking) leave the numerator AND the denominator of the aggregation.

``loss="gspo"`` (Zheng et al. 2025, arXiv 2507.18071) replaces the token ratio with the sequence
ratio s = exp(mean_t (cur - old)) over a row's kept tokens, clipped at the sequence level (see
:func:`gspo_ratio`); everything else (IS weight, KL, entropy, aggregation) is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# token-mean: every kept token of the batch weighs the same.
# seq-mean-token-mean: mean per group (a rollout), then mean over groups.
# seq-mean-token-sum: sum per group, then mean over groups (Dr. GRPO-style length-unbiased).
# token-sum: plain sum (normalise by a constant outside).
LOSSES = ("ppo", "gspo")  # token-level ratio and clip; sequence-level (geometric-mean) ratio and clip
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token-sum")
# tis: token weight min(r, cap); mis: token weight r, tokens with r > cap rejected;
# seq-tis / seq-mis: the same with the sequence ratio prod(r) (over kept tokens); none: weight 1.
IS_MODES = ("tis", "mis", "seq-tis", "seq-mis", "none")
# Usual rejection bounds: geometric sequence masking and token masking
# (docs/design.md, "Sampler/trainer mismatch and its bounds").
GEO_SEQ_MASK = (0.99, 1.01)
TOKEN_MASK = (0.5, 2.0)
_MAX_LOG = 30.0  # exp() bound: a wild masked/padding token must not make inf (inf * 0 = nan)


@dataclass
class ISCorrection:
    weight: Tensor  # [B, T] detached multiplicative weight (1 where not applicable)
    keep: Tensor  # [B, T] bool: loss token that was not rejected
    truncated: Tensor  # [B, T] bool: the weight hit its cap (tis / seq-tis)
    log_ratio: Tensor  # [B, T] old - rollout on loss tokens, 0 elsewhere


def is_correction(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor | None = None,
    mode: str = "tis",
    cap: float | None = 2.0,
    token_mask: tuple[float, float] | None = None,
    seq_mask: tuple[float, float] | None = None,
) -> ISCorrection:
    """Importance weights old/rollout and rejections, per token of [B, T] (rows are sequences).

    - ``token_mask=(lo, hi)``: reject a token whose ratio r = exp(old - rollout) is outside.
    - ``seq_mask=(lo, hi)``: reject a whole row whose geometric-mean ratio exp(mean log r) is outside.
    - ``mode``: see IS_MODES; "mis" / "seq-mis" reject instead of truncating above ``cap``.
    """
    if mode not in IS_MODES:
        raise ValueError(f"unknown IS mode {mode!r}; choose one of {IS_MODES}")
    with torch.no_grad():
        m = torch.ones_like(old_logp, dtype=torch.bool) if mask is None else mask.bool()
        log_r = torch.where(m, old_logp.detach().float() - rollout_logp.detach().float(), 0.0)
        keep = m.clone()
        if token_mask is not None:
            lo, hi = token_mask
            r = torch.exp(log_r.clamp(-_MAX_LOG, _MAX_LOG))
            keep &= (r >= lo) & (r <= hi)
        if seq_mask is not None:
            lo, hi = seq_mask
            n = m.sum(-1).clamp(min=1)
            geo = torch.exp((log_r.sum(-1) / n).clamp(-_MAX_LOG, _MAX_LOG))
            keep &= ((geo >= lo) & (geo <= hi)).unsqueeze(-1)
        weight = torch.ones_like(log_r)
        truncated = torch.zeros_like(keep)
        if mode in ("tis", "mis"):
            w = torch.exp(log_r.clamp(max=_MAX_LOG))
            if cap is not None and mode == "tis":
                truncated = keep & (w > cap)
                w = w.clamp(max=cap)
            elif cap is not None:
                keep &= w <= cap
            weight = torch.where(keep, w, 1.0)
        elif mode in ("seq-tis", "seq-mis"):
            seq_log = torch.where(keep, log_r, 0.0).sum(-1)
            w = torch.exp(seq_log.clamp(max=_MAX_LOG))
            if cap is not None and mode == "seq-tis":
                truncated = keep & (w > cap).unsqueeze(-1)
                w = w.clamp(max=cap)
            elif cap is not None:
                keep &= (w <= cap).unsqueeze(-1)
            weight = torch.where(keep, w.unsqueeze(-1).expand_as(log_r), 1.0)
    return ISCorrection(weight=weight, keep=keep, truncated=truncated, log_ratio=log_r)


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(p || ref) from samples: exp(ref - p) - (ref - p) - 1 (>= 0)."""
    d = (ref_logp - logp).clamp(-_MAX_LOG, _MAX_LOG)
    return torch.exp(d) - d - 1.0


def gspo_ratio(cur_logp: Tensor, old_logp: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """GSPO-token's ratio s_t = sg[s] * p_t / sg[p_t] on [B, T], and s itself ([B], detached).

    s = (pi(y) / pi_old(y)) ** (1 / |y|) = exp(mean over ``mask`` of cur - old): one value per row
    (a sequence; ``mask`` its kept loss tokens). Every token carries the value s, so the clip decides
    per sequence; token t's gradient is s * grad log p_t, and averaged over the row's tokens that
    is exactly grad s. So with one advantage per sequence this is GSPO itself, per token.
    """
    m = mask.bool()
    n = m.sum(-1).clamp(min=1)
    # where(), not multiply: a masked position holding a wild value must not leak into the mean.
    log_s = torch.where(m, cur_logp.detach() - old_logp.detach(), 0.0).sum(-1) / n
    log_s = log_s.clamp(-20.0, 20.0)  # exp() bound, as for the token ratio
    own = torch.where(m, cur_logp - cur_logp.detach(), 0.0)  # 0 in value: carries token t's gradient
    return torch.exp(log_s.unsqueeze(-1) + own), torch.exp(log_s)


@dataclass
class PolicyTerms:
    token_loss: Tensor  # [B, T], not yet masked
    ratio: Tensor  # [B, T], detached (gspo: the sequence ratio on each of its tokens)
    is_weight: Tensor  # [B, T], detached
    clipped: Tensor  # [B, T] bool: the clipped branch was active (no gradient flows)
    truncated: Tensor  # [B, T] bool: the IS weight hit its cap
    keep: Tensor  # [B, T] bool: loss tokens left after IS rejection (the aggregation mask)
    kl_ref: Tensor | None = None  # [B, T] detached k3 to the reference, when given
    seq_ratio: Tensor | None = None  # [B] detached sequence ratio s (gspo)

    def seq_clip(self) -> tuple[Tensor, Tensor]:
        """gspo: (s, clipped) of the rows with kept tokens; a row's tokens share one clip decision."""
        assert self.seq_ratio is not None, "sequence-level terms exist under loss='gspo' only"
        rows = self.keep.any(-1)
        return self.seq_ratio[rows], (self.clipped & self.keep).any(-1)[rows]


def policy_terms(
    cur_logp: Tensor,
    old_logp: Tensor | None,
    rollout_logp: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = 2.0,
    *,
    mask: Tensor | None = None,
    is_mode: str = "tis",
    token_mask: tuple[float, float] | None = None,
    seq_mask: tuple[float, float] | None = None,
    correction: ISCorrection | None = None,
    ref_logp: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    loss: str = "ppo",
) -> PolicyTerms:
    """Per-token loss terms (no aggregation).

    token_loss = -w * min(ratio * A, clip(ratio) * A) + kl_coef * k3(cur, ref) - entropy_coef * H.
    ``correction`` (precomputed from old vs rollout) overrides the IS arguments. ``loss``: "ppo"
    (ratio per token) or "gspo" (the sequence ratio over the kept tokens, :func:`gspo_ratio`).
    """
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; choose one of {LOSSES}")
    old = cur_logp.detach() if old_logp is None else old_logp.detach()
    adv = advantages.to(cur_logp.dtype)
    if adv.dim() == cur_logp.dim() - 1:
        adv = adv.unsqueeze(-1)  # one advantage per sequence -> every token
    adv = adv.expand_as(cur_logp)
    if correction is None:
        correction = is_correction(old, rollout_logp, mask, is_mode, tis_cap, token_mask, seq_mask)
    seq_ratio = None
    if loss == "gspo":  # over the kept tokens: rejected ones leave the sequence's ratio too
        ratio, seq_ratio = gspo_ratio(cur_logp, old, correction.keep)
    else:
        # Bounded log-ratio: exp() of a wild (e.g. masked) token must not make inf, whose
        # backward through where()/masking would give 0 * inf = nan.
        ratio = torch.exp((cur_logp - old).clamp(-20.0, 20.0))
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    unclipped_obj = ratio * adv
    clipped_obj = clipped_ratio * adv
    obj = torch.minimum(unclipped_obj, clipped_obj)
    token_loss = -(correction.weight.to(obj.dtype) * obj)
    kl_ref = None
    if ref_logp is not None:
        kl = k3(cur_logp, ref_logp.detach())
        kl_ref = kl.detach()
        if kl_coef:
            token_loss = token_loss + kl_coef * kl
    if entropy is not None and entropy_coef:
        token_loss = token_loss - entropy_coef * entropy
    return PolicyTerms(
        token_loss=token_loss,
        ratio=ratio.detach(),
        is_weight=correction.weight,
        clipped=(clipped_obj < unclipped_obj).detach(),
        truncated=correction.truncated,
        keep=correction.keep,
        kl_ref=kl_ref,
        seq_ratio=seq_ratio,
    )


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def aggregate(
    token_loss: Tensor, mask: Tensor, agg: str = "token-mean", seq_ids: Tensor | None = None
) -> Tensor:
    """Reduce per-token losses; masked tokens leave numerator AND denominator.

    ``seq_ids`` ([B] or [B, T]) groups rows for the seq-mean-* modes, e.g. a rollout index so a
    rollout split into several sequences is one group (per-rollout normalisation); default: rows.
    Groups left without any token do not count in the mean over groups.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGGREGATIONS}")
    m = mask.to(token_loss.dtype)
    # where() rather than multiply: a masked token holding inf/nan must not leak in.
    masked = torch.where(mask.bool(), token_loss, torch.zeros_like(token_loss))
    if agg == "token-mean":
        return masked.sum() / m.sum().clamp(min=1.0)
    if agg == "token-sum":
        return masked.sum()
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
    if agg == "seq-mean-token-mean":
        return (sums[present] / counts[present]).mean()
    return sums[present].mean()  # seq-mean-token-sum


def sequence_weights(counts: list[int], groups: list[str], agg: str) -> list[float]:
    """Per-row token weight so that sum(weight[row] * kept token losses) == aggregate(...).

    ``counts``: kept loss tokens per row; ``groups``: the row's group (rollout id). Fixing these
    before the first micro-batch makes gradient accumulation give exactly the full-batch gradient.
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {agg!r}; choose one of {AGGREGATIONS}")
    if agg == "token-sum":
        return [1.0] * len(counts)
    if agg == "token-mean":
        total = sum(counts)
        return [1.0 / total if total else 0.0] * len(counts)
    per_group: dict[str, int] = {}
    for g, c in zip(groups, counts):
        per_group[g] = per_group.get(g, 0) + c
    n_groups = sum(1 for c in per_group.values() if c > 0)
    if agg == "seq-mean-token-mean":
        return [1.0 / (n_groups * per_group[g]) if per_group[g] else 0.0 for g in groups]
    return [1.0 / n_groups if per_group[g] else 0.0 for g in groups]  # seq-mean-token-sum


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
    **kwargs: object,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clip (or GSPO) loss with IS corrections, aggregated over kept tokens; (loss, metrics).

    ``kwargs`` go to :func:`policy_terms` (loss, is_mode, token_mask, seq_mask, ref_logp, kl_coef, ...).
    """
    terms = policy_terms(
        cur_logp, old_logp, rollout_logp, advantages, clip_low, clip_high, tis_cap, mask=mask, **kwargs
    )
    loss = aggregate(terms.token_loss, terms.keep, agg, seq_ids)
    b, k = mask.bool(), terms.keep
    with torch.no_grad():
        metrics = {
            "loss": float(loss.detach()),
            "clip_frac": float(masked_mean(terms.clipped.float(), k)),
            "ratio_mean": float(masked_mean(terms.ratio, k)),
            "ratio_max": float(terms.ratio[k].max()) if bool(k.any()) else 1.0,
            "is_weight_mean": float(masked_mean(terms.is_weight, k)),
            "is_truncated_frac": float(masked_mean(terms.truncated.float(), k)),
            "is_rejected_frac": float(masked_mean((b & ~k).float(), b)),
            "tokens": float(k.sum()),
        }
        if terms.kl_ref is not None:
            metrics["kl_ref"] = float(masked_mean(terms.kl_ref, k))
        if terms.seq_ratio is not None:
            s, clipped = terms.seq_clip()
            metrics.update(gspo_metrics(s, clipped))
    return loss, metrics


def gspo_metrics(seq_ratio: Tensor, seq_clipped: Tensor) -> dict[str, float]:
    """Sequence ratios' mean / min / max and the share of sequences clipped (each counts once)."""
    if seq_ratio.numel() == 0:
        return {"gspo_ratio_mean": 1.0, "gspo_ratio_min": 1.0, "gspo_ratio_max": 1.0, "gspo_clip_frac": 0.0}
    return {
        "gspo_ratio_mean": float(seq_ratio.mean()),
        "gspo_ratio_min": float(seq_ratio.min()),
        "gspo_ratio_max": float(seq_ratio.max()),
        "gspo_clip_frac": float(seq_clipped.float().mean()),
    }
