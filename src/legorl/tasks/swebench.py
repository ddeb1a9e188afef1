"""SWE-bench compatibility: rows as published, repository mirrors, and predictions files.

* Rows: ``load_jsonl`` reads official SWE-bench / SWE-Gym rows as published (``FAIL_TO_PASS`` and
  ``PASS_TO_PASS`` as JSON-encoded strings; ``version``, ``created_at``, ``hints_text``,
  ``environment_setup_commit`` and any other field kept as extras). Official rows name the
  repository (``"repo": "astropy/astropy"``) but carry no local path: ``mirror_path`` finds a
  clone in a mirror directory instead (``OWNER__NAME``, ``OWNER/NAME`` or ``NAME``).
  ``official_row`` writes a Task back with the official field names and encodings.
* Predictions: what the official harness reads (``swebench.harness.run_evaluation
  --predictions_path``), one JSON object per line with ``instance_id``, ``model_name_or_path``
  and ``model_patch``. ``predictions_from_rollouts`` picks one rollout per task from a run's
  latest evaluation.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from legorl.tasks.schema import Task, TaskError

PREDICTION_FIELDS = ("instance_id", "model_name_or_path", "model_patch")
# The fields of a SWE-bench instance, in the published order (SWE-Gym adds none of its own).
OFFICIAL_FIELDS = (
    "repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
    "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit",
)  # fmt: skip
MIRROR_ENV = "LEGORL_REPO_MIRROR"


def mirror_path(repo: str, mirrors: Iterable[Path | str]) -> Path | None:
    """A local clone of ``repo`` ("owner/name") in one of ``mirrors``: ``OWNER__NAME`` (SWE-bench's
    instance-id spelling), ``OWNER/NAME`` or ``NAME``, a git directory or a ``.tar.gz`` of it."""
    if not repo or ".." in repo.split("/"):
        return None
    owner, _, name = repo.partition("/")
    names = [f"{owner}__{name}", f"{owner}/{name}", name] if name else [owner]
    for d in mirrors:
        for n in names:
            for cand in (Path(d) / n, Path(d) / f"{n}.tar.gz", Path(d) / f"{n}.tgz"):
                if cand.is_dir() or cand.is_file():
                    return cand.resolve()
    return None


def default_mirrors(jsonl: Path | None = None) -> list[Path]:
    """``$LEGORL_REPO_MIRROR`` (``:``-separated), then ``repos/`` next to the JSONL file."""
    out = [Path(p) for p in os.environ.get(MIRROR_ENV, "").split(os.pathsep) if p]
    if jsonl is not None:
        out.append(Path(jsonl).parent / "repos")
    return out


def official_row(task: Task) -> dict[str, Any]:
    """The task as a SWE-bench row: official field names first, list fields JSON-encoded as
    published; legorl's own fields (``repo_path``, ``test_command``, ...) and extras after them."""
    data = task.model_dump(exclude_defaults=True)
    row: dict[str, Any] = {}
    for f in OFFICIAL_FIELDS:
        v = data.pop(f, getattr(task, f, ""))
        row[f] = json.dumps(list(v)) if f in ("FAIL_TO_PASS", "PASS_TO_PASS") else ("" if v is None else v)
    row.update(data)
    return row


def prediction(instance_id: str, model_name_or_path: str, model_patch: str) -> dict[str, str]:
    return {
        "instance_id": instance_id,
        "model_name_or_path": model_name_or_path,
        "model_patch": model_patch or "",
    }


def write_predictions(path: Path | str, rows: Iterable[dict[str, Any]]) -> int:
    """Write a predictions JSONL file (one object per line, the official three fields)."""
    n = 0
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            missing = [k for k in PREDICTION_FIELDS if not isinstance(r.get(k), str)]
            if missing:
                raise TaskError(f"prediction {r.get('instance_id', '?')}: missing or non-string {missing}")
            f.write(json.dumps({k: r[k] for k in PREDICTION_FIELDS}) + "\n")
            n += 1
    return n


def read_predictions(path: Path | str) -> list[dict[str, str]]:
    """Read a predictions file (JSONL, or the harness's other accepted form: one JSON list)."""
    text = Path(path).read_text(encoding="utf-8")
    rows: list[Any]
    if text.lstrip().startswith("["):
        rows = json.loads(text)
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise TaskError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
    for r in rows:
        if not isinstance(r, dict) or any(not isinstance(r.get(k), str) for k in PREDICTION_FIELDS):
            raise TaskError(
                f"{path}: every prediction needs string fields {list(PREDICTION_FIELDS)}, got {r!r:.200}"
            )
    return rows


def latest_eval_step(rollouts: Iterable[Any]) -> int | None:
    steps = [r.step for r in rollouts if str(r.split).startswith("eval-")]
    return max(steps) if steps else None


def predictions_from_rollouts(
    rollouts: Iterable[Any], model_name_or_path: str, *, split: str | None = None, step: int | None = None
) -> list[dict[str, str]]:
    """One prediction per task from the latest evaluation (or ``step``): the rollout with the lowest
    sample index (the first harness on ties), as pass@1 counts it. ``split`` picks ``heldout`` or
    ``train`` evaluations (default: every evaluation split of that step). Rollouts are any objects
    with ``task_id``, ``step``, ``split``, ``sample_index``, ``harness`` and ``diff``."""
    evals = [
        r
        for r in rollouts
        if str(r.split).startswith("eval-") and (split is None or r.split == f"eval-{split}")
    ]
    if step is None:
        step = latest_eval_step(evals)
    if step is None:
        return []
    best: dict[str, Any] = {}
    for r in sorted(
        (r for r in evals if r.step == step), key=lambda r: (r.task_id, r.sample_index, r.harness, r.split)
    ):
        best.setdefault(r.task_id, r)
    return [prediction(tid, model_name_or_path, best[tid].diff or "") for tid in sorted(best)]
