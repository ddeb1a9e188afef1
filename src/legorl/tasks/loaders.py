"""Task loaders (SWE-bench style JSONL)."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic

from legorl.tasks.schema import Task, TaskError


def load_jsonl(path: Path | str) -> list[Task]:
    """One Task per non-empty line; a bad row raises TaskError naming the line and field."""
    path = Path(path)
    tasks: list[Task] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise TaskError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            try:
                tasks.append(Task.model_validate(row))
            except pydantic.ValidationError as e:
                problems = "; ".join(
                    f"field {'.'.join(str(x) for x in err['loc']) or '<row>'}: {err['msg']}"
                    for err in e.errors()
                )
                name = row.get("instance_id", "?")
                raise TaskError(f"{path}:{lineno} (instance {name}): {problems}") from e
    return tasks
