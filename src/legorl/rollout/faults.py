"""Chaos mode: inject the faults seen at scale, so users (and our tests) see them handled.

Each rollout draws its faults once, deterministically from (faults.seed, rollout id);
engine faults are drawn per call. Every fault enters through the same boundary a
real one would: an engine that raises or answers with broken arrays, a sandbox
that dies or runs out of disk, a harness that hangs, crashes or never calls the
model, a grader that crashes, a slow sandbox start.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from legorl.config import FaultsConfig
from legorl.records import GenerationResult, SamplingParams

EPISODE_FAULTS = ("sandbox_killed", "harness_hang", "harness_crash", "no_model_calls", "grader_crash",
                  "disk_full", "slow_sandbox_start")


class InjectedFault(RuntimeError):
    """Raised where an injected fault takes effect; the message says which."""


@dataclass(frozen=True)
class FaultPlan:
    faults: frozenset[str] = frozenset()

    def __contains__(self, name: str) -> bool:
        return name in self.faults


def plan_for(cfg: FaultsConfig, rollout_id: str) -> FaultPlan:
    rng = random.Random(f"{cfg.seed}:{rollout_id}")
    return FaultPlan(frozenset(f for f in EPISODE_FAULTS if rng.random() < getattr(cfg, f)))


def enabled(cfg: FaultsConfig) -> bool:
    return any(getattr(cfg, f) > 0 for f in (*EPISODE_FAULTS, "engine_exception", "engine_malformed"))


class FaultyEngine:
    """Wraps an engine: some calls raise, some return ids and logprobs of different lengths."""

    def __init__(self, engine: Any, cfg: FaultsConfig):
        self.inner = engine
        self.cfg = cfg
        self._rng = random.Random(cfg.seed)
        self._hits: dict[str, set[str]] = {}  # rollout id -> engine faults its calls met

    def injected_for(self, rollout_id: str) -> set[str]:
        """The engine faults this rollout's calls met (once: forgotten after)."""
        return self._hits.pop(rollout_id, set())

    def __getattr__(self, name: str) -> Any:  # update_weights, close, set_script...
        return getattr(self.inner, name)

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @weight_version.setter
    def weight_version(self, value: int) -> None:  # resume restores it on the real engine, not the wrapper
        self.inner.weight_version = value

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       rollout_id: str = "") -> GenerationResult:
        roll = self._rng.random()
        if roll < self.cfg.engine_exception:
            self._hits.setdefault(rollout_id, set()).add("engine_exception")
            raise InjectedFault("injected fault: engine exception")
        result = await self.inner.generate(prompt_ids, params, rollout_id=rollout_id)
        if roll < self.cfg.engine_exception + self.cfg.engine_malformed:
            self._hits.setdefault(rollout_id, set()).add("engine_malformed")
            result.logprobs = result.logprobs[:-1]  # malformed: one logprob short
        return result


async def kill_later(sandbox: Any, rng: random.Random) -> None:
    """The sandbox dies at a random moment of the episode."""
    await asyncio.sleep(rng.uniform(0.2, 2.0))
    await sandbox.close()
