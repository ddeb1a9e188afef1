"""The task grid: one row per task, one column per train step (or evaluation), each cell what its rollouts did."""

from __future__ import annotations

import re
from typing import Any

from legorl.monitor.db import RunDB

MAX_COLUMNS = 120  # the most recent steps (or evaluations) shown; older ones by `step_max`


def family_of(task_id: str) -> str:
    """A built-in task's family (`builtin-wrong_return-3b1a418b43` -> wrong_return); else the id up to its last
    `-` or `__` part (SWE-bench style `owner__repo-123` -> owner__repo)."""
    m = re.fullmatch(r"builtin-(.+)-[0-9a-f]+", task_id)
    if m:
        return m.group(1)
    return re.split(r"-\d+$", task_id)[0] if re.search(r"-\d+$", task_id) else task_id.rsplit("-", 1)[0]


def task_grid(db: RunDB, split: str = "train", step_max: int | None = None) -> dict[str, Any]:
    """Rows by family, then harness, then task; columns the split's steps (the last MAX_COLUMNS up to
    `step_max`); a cell: resolved / failed / masked counts and one of its rollouts (for its trajectory)."""
    params: list[Any] = [split]
    where = "split = ? AND outcome IS NOT NULL"
    if step_max is not None:
        where += " AND step <= ?"
        params.append(step_max)
    all_steps = [int(r[0]) for r in db.query(f"SELECT DISTINCT step FROM rollouts WHERE {where} ORDER BY step",
                                             params)]
    steps = all_steps[-MAX_COLUMNS:]
    if not steps:
        return {"split": split, "steps": [], "rows": [], "older_steps": 0}
    rows = db.query(
        f"SELECT task_id, harness, step, SUM(outcome = 'resolved'), SUM(reward IS NOT NULL AND outcome != 'resolved'), "
        f"SUM(reward IS NULL), MIN(id) FROM rollouts WHERE {where} AND step >= ? "
        "GROUP BY task_id, harness, step", [*params, steps[0]])
    col = {s: i for i, s in enumerate(steps)}
    by_task: dict[tuple[str, str], list[Any]] = {}
    for task, harness, step, solved, failed, masked, rid in rows:
        cells = by_task.setdefault((task, harness or ""), [None] * len(steps))
        cells[col[int(step)]] = [int(solved or 0), int(failed or 0), int(masked or 0), rid]
    out = [{"task": task, "harness": harness, "family": family_of(task), "cells": cells,
            "solved": sum(c[0] for c in cells if c), "sampled": sum(c[0] + c[1] + c[2] for c in cells if c)}
           for (task, harness), cells in by_task.items()]
    out.sort(key=lambda r: (r["family"], r["harness"], r["task"]))
    return {"split": split, "steps": steps, "rows": out, "older_steps": len(all_steps) - len(steps)}
