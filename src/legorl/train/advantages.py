"""Group-relative advantages (GRPO, Dr. GRPO, RLOO, plain REINFORCE) with masked rollouts.

A reward of None marks a masked rollout (infra failure, timeout, ...): it leaves
the group baseline and gets no advantage, so failures never poison a group.
"""

from __future__ import annotations

import math

METHODS = ("grpo", "drgrpo", "rloo", "rloo-positive", "reinforce")


def group_advantages(
    rewards: list[float | None],
    method: str = "grpo",
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> list[float | None]:
    """Advantages for one group of rollouts of the same task.

    - grpo: r - mean(valid); with normalize_std, divided by (std + eps) (population std).
    - drgrpo: grpo without std normalisation (normalize_std is ignored).
    - rloo: r - mean of the other valid rewards of the group.
    - rloo-positive: rloo with negative advantages set to 0. Only successes train, each weighted
      by the share of its group that failed: no push-down of what failures share with successes
      (as reinforce), and no updates on tasks every sample already solves.
    - reinforce: r, no baseline. With 0/1 rewards only resolved rollouts train: the update is SFT
      on the policy's own successes (expert iteration), and it never pushes down the tokens a
      failed rollout shares with successful ones.
    A group with fewer than 2 valid rewards has no baseline: valid ones get 0.0.
    """
    if method not in METHODS:
        raise ValueError(f"unknown advantage method {method!r}; choose one of {METHODS}")
    if method == "reinforce":
        return [None if r is None else float(r) for r in rewards]
    valid = [float(r) for r in rewards if r is not None]
    n = len(valid)
    if n < 2:
        return [None if r is None else 0.0 for r in rewards]
    mean = sum(valid) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in valid) / n)
    total = sum(valid)
    out: list[float | None] = []
    for r in rewards:
        if r is None:
            out.append(None)
            continue
        r = float(r)
        if method in ("rloo", "rloo-positive"):
            adv = r - (total - r) / (n - 1)
            if method == "rloo-positive":
                adv = max(adv, 0.0)
        else:
            adv = r - mean
        if normalize_std and method != "drgrpo":
            adv = adv / (std + eps)
        out.append(adv)
    return out


def carries_signal(rewards: list[float | None], method: str = "grpo") -> bool:
    """Whether a group would train anything: some rollout gets a non-zero advantage.

    For the baseline methods this means the rewards differ; for reinforce, that one is non-zero
    (an all-resolved group is SFT on eight successes, an all-failed one teaches nothing).
    """
    return any(a for a in group_advantages(rewards, method) if a is not None)
