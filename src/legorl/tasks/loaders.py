"""Task loaders: SWE-bench style JSONL, Harbor / terminal-bench task dirs, the built-in suite."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pydantic

from legorl.tasks.schema import Task, TaskError

BUILTIN_DEFAULT_N = 8


def load_jsonl(path: Path | str, mirrors: list[Path] | None = None) -> list[Task]:
    """One Task per non-empty line; a bad row raises TaskError naming the line and field.

    A relative ``repo_path`` (or ``environment``) is resolved against the JSONL file's directory. A row without one
    (official SWE-bench / SWE-Gym rows name only ``repo``) gets its clone from a mirror directory
    (``mirrors``; default ``$LEGORL_REPO_MIRROR``, then ``repos/`` next to the file), found as
    ``OWNER__NAME``, ``OWNER/NAME`` or ``NAME`` (see ``legorl.tasks.swebench``).
    """
    from legorl.tasks.swebench import default_mirrors, mirror_path

    path = Path(path)
    mirror_dirs = default_mirrors(path) if mirrors is None else list(mirrors)
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
            if isinstance(row.get("environment"), str) and not Path(row["environment"]).is_absolute():
                row["environment"] = str((path.parent / row["environment"]).resolve())
            if isinstance(row.get("repo_path"), str) and not Path(row["repo_path"]).is_absolute():
                row["repo_path"] = str((path.parent / row["repo_path"]).resolve())
            elif row.get("repo_path") is None and not row.get("files") and isinstance(row.get("repo"), str):
                found = mirror_path(row["repo"], mirror_dirs)
                row["repo_path"] = str(found) if found is not None else None
            try:
                tasks.append(Task.model_validate(row))
            except pydantic.ValidationError as e:
                problems = "; ".join(
                    f"field {'.'.join(str(x) for x in err['loc']) or '<row>'}: {err['msg']}"
                    for err in e.errors()
                )
                name = row.get("instance_id", "?")
                raise TaskError(f"{path}:{lineno} (instance {name}): {problems}") from e
    ids = [t.instance_id for t in tasks]
    if dupes := sorted({i for i in ids if ids.count(i) > 1}):
        raise TaskError(f"{path}: duplicate instance ids {dupes[:5]}")
    return tasks


def load_tasks(spec: str | Path) -> list[Task]:
    """Tasks from ``builtin`` / ``builtin:N`` / ``builtin:N:SEED`` (the built-in suite), a ``.jsonl``
    file (SWE-bench rows with ``repo_path``), or a Harbor / terminal-bench task dir (or a dir of them)."""
    text = str(spec)
    if m := re.fullmatch(r"builtin(?::(\d+))?(?::(\d+))?", text):
        from legorl.tasks.builtin import generate_tasks

        n = int(m[1]) if m[1] else BUILTIN_DEFAULT_N
        if n <= 0:
            raise TaskError("builtin:N needs N > 0")
        return generate_tasks(None, n, seed=int(m[2] or 0), split="train")
    path = Path(spec)
    if not path.exists():
        raise TaskError(f"task source {text!r} not found (use builtin, builtin:N, a .jsonl file or a task dir)")
    if path.is_dir():
        from legorl.tasks.harbor import load_task_dirs

        return load_task_dirs(path)
    return load_jsonl(path)
