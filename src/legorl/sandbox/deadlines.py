"""Nested deadlines: per command < agent < rollout (set-up and grading included) < sandbox lifetime.

A timeout of infinity once hung a nightly run for hours; a set-up hang outside the agent
timeout is a classic. Every stage of a rollout therefore gets a finite budget, and the
inner budgets are clamped to what the outer ones have left::

    d = Deadlines(command=60, agent=1800)
    clock = d.start()                       # at the start of the rollout (before set-up)
    ... prepare_repo, BwrapSandbox.create(limits=limits.with_(lifetime_s=d.sandbox_lifetime)) ...
    clock.start_agent()
    await asyncio.wait_for(harness.run(...), timeout=clock.agent_left())
    await sandbox.exec(cmd, timeout=clock.command_timeout(requested))
    report = await grade(task, diff, timeout=clock.grading_timeout(), ...)

``sandbox_lifetime`` is the backstop enforced by the sandbox watchdog: longer than the rollout,
so the rollout's own timeouts fire first and produce typed outcomes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field


class DeadlineExceeded(TimeoutError):
    """A stage has no time left."""


@dataclass(frozen=True)
class Deadlines:
    command: float = 60.0  # one command inside the sandbox
    agent: float = 1800.0  # the harness run
    setup: float = 120.0  # repo preparation + sandbox start
    grading: float = 300.0  # grading, in its own fresh sandbox
    slack: float = 30.0  # diff, teardown, bookkeeping between stages

    def __post_init__(self) -> None:
        for name in ("command", "agent", "setup", "grading", "slack"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"deadline {name} must be a finite number of seconds > 0, got {v!r}")
        if self.command >= self.agent:
            raise ValueError(f"deadline command ({self.command}s) must be shorter than agent ({self.agent}s)")

    @property
    def rollout(self) -> float:
        """Whole rollout: set-up + agent + diff + grading."""
        return self.setup + self.agent + self.slack + self.grading

    @property
    def sandbox_lifetime(self) -> float:
        """Hard stop of the agent's sandbox (the watchdog kills it): outlives the rollout's own timeouts."""
        return self.rollout + self.slack

    @property
    def grading_sandbox_lifetime(self) -> float:
        return self.grading + self.slack

    def start(self, now: float | None = None) -> RolloutClock:
        return RolloutClock(self, time.monotonic() if now is None else now)


@dataclass
class RolloutClock:
    deadlines: Deadlines
    t0: float
    agent_t0: float | None = None
    _now: object = field(default=time.monotonic, repr=False)

    def now(self) -> float:
        return self._now()  # type: ignore[operator]

    def elapsed(self) -> float:
        return self.now() - self.t0

    def rollout_left(self) -> float:
        return self.deadlines.rollout - self.elapsed()

    def setup_left(self) -> float:
        return self.deadlines.setup - self.elapsed()

    def start_agent(self) -> None:
        self.agent_t0 = self.now()

    def agent_left(self) -> float:
        """Agent budget left, never past what the rollout leaves for diff + grading."""
        started = self.agent_t0 if self.agent_t0 is not None else self.now()
        own = self.deadlines.agent - (self.now() - started)
        reserve = self.deadlines.slack + self.deadlines.grading
        return max(0.0, min(own, self.rollout_left() - reserve))

    def command_timeout(self, requested: float | None = None) -> float:
        """Timeout for one command: min(requested, per-command cap, agent time left)."""
        left = self.agent_left()
        if left <= 0:
            raise DeadlineExceeded("the agent's time is up: no command may start")
        want = self.deadlines.command if requested is None else min(requested, self.deadlines.command)
        return max(0.001, min(want, left))

    def grading_timeout(self) -> float:
        """Time for the test command: the grading budget, bounded by the rollout's remainder."""
        left = min(self.deadlines.grading, self.rollout_left() - self.deadlines.slack / 2)
        if left <= 0:
            raise DeadlineExceeded("no time left to grade this rollout")
        return left
