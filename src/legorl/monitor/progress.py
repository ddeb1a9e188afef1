"""Where a run is: its phase, how far the phase has got, and an estimate of the time left.

The driver writes ``RUN_DIR/progress.json`` as it goes (`RunProgress`, at most once a second and at every
phase change); the dashboard reads it (`read_progress`) and estimates the time left from the phase times
measured so far (`estimate`). A file, not the store: it is rewritten in place and read by another process.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

PROGRESS_FILE = "progress.json"
PHASES = ("demonstrations", "sft", "eval_before_rl", "rl", "eval_after_rl")
LABELS = {"demonstrations": "teacher demonstrations", "sft": "SFT warm start", "eval_before_rl": "evaluation before RL",
          "rl": "RL", "eval_after_rl": "evaluation after RL", "done": "finished"}


class RunProgress:
    """The driver's side: `enter` a phase, `expect` how many units of work it has, `tick` each one done."""

    def __init__(self, run_dir: Path, steps: int, planned: list[str], mode: str = "sync", min_interval: float = 1.0):
        self.path = Path(run_dir) / PROGRESS_FILE
        self.min_interval = min_interval
        self.state: dict[str, Any] = {"phase": None, "planned": planned, "steps": steps, "step": None,
                                      "mode": mode, "done": 0, "total": 0, "phase_started": None,
                                      "phase_times_s": {}, "updated": None}
        self._written = 0.0

    def enter(self, phase: str, phase_times: dict[str, float]) -> None:
        self.state.update(phase=phase, done=0, total=0, phase_started=time.time(),
                          phase_times_s=dict(phase_times))
        self.write(force=True)

    def expect(self, total: int) -> None:
        """The current phase's work (rollouts, updates): counted from 0 again."""
        self.state.update(done=0, total=total)
        self.write(force=True)

    def tick(self, n: int = 1) -> None:
        self.state["done"] += n
        self.write()

    def at_step(self, step: int) -> None:
        """RL step `step` starts (steps before it are done); the first one this process trains sets the rate's
        origin (a resumed run's step rate counts its own steps)."""
        self.state.setdefault("first_step", step)
        self.state["step"] = step
        self.write(force=True)

    def lag(self, metrics: dict[str, float], ahead: int) -> None:
        """Asynchronous RL: how many steps are sampled ahead of the trainer, and how stale the batch it just
        trained was (the step's `async/staleness_mean` / `_max` versions behind it; `async/dropped` beyond
        max_staleness)."""
        self.state["lag"] = {"ahead": ahead, "mean": metrics.get("async/staleness_mean", 0.0),
                             "max": int(metrics.get("async/staleness_max", 0)),
                             "dropped": int(metrics.get("async/dropped", 0))}
        self.write(force=True)

    def finish(self, phase_times: dict[str, float]) -> None:
        self.state.update(phase="done", phase_times_s=dict(phase_times), done=0, total=0)
        self.write(force=True)

    def write(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._written < self.min_interval:
            return
        self.state["updated"] = self._written = now
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)  # a reader never sees half a file


def read_progress(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / PROGRESS_FILE).read_text())
    except (OSError, ValueError):
        return None  # a run from before progress was recorded, or one not started


def estimate(p: dict[str, Any], steps_done: int | None = None, now: float | None = None) -> dict[str, Any]:
    """What the overview shows: the phase's label and share done, elapsed and an estimate of the time left.
    `steps_done`: RL steps finished (default: those before the step the file says is running).

    The time left adds the current phase's rest (its rate so far; for RL, the mean step time) and the
    later planned phases' measured or estimated durations: the evaluation after RL takes about as long as the
    one before it. None where nothing measured supports an estimate yet."""
    now = now if now is not None else time.time()
    phase = p.get("phase")
    times = dict(p.get("phase_times_s") or {})
    elapsed = now - p["phase_started"] if p.get("phase_started") else 0.0
    steps = int(p.get("steps") or 0)
    steps_done = steps_done if steps_done is not None else int(p.get("step") or 0)
    if phase == "rl":
        first_done = steps_done - (p.get("first_step") or 0)
        share = steps_done / steps if steps else None
        left = elapsed / max(first_done, 1) * (steps - steps_done) if steps_done and first_done > 0 else None
        label = f"RL step {min(steps_done + 1, steps)} of {steps}"
        if p.get("mode") == "async":
            lag = p.get("lag")
            label += (f" (asynchronous: {lag['ahead']} step(s) sampled ahead; the last batch trained was "
                      f"{lag['mean']:.2f} versions behind on average, at most {lag['max']}, {lag['dropped']} "
                      "rollouts dropped)" if lag else " (asynchronous: the next steps sample while it trains)")
    else:
        done, total = int(p.get("done") or 0), int(p.get("total") or 0)
        share = done / total if total else None
        left = elapsed / done * (total - done) if done and total else None
        label = LABELS.get(phase or "", phase or "starting")
        if total:
            label += f": {done} of {total}"
    planned = list(p.get("planned") or [])
    later = planned[planned.index(phase) + 1:] if phase in planned else []
    for name in later:
        guess = times.get(name) or (times.get("eval_before_rl") if name == "eval_after_rl" else None)
        left = None if left is None or guess is None else left + guess
    return {"phase": phase, "label": label, "share": share, "phase_elapsed_s": elapsed,
            "time_left_s": None if phase == "done" else left, "planned": planned, "phase_times_s": times,
            "updated": p.get("updated")}
