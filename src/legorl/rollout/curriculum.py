"""Prioritised task sampling: families the policy never solves stop eating the step's rollouts.

A group trains only if it carries signal (some advantage non-zero, rollout/scheduler.py). On a
small model some task families are out of reach for long stretches; their groups all fail and
are refilled, so each costs a group's worth of engine time for nothing. With
`rollout.prioritize`, each step samples its tasks (without replacement) with a weight per
family: the chance that a group of that family carries signal, from the family's pass rate over
this run's train rollouts so far with a uniform prior, (resolved + 1) / (graded + 2). No family is
ever starved: an unseen one weighs as much as a half-solved one, and a hopeless one keeps a
small weight that grows back as soon as it is solved once.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from legorl.records import Rollout
from legorl.tasks import Task


def family(task: Task) -> str:
    """Builtin and Harbor tasks name a family; a SWE-bench row's repo stands in for one."""
    return task.family or task.repo


def pass_counts(rollouts: Iterable[Rollout], tasks: dict[str, Task],
                into: dict[str, tuple[int, int]] | None = None) -> dict[str, tuple[int, int]]:
    """family -> (graded, resolved) over rollouts with a reward (masked ones tell nothing), added to `into`."""
    counts = dict(into or {})
    for r in rollouts:
        task = tasks.get(r.task_id)
        if r.reward is None or task is None:
            continue
        graded, resolved = counts.get(family(task), (0, 0))
        counts[family(task)] = (graded + 1, resolved + int(r.reward > 0))
    return counts


def signal_chance(graded: int, resolved: int, group_size: int, advantage: str) -> float:
    """Chance that a group of `group_size` carries signal, at the smoothed pass rate."""
    p = (resolved + 1) / (graded + 2)
    no_success = (1 - p) ** group_size
    if advantage == "reinforce":  # any success trains
        return 1 - no_success
    return 1 - no_success - p**group_size  # baselines need mixed rewards


def prioritized_sample(pool: list[Task], k: int, counts: dict[str, tuple[int, int]], group_size: int,
                       advantage: str, rng: random.Random) -> list[Task]:
    """k tasks without replacement, each drawn with its family's signal chance as weight.

    Efraimidis-Spirakis: the k largest keys u ** (1 / weight); deterministic for a seeded rng.
    """
    weight = {f: signal_chance(*counts.get(f, (0, 0)), group_size, advantage) for f in {family(t) for t in pool}}
    keys = [(rng.random() ** (1 / weight[family(t)]), i) for i, t in enumerate(pool)]
    return [pool[i] for _, i in sorted(keys, reverse=True)[:k]]
