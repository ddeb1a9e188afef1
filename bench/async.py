"""Asynchronous vs synchronous RL, cluster-shaped: the engine and the trainer as separate resources with set costs.

The real training loop (`Driver.train`: scheduling, staleness filter, store, metrics) runs with three parts
replaced by ones of known cost, so the figures show what the loop itself does with them:
- an episode lasts `--fast` seconds, or `--slow` for a long-horizon task (a share `--slow-share` of the tasks),
  in `--calls` model calls; each call is stamped with the engine's weight version at its start and at its
  end (a call an update reached mid-way gets both: per-token versions);
- a trainer step lasts `--train` seconds (a GPU trainer: the wait costs no CPU here);
- a weight update lasts `--sync` seconds.
Synchronous steps should take about rollout + train; asynchronous ones about max(rollout, train).

    .venv/bin/python bench/async.py [--steps 6] [--train 4] [--fast 3] [--slow 9] [--slow-share 0 0.25 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from legorl.config import load_config
from legorl.engine.base import Weights
from legorl.pipeline import Driver
from legorl.records import LLMCall, Outcome, Rollout
from legorl.rollout.scheduler import GroupRunner
from legorl.tasks import Task

ROOT = Path(__file__).resolve().parents[1]


class TimedEngine:
    """Stands for the engine in the driver: weight versions and an update of set duration."""

    takes_messages = False

    def __init__(self, sync_s: float):
        self.sync_s = sync_s
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    async def update_weights(self, state_dict: Any, version: int | None = None, *, in_flight: bool = False) -> int:
        await asyncio.sleep(self.sync_s)
        self._version = version if version is not None else self._version + 1
        return self._version

    def stats(self) -> dict[str, Any]:
        return {}

    def weights(self) -> Weights:
        return Weights(self._version)

    async def close(self) -> None:
        pass


def timed_episode(engine: TimedEngine, fast: float, slow: float, slow_share: float, n_calls: int):
    """A RunEpisode of set duration: slow for a seeded share of the tasks, reward from a seeded coin."""

    async def run(task: Task, *, step: int, group_id: str, sample_index: int, split: str,
                  harness: str | None = None) -> Rollout:
        rng = random.Random(f"{task.instance_id}:{step}:{sample_index}")
        long = random.Random(task.instance_id).random() < slow_share
        rid = f"{group_id}:{sample_index}"
        calls = []
        for i in range(n_calls):
            start = engine.weight_version
            await asyncio.sleep((slow if long else fast) / n_calls)
            end = engine.weight_version
            calls.append(LLMCall(rollout_id=rid, index=i, wire_format="openai_chat", request={}, prompt_ids=[1],
                                 completion_ids=[2, 3], completion_logprobs=[-0.5, -0.5], finish_reason="stop",
                                 weight_version=start, completion_text="", token_versions=None if start == end
                                 else [start, end]))
        reward = float(rng.random() < 0.5)
        return Rollout(id=rid, step=step, task_id=task.instance_id, group_id=group_id, sample_index=sample_index,
                       harness="timed", split=split, reward=reward, calls=calls,
                       outcome=Outcome.RESOLVED if reward else Outcome.UNRESOLVED)

    return run


async def one(mode: str, staleness: int, slow_share: float, a: argparse.Namespace) -> dict[str, Any]:
    cfg = load_config(ROOT / "configs/smoke.yaml", [
        f"run.steps={a.steps}", f"rollout.tasks_per_step={a.groups}", "rollout.group_size=2",
        f"rollout.concurrency={a.concurrency}", f"rollout.mode={mode}", f"rollout.max_staleness={staleness}",
        "tasks.n_train=64", "monitor.dashboard=false", "run.checkpoint_every=0", "sft.enabled=false",
    ])
    run_dir = Path(tempfile.mkdtemp(prefix=f"legorl-bench-async-{mode}-"))
    async with Driver(cfg, run_dir) as driver:
        await driver.engine.close()  # the real engine is not used: a timed one stands for it
        driver.engine = engine = TimedEngine(a.sync)
        driver.runner = GroupRunner(timed_episode(engine, a.fast, a.slow, slow_share, a.calls),
                                    driver.runner.policies, cfg.rollout)

        def train_step(seqs: list[Any]) -> dict[str, float]:
            time.sleep(a.train)
            return {"train/loss": 0.0}

        driver.trainer.train_step = train_step
        driver.trainer.state_dict_for_engine = dict
        t0 = time.time()
        results = await driver.train()
        wall = time.time() - t0
    trained = sum(r.metrics.get("rollouts/trained", 0) - r.metrics.get("async/dropped", 0) for r in results)
    hist: dict[str, float] = {}
    for r in results:
        for k, v in r.metrics.items():
            if k.startswith("async/staleness/"):
                hist[k.rsplit("/", 1)[1]] = hist.get(k.rsplit("/", 1)[1], 0) + v
    return {"mode": mode, "max_staleness": staleness if mode == "async" else None, "slow_share": slow_share,
            "steps": a.steps, "wall_s": round(wall, 2), "step_s": round(wall / a.steps, 2),
            "trained_rollouts_per_min": round(60 * trained / wall, 1),
            "trainer_wait_s_mean": round(sum(r.metrics["time/wait_s"] for r in results) / len(results), 2),
            "staleness": hist, "dropped": sum(r.metrics.get("async/dropped", 0) for r in results),
            "calls_across_update": sum(r.metrics.get("async/calls_across_update", 0) for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--groups", type=int, default=4, help="rollout.tasks_per_step (groups of 2)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--train", type=float, default=4.0, help="seconds a trainer step takes")
    ap.add_argument("--sync", type=float, default=0.2, help="seconds a weight update takes")
    ap.add_argument("--fast", type=float, default=3.0, help="seconds a short episode takes")
    ap.add_argument("--slow", type=float, default=9.0, help="seconds a long-horizon episode takes")
    ap.add_argument("--calls", type=int, default=4, help="model calls an episode makes")
    ap.add_argument("--slow-share", type=float, nargs="+", default=[0.0, 0.25, 0.5])
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    a = ap.parse_args()
    rows = []
    for share in a.slow_share:
        rows.append(asyncio.run(one("sync", 0, share, a)))
        rows += [asyncio.run(one("async", k, share, a)) for k in a.staleness]
    print(f"{'slow share':>10} {'mode':>6} {'stale':>5} {'step s':>7} {'rollouts/min':>12} {'x sync':>6} "
          f"{'trainer wait s':>14} {'staleness hist':>22} {'across update':>13}")
    base: dict[float, float] = {}
    for r in rows:
        if r["mode"] == "sync":
            base[r["slow_share"]] = r["trained_rollouts_per_min"]
        speed = r["trained_rollouts_per_min"] / base[r["slow_share"]]
        hist = " ".join(f"{k}:{int(v)}" for k, v in sorted(r["staleness"].items()))
        print(f"{r['slow_share']:>10} {r['mode']:>6} {r['max_staleness'] or '-':>5} {r['step_s']:>7} "
              f"{r['trained_rollouts_per_min']:>12} {speed:>6.2f} {r['trainer_wait_s_mean']:>14} {hist:>22} "
              f"{int(r['calls_across_update']):>13}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
