"""Sampler/trainer mismatch metrics, reported every step (see docs/training.md for healthy ranges)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def mean(x: Tensor, default: float = 0.0) -> float:
    return float(x.double().mean()) if x.numel() else default


def pearson(a: Tensor, b: Tensor) -> float:
    """Pearson correlation; 1.0 for two identical constant vectors, 0.0 for other degenerate ones."""
    a, b = a.double(), b.double()
    da, db = a - a.mean(), b - b.mean()
    denom = math.sqrt(float((da * da).sum()) * float((db * db).sum()))
    if denom > 0:
        return float((da * db).sum()) / denom
    return 1.0 if float((a - b).abs().max()) < 1e-9 else 0.0


def effective_sample_size(w: Tensor) -> float:
    """Normalised ESS of importance weights: (sum w)^2 / (n * sum w^2), in (0, 1]; 1 = all equal."""
    if w.numel() == 0:
        return 1.0
    w = w.double()
    sq = float((w * w).sum())
    return float(w.sum() ** 2 / (w.numel() * sq)) if sq > 0 else 0.0


def mismatch_metrics(trainer_logp: Tensor, sampler_logp: Tensor, is_weight: Tensor) -> dict[str, float]:
    """Sampler vs trainer on loss tokens (healthy: Pearson >= 0.99, |dlogp| ~ 0.01-0.03 in bf16;
    docs/design.md, "Sampler/trainer mismatch and its bounds").

    k3 uses r = trainer - sampler on sampler samples: exp(r) - 1 - r estimates KL(sampler || trainer).
    ``is_weight``: the IS weights of the kept tokens (mean and ESS).
    """
    if trainer_logp.numel() == 0:
        return {
            "train/logprob_pearson": 1.0,
            "train/mismatch_k3_kl": 0.0,
            "train/mismatch_abs_dlogp_mean": 0.0,
            "train/mismatch_abs_dlogp_max": 0.0,
            "train/is_weight_mean": 1.0,
            "train/is_ess": 1.0,
            **weight_quantiles(is_weight),
        }
    t, s = trainer_logp.double(), sampler_logp.double()
    r = t - s
    k3 = torch.exp(r) - 1.0 - r
    return {
        "train/logprob_pearson": pearson(t.exp(), s.exp()),
        "train/mismatch_k3_kl": float(k3.mean()),
        "train/mismatch_abs_dlogp_mean": float(r.abs().mean()),
        "train/mismatch_abs_dlogp_max": float(r.abs().max()),
        "train/is_weight_mean": mean(is_weight, 1.0),
        "train/is_ess": effective_sample_size(is_weight),
        **weight_quantiles(is_weight),
    }


QUANTILES = {"p05": 0.05, "p50": 0.5, "p95": 0.95, "max": 1.0}  # the IS weight distribution the dashboard plots


def weight_quantiles(w: Tensor) -> dict[str, float]:
    """`train/is_weight_p05` ... `_max`: where the bulk of the IS weights lies, and the largest."""
    if w.numel() == 0:
        return {f"train/is_weight_{q}": 1.0 for q in QUANTILES}
    sample = w.double().flatten()
    if sample.numel() > 1 << 20:  # torch.quantile refuses inputs over 16M values; a sample of 1M is plenty
        sample = sample[torch.randperm(sample.numel(), generator=torch.Generator().manual_seed(0))[: 1 << 20]]
    qs = torch.quantile(sample, torch.tensor(list(QUANTILES.values()), dtype=torch.float64))
    return {f"train/is_weight_{q}": float(v) for q, v in zip(QUANTILES, qs, strict=True)}
