"""What trains: GroupRunner.train_groups' refills of groups without signal, and trainable()."""

from __future__ import annotations

import asyncio

from legorl.records import Outcome, Rollout
from legorl.rollout.scheduler import GroupRunner
from legorl.tasks import Task

# task id -> the reward every sample of its group gets
REWARDS = {"all-pass": 1.0, "all-fail": 0.0, "mixed": None, "spare-1": None, "spare-2": None}


async def fake_episode(task: Task, *, step: int, group_id: str, sample_index: int, split: str,
                       harness: str | None = None) -> Rollout:
    fixed = REWARDS[task.instance_id]
    reward = float(sample_index % 2) if fixed is None else fixed
    return Rollout(id=f"{group_id}:{sample_index}", step=step, task_id=task.instance_id, group_id=group_id,
                   sample_index=sample_index, harness="fake", split=split, reward=reward,
                   outcome=Outcome.RESOLVED if reward else Outcome.UNRESOLVED)


def run(advantage: str) -> tuple[list[str], dict[str, float]]:
    pool = [Task(instance_id=i, repo="builtin/x", problem_statement="p") for i in REWARDS]
    runner = GroupRunner(fake_episode, {}, concurrency=8)
    groups, stats = asyncio.run(runner.train_groups(pool, want=3, step=0, samples=4, refills=2,
                                                    advantage=advantage))
    return sorted(g[0].task_id for g in groups), stats.metrics()


def test_grpo_refills_every_group_with_equal_rewards() -> None:
    kept, m = run("grpo")
    assert kept == ["mixed", "spare-1", "spare-2"]
    assert m["groups/zero_variance"] == 2 and m["groups/refilled"] == 2 and m["groups/started"] == 5


def test_reinforce_keeps_an_all_resolved_group() -> None:
    # reinforce trains on every resolved rollout: only the all-failed group carries no signal
    kept, m = run("reinforce")
    assert kept == ["all-pass", "mixed", "spare-1"]
    assert m["groups/zero_variance"] == 1 and m["groups/refilled"] == 1 and m["groups/started"] == 4


def test_trainable_leaves_out_masked_rollouts_only() -> None:
    from legorl.pipeline import trainable

    def ro(group: str, i: int, reward: float | None) -> Rollout:
        return Rollout(id=f"{group}{i}", step=0, task_id=group, group_id=group, sample_index=i, harness="h",
                       reward=reward)

    batch = [ro("a", 0, 1.0), ro("a", 1, 0.0), ro("a", 2, None), ro("b", 0, 0.0), ro("b", 1, 0.0)]
    # reinforce: a failed rollout adds no gradient but counts in the mean (small steps on few successes)
    assert [(r.id, a) for r, a in trainable(batch, "reinforce")] == [("a0", 1.0), ("a1", 0.0), ("b0", 0.0),
                                                                     ("b1", 0.0)]
    assert [(r.id, a) for r, a in trainable(batch, "grpo")] == [("a0", 0.5), ("a1", -0.5), ("b0", 0.0), ("b1", 0.0)]
