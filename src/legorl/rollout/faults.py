"""Chaos mode: inject the faults seen at scale, so users (and our tests) see them handled.

Each rollout draws its faults once, deterministically from (faults.seed, rollout id);
engine faults are drawn per call, by the wrapper around the engine serving the rollout. Every fault enters through the same boundary a
real one would: an engine that raises or answers with broken arrays, a sandbox
that dies or runs out of disk, a harness that hangs, crashes or never calls the
model, a grader that crashes, a slow sandbox start.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import torch

from legorl.config import FaultsConfig
from legorl.engine.base import Engine, Weights
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


class FaultyEngine:
    """Serves one rollout's sessions through `inner`: some calls raise, some return ids and logprobs of
    different lengths. The episode wraps the engine it chose, so it reads `hits` off its own wrapper."""

    def __init__(self, inner: Engine, cfg: FaultsConfig, rollout_id: str):
        self.inner = inner
        self.cfg = cfg
        self._rng = random.Random(f"{cfg.seed}:{rollout_id}:engine")  # drawn per call, reproducible per rollout
        self.hits: set[str] = set()  # the engine faults this rollout's calls met

    def _draw(self) -> float:
        roll = self._rng.random()
        if roll < self.cfg.engine_exception:
            self.hits.add("engine_exception")
            raise InjectedFault("injected fault: engine exception")
        return roll

    def _spoil(self, roll: float, result: GenerationResult) -> GenerationResult:
        if roll < self.cfg.engine_exception + self.cfg.engine_malformed:
            self.hits.add("engine_malformed")
            result.logprobs = result.logprobs[:-1]  # malformed: one logprob short
        return result

    # ---- the Engine protocol: the calls are faulted, the rest is the inner engine's ----

    @property
    def takes_messages(self) -> bool:
        return self.inner.takes_messages

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def max_context(self) -> int:
        return self.inner.max_context()

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       rollout_id: str = "") -> GenerationResult:
        roll = self._draw()
        return self._spoil(roll, await self.inner.generate(prompt_ids, params, rollout_id=rollout_id))

    async def generate_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            params: SamplingParams, *, rollout_id: str = "") -> GenerationResult:
        roll = self._draw()
        return self._spoil(roll, await self.inner.generate_chat(messages, tools, params, rollout_id=rollout_id))

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None, *,
                             in_flight: bool = False) -> int:
        return await self.inner.update_weights(state_dict, version, in_flight=in_flight)

    def weights(self) -> Weights:
        return self.inner.weights()

    def follow(self, weights: Weights) -> None:
        self.inner.follow(weights)

    async def close(self) -> None:
        """Closes nothing: the inner engine serves other rollouts and is its owner's to close."""


async def kill_later(sandbox: Any, rng: random.Random) -> None:
    """The sandbox dies at a random moment of the episode."""
    await asyncio.sleep(rng.uniform(0.2, 2.0))
    await sandbox.close()
