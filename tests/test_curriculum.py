"""Prioritised task sampling (rollout/curriculum.py): hopeless families are drawn rarely, never never."""

from __future__ import annotations

import random
from collections import Counter

from legorl.records import Rollout
from legorl.rollout.curriculum import pass_counts, prioritized_sample, signal_chance
from legorl.tasks import Task


def tasks(family: str, n: int) -> list[Task]:
    return [Task(instance_id=f"{family}-{i}", repo="builtin/x", family=family, problem_statement="p")
            for i in range(n)]


def test_pass_counts_by_family_skip_masked_rollouts() -> None:
    pool = {t.instance_id: t for t in tasks("a", 2) + tasks("b", 1)}

    def ro(task: str, reward: float | None) -> Rollout:
        return Rollout(id=task + str(reward), step=0, task_id=task, group_id=task, sample_index=0, harness="h",
                       reward=reward)

    got = pass_counts([ro("a-0", 1.0), ro("a-1", 0.0), ro("a-1", None), ro("b-0", 0.0), ro("gone", 1.0)], pool)
    assert got == {"a": (2, 1), "b": (1, 0)}
    # a step's finished rollouts add to the counts so far
    assert pass_counts([ro("b-0", 1.0)], pool, into=got) == {"a": (2, 1), "b": (2, 1)} != got


def test_signal_chance_follows_the_advantage_method() -> None:
    assert signal_chance(0, 0, 8, "reinforce") > 0.99  # unseen: as good as a half-solved family
    assert signal_chance(100, 0, 8, "reinforce") < 0.1  # never solved: rarely, but still drawn
    # all-resolved groups train under reinforce, not under GRPO
    assert signal_chance(100, 100, 8, "reinforce") > 0.99
    assert signal_chance(100, 100, 8, "grpo") < 0.1


def test_prioritized_sample_draws_hopeless_families_rarely_and_deterministically() -> None:
    pool = tasks("solved-half", 50) + tasks("never-solved", 50)
    counts = {"solved-half": (64, 32), "never-solved": (64, 0)}
    drawn: Counter[str] = Counter()
    for seed in range(200):
        picked = prioritized_sample(pool, 4, counts, 8, "reinforce", random.Random(seed))
        assert len({t.instance_id for t in picked}) == 4  # without replacement
        drawn.update(t.family for t in picked)
    assert drawn["never-solved"] < 0.2 * drawn["solved-half"]
    assert drawn["never-solved"] > 0  # never starved
    again = prioritized_sample(pool, 4, counts, 8, "reinforce", random.Random(7))
    assert again == prioritized_sample(pool, 4, counts, 8, "reinforce", random.Random(7))
    # without counts both families weigh the same
    even: Counter[str] = Counter(t.family for seed in range(200)
                                 for t in prioritized_sample(pool, 4, {}, 8, "reinforce", random.Random(seed)))
    assert 0.8 < even["never-solved"] / even["solved-half"] < 1.25
