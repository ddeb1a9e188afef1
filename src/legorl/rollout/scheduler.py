"""Scheduling groups of rollouts: concurrency limits, bounded retries, over-sampling, refills.

- A rollout whose outcome's policy is `retry` (infrastructure failures by default) runs
  again, up to `max_retries` times with doubling backoff; the failed attempts stay in the
  store, masked.
- A training step starts `want + oversample` groups and proceeds as soon as `want` are
  complete; the stragglers are cancelled (they clean up and are recorded as cancelled),
  so one slow rollout never blocks a step.
- A complete group that carries no signal under the advantage method (every advantage zero:
  equal rewards for GRPO/RLOO, all failed for reinforce) is replaced by a new task's group, up
  to `refills` times per step, and counted as `zero_variance`.
- Where an episode runs is pluggable (`RunEpisode`): in this process (`run_episode` with the
  driver's context) or on a Ray rollout worker (rollout/cluster.py); the scheduling is the same.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from legorl.config import RolloutConfig
from legorl.records import Outcome, Rollout
from legorl.rollout.episode import EpisodeContext, run_episode
from legorl.rollout.outcomes import Policy
from legorl.tasks import Task
from legorl.train.advantages import carries_signal


class RunEpisode(Protocol):
    """Runs one rollout to its recorded end (`run_episode` without the context)."""

    def __call__(self, task: Task, *, step: int, group_id: str, sample_index: int,
                 split: str, harness: str | None = None) -> Awaitable[Rollout]: ...


@dataclass
class GroupStats:
    started: int = 0
    kept: int = 0
    zero_variance: int = 0
    refilled: int = 0
    cancelled: int = 0
    retries: int = 0
    errors: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {"groups/started": float(self.started), "groups/kept": float(self.kept),
                "groups/zero_variance": float(self.zero_variance), "groups/refilled": float(self.refilled),
                "groups/cancelled": float(self.cancelled), "rollouts/retries": float(self.retries)}


def zero_variance(group: list[Rollout], advantage: str = "grpo") -> bool:
    """No rollout of the group would train: every advantage is zero (or masked)."""
    return not carries_signal([r.reward for r in group], advantage)


class GroupRunner:
    """Runs groups of rollouts with the ``rollout`` section's ``concurrency``, ``max_retries`` and
    ``retry_backoff`` (``config``, default ``RolloutConfig()``; single keys overridable by keyword)."""

    def __init__(self, run: RunEpisode, policies: dict[Outcome, Policy], config: RolloutConfig | None = None, *,
                 cancel_wait: float = 60.0, **settings: Any):
        c = RolloutConfig.model_validate({**(config or RolloutConfig()).model_dump(), **settings})
        self.run = run
        self.cancel_wait = cancel_wait  # seconds a cancelled straggler gets to clean up and record itself
        self.policies = policies
        self.sem = asyncio.Semaphore(c.concurrency)
        self.max_retries = c.max_retries
        self.backoff = c.retry_backoff

    @classmethod
    def local(cls, ctx: EpisodeContext, config: RolloutConfig | None = None, **settings: Any) -> GroupRunner:
        """Episodes in this process, with the driver's context."""
        return cls(functools.partial(run_episode, ctx), ctx.policies, config, **settings)

    async def _one(self, task: Task, step: int, sample: int, split: str, stats: GroupStats,
                   harness: str | None = None) -> Rollout:
        attempt = 0
        group_id = f"{step}:{split}:{task.instance_id}" + (f":{harness}" if harness else "")
        while True:
            async with self.sem:
                r = await self.run(task, step=step, group_id=group_id, sample_index=sample, split=split,
                                   harness=harness)
            if self.policies.get(r.outcome) != "retry" or attempt >= self.max_retries:
                return r
            attempt += 1
            stats.retries += 1
            await asyncio.sleep(self.backoff * 2 ** (attempt - 1))

    async def group(self, task: Task, step: int, samples: int, split: str, stats: GroupStats,
                    on_rollout: Callable[[Rollout], None] | None = None, harness: str | None = None) -> list[Rollout]:
        """`samples` rollouts of one task, all through one harness (`None`: the run's first)."""
        async def one(i: int) -> Rollout:
            r = await self._one(task, step, i, split, stats, harness)
            if on_rollout is not None:
                on_rollout(r)
            return r

        # return_exceptions: one rollout's bug must never abort its group or the step
        results = await asyncio.gather(*(one(i) for i in range(samples)), return_exceptions=True)
        out = []
        for r in results:
            if isinstance(r, asyncio.CancelledError):
                raise r
            if isinstance(r, BaseException):
                stats.errors.append(f"{task.instance_id}: {type(r).__name__}: {r}")
            else:
                out.append(r)
        return out

    async def all_groups(self, tasks: list[Task], step: int, samples: int, split: str,
                         on_rollout: Callable[[Rollout], None] | None = None,
                         harnesses: list[str | None] | None = None) -> tuple[list[list[Rollout]], GroupStats]:
        """Every group to completion (evaluation, demonstrations); group i runs through harnesses[i]."""
        stats = GroupStats(started=len(tasks))
        chosen = harnesses or [None] * len(tasks)
        groups = await asyncio.gather(*(self.group(t, step, samples, split, stats, on_rollout, h)
                                        for t, h in zip(tasks, chosen, strict=True)))
        stats.kept = len(groups)
        return list(groups), stats

    async def train_groups(self, pool: list[Task], want: int, step: int, samples: int, *, oversample: int = 0,
                           refills: int = 0, advantage: str = "grpo",
                           on_rollout: Callable[[Rollout], None] | None = None,
                           harnesses: list[str] | None = None) -> tuple[list[list[Rollout]], GroupStats]:
        """`want` complete groups from the task pool, over-sampling and refilling as configured; with
        several `harnesses`, the groups take them in turn."""
        stats = GroupStats()
        queue = list(pool)
        running: dict[asyncio.Task, Task] = {}

        def start_next() -> bool:
            if not queue:
                return False
            task = queue.pop(0)
            harness = harnesses[stats.started % len(harnesses)] if harnesses else None
            running[asyncio.create_task(self.group(task, step, samples, "train", stats, on_rollout, harness))] = task
            stats.started += 1
            return True

        for _ in range(want + oversample):
            start_next()
        kept: list[list[Rollout]] = []
        try:
            while running and len(kept) < want:
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    running.pop(t)
                    group = t.result()
                    if len(kept) >= want:
                        continue
                    if zero_variance(group, advantage):
                        stats.zero_variance += 1
                        if stats.refilled < refills and start_next():
                            stats.refilled += 1
                            continue
                    kept.append(group)
        finally:
            for t in running:  # stragglers: cancelled, they clean up and record themselves
                t.cancel()
            stats.cancelled = len(running)
            if running:  # bounded: a clean-up that hangs must not wedge the step
                _, stuck = await asyncio.wait(running, timeout=self.cancel_wait)
                stats.errors += [f"{running[t].instance_id}: still cleaning up {self.cancel_wait:.0f} s after "
                                 "cancellation; left behind" for t in stuck]
        stats.kept = len(kept)
        return kept, stats
