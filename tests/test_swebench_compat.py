"""SWE-bench compatibility: official rows load as published (JSON-string list fields, extra fields
kept, the repository from a mirror), rows round-trip with the official field names, and a run's
evaluation becomes a predictions file in the official format."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from legorl.records import Outcome, Rollout
from legorl.store import Store
from legorl.tasks.loaders import load_jsonl
from legorl.tasks.repo import GIT_OPTS, git_env, prepare_repo
from legorl.tasks.schema import TaskError
from legorl.tasks.swebench import (
    OFFICIAL_FIELDS,
    PREDICTION_FIELDS,
    official_row,
    predictions_from_rollouts,
    read_predictions,
    write_predictions,
)

F2P = ["astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]"]
P2P = [
    "astropy/modeling/tests/test_separable.py::test_coord_matrix",
    "astropy/modeling/tests/test_separable.py::test_cdot",
]


TEST_PATCH = """diff --git a/astropy/modeling/tests/test_separable.py b/astropy/modeling/tests/test_separable.py
new file mode 100644
--- /dev/null
+++ b/astropy/modeling/tests/test_separable.py
@@ -0,0 +1,2 @@
+def test_cdot():
+    assert True
"""


def official(base_commit: str, **extra: object) -> dict:
    """A row as SWE-bench (and SWE-Gym) publish it: every field a string, list fields JSON-encoded."""
    return {
        "repo": "astropy/astropy",
        "instance_id": "astropy__astropy-12907",
        "base_commit": base_commit,
        "patch": "diff --git a/astropy/modeling/separable.py b/astropy/modeling/separable.py\n",
        "test_patch": TEST_PATCH,
        "problem_statement": "Modeling's `separability_matrix` does not compute separability correctly for nested "
        "CompoundModels\n",
        "hints_text": "",
        "created_at": "2022-03-03T15:14:54Z",
        "version": "4.3",
        "FAIL_TO_PASS": json.dumps(F2P),
        "PASS_TO_PASS": json.dumps(P2P),
        "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
        **extra,
    }


def make_clone(path: Path) -> str:
    """A stand-in for a local clone of the repository: a git dir with one commit."""
    (path / "astropy").mkdir(parents=True)
    (path / "astropy" / "__init__.py").write_text("__version__ = '4.3'\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(
            ["git", *GIT_OPTS, *args], cwd=path, env=git_env(path), check=True, capture_output=True
        )
    return subprocess.run(["git", *GIT_OPTS, "rev-parse", "HEAD"], cwd=path, env=git_env(path), check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip


def test_official_rows_load_as_published_with_a_mirror(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror = tmp_path / "mirror"
    sha = make_clone(mirror / "astropy__astropy")
    path = tmp_path / "data" / "swe-bench.jsonl"
    path.parent.mkdir()
    gym = {**official(sha), "instance_id": "astropy__astropy-13033", "difficulty": "15 min - 1 hour"}
    path.write_text(json.dumps(official(sha)) + "\n" + json.dumps(gym) + "\n")

    monkeypatch.delenv("LEGORL_REPO_MIRROR", raising=False)
    no_mirror = load_jsonl(path)
    assert [t.repo_path for t in no_mirror] == [None, None]  # loads; nothing is fetched

    tasks = load_jsonl(path, mirrors=[mirror])
    task = tasks[0]
    assert task.FAIL_TO_PASS == F2P and task.PASS_TO_PASS == P2P
    assert task.repo_path == str((mirror / "astropy__astropy").resolve())
    extras = task.model_extra or {}
    assert extras["version"] == "4.3" and extras["created_at"] == "2022-03-03T15:14:54Z"
    assert extras["hints_text"] == "" and extras["environment_setup_commit"].startswith("298ccb4")
    assert (tasks[1].model_extra or {})["difficulty"] == "15 min - 1 hour"
    prepare_repo(task, tmp_path / "ws")  # the agent's repo comes from the mirror's clone
    assert (tmp_path / "ws" / "astropy" / "__init__.py").read_text() == "__version__ = '4.3'\n"

    # The mirror from the environment, and the default `repos/` next to the file (OWNER/NAME spelling).
    monkeypatch.setenv("LEGORL_REPO_MIRROR", str(mirror))
    assert load_jsonl(path)[0].repo_path == task.repo_path
    monkeypatch.delenv("LEGORL_REPO_MIRROR")
    make_clone(path.parent / "repos" / "astropy" / "astropy")
    assert load_jsonl(path)[0].repo_path == str((path.parent / "repos" / "astropy" / "astropy").resolve())
    # An explicit repo_path always wins over a mirror.
    path.write_text(json.dumps({**official(sha), "repo_path": "elsewhere"}) + "\n")
    assert load_jsonl(path, mirrors=[mirror])[0].repo_path == str((path.parent / "elsewhere").resolve())


def test_rows_round_trip_with_the_official_field_names(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(
        json.dumps({**official("abc123"), "repo_path": "src", "test_command": "python -m pytest -x"}) + "\n"
    )
    (task,) = load_jsonl(path)
    row = official_row(task)
    assert list(row)[: len(OFFICIAL_FIELDS)] == list(OFFICIAL_FIELDS)
    assert row["FAIL_TO_PASS"] == json.dumps(F2P) and row["PASS_TO_PASS"] == json.dumps(
        P2P
    )  # strings, as published
    assert {k: row[k] for k in OFFICIAL_FIELDS} == official("abc123")
    assert (
        row["repo_path"] == str((tmp_path / "src").resolve()) and row["test_command"] == "python -m pytest -x"
    )
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps(row) + "\n")
    (again,) = load_jsonl(out)
    assert again.model_dump() == task.model_dump()


def _rollout(
    task: str, step: int, split: str, sample: int, diff: str, harness: str = "mini-swe-agent"
) -> Rollout:
    return Rollout(id=f"{task}-{step}-{split}-{sample}-{harness}", step=step, task_id=task, group_id=f"g-{task}",
                   sample_index=sample, harness=harness, outcome=Outcome.UNRESOLVED, reward=0.0, diff=diff,
                   split=split)  # fmt: skip


ROLLOUTS = [
    _rollout("t1", -1, "eval-heldout", 0, "before t1"),
    _rollout("t1", 24, "eval-heldout", 1, "after t1 sample 1"),
    _rollout("t1", 24, "eval-heldout", 0, "after t1 sample 0"),
    _rollout("t2", 24, "eval-heldout", 0, ""),  # an empty patch is still a prediction
    _rollout("t3", 24, "train", 0, "training rollout, not an evaluation"),
    _rollout("t4", -1, "eval-heldout", 0, "evaluated before training only"),
]


def test_predictions_pick_the_first_sample_of_the_latest_evaluation(tmp_path: Path) -> None:
    rows = predictions_from_rollouts(ROLLOUTS, "legorl/demo")
    assert rows == [
        {"instance_id": "t1", "model_name_or_path": "legorl/demo", "model_patch": "after t1 sample 0"},
        {"instance_id": "t2", "model_name_or_path": "legorl/demo", "model_patch": ""},
    ]
    assert predictions_from_rollouts(ROLLOUTS, "m", step=-1)[0]["model_patch"] == "before t1"
    assert predictions_from_rollouts(ROLLOUTS, "m", split="train") == []
    path = tmp_path / "preds.jsonl"
    assert write_predictions(path, rows) == 2
    lines = path.read_text().splitlines()
    assert [list(json.loads(ln)) for ln in lines] == [list(PREDICTION_FIELDS)] * 2
    assert read_predictions(path) == rows
    path.write_text(json.dumps(rows))  # the harness's other accepted form: one JSON list
    assert read_predictions(path) == rows
    path.write_text(json.dumps({"instance_id": "t1", "model_patch": "x"}) + "\n")
    with pytest.raises(TaskError, match="model_name_or_path"):
        read_predictions(path)


def test_tasks_predictions_command_reads_a_run(tmp_path: Path) -> None:
    from legorl.cli import app

    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    store = Store(run / "store.sqlite")
    for r in ROLLOUTS:
        store.upsert_rollout(r)
    store.close()
    out = tmp_path / "preds.jsonl"
    r = CliRunner().invoke(app, ["tasks", "predictions", str(run), str(out)])
    assert r.exit_code == 0, r.output
    assert read_predictions(out) == predictions_from_rollouts(ROLLOUTS, "legorl/demo")
    r = CliRunner().invoke(
        app, ["tasks", "predictions", str(run), str(out), "--model", "me/m", "--split", "train"]
    )
    assert r.exit_code == 1 and "no evaluation rollouts" in r.output
    r = CliRunner().invoke(app, ["tasks", "predictions", str(tmp_path), str(out)])
    assert r.exit_code == 2 and "no store.sqlite" in r.output
