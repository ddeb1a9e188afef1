"""Rollout throughput and engine idle share, with and without over-sampling, in one run.

Stragglers are what over-sampling is for, so both runs inject the same hangs
(`faults.harness_hang`): without over-sampling a step waits for the hung rollout's
deadline; with it, the step proceeds once enough groups are complete.

    .venv/bin/python bench/rollouts.py [--steps 3] [--hang 0.15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from legorl.config import load_config
from legorl.pipeline import Driver

ROOT = Path(__file__).resolve().parents[1]


async def one(oversample: int, steps: int, hang: float) -> dict[str, float]:
    cfg = load_config(ROOT / "configs/smoke.yaml", [
        f"run.steps={steps}", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.concurrency=6",
        "rollout.agent_timeout=20", f"rollout.oversample_groups={oversample}", f"faults.harness_hang={hang}",
        "monitor.dashboard=false", "run.checkpoint_every=0",
    ])
    run_dir = Path(tempfile.mkdtemp(prefix=f"legorl-bench-os{oversample}-"))
    async with Driver(cfg, run_dir) as driver:
        t0 = time.time()
        results = await driver.train()
        wall = time.time() - t0
    kept = sum(r.metrics.get("rollouts/count", 0) for r in results)
    busy = [r.metrics.get("engine/busy_share", 0.0) for r in results]
    return {"oversample_groups": oversample, "steps": steps, "wall_s": wall,
            "trained_rollouts_per_min": 60 * kept / wall,
            "engine_idle_share": 1 - sum(busy) / len(busy) if busy else 1.0,
            "step_s_mean": wall / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--hang", type=float, default=0.15)
    args = ap.parse_args()
    rows = [asyncio.run(one(os, args.steps, args.hang)) for os in (0, 1)]
    print(f"{'oversample':>10} {'step s':>8} {'rollouts/min':>13} {'engine idle':>12}")
    for r in rows:
        print(f"{r['oversample_groups']:>10} {r['step_s_mean']:>8.1f} {r['trained_rollouts_per_min']:>13.1f} "
              f"{r['engine_idle_share']:>12.1%}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
