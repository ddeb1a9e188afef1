"""`legorl grade` through the real CLI, and `legorl tasks validate` failing where it must."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from test_tasks_validate import cli

from legorl.grading.validate import hidden_test_lookup
from legorl.tasks import generate_tasks, load_tasks

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def test_grade_cli_json(tmp_path: Path) -> None:
    task = load_tasks("builtin:1")[0]
    patch = tmp_path / "gold.diff"
    patch.write_text(task.patch)
    p = cli("grade", "--tasks", "builtin:1", "--instance", task.instance_id, "--patch", str(patch), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["resolved"] is True and out["outcome"] == "resolved" and out["dropped_paths"] == []
    assert set(out["tests"].values()) == {"passed"}
    hack = "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n@@ -0,0 +1 @@\n+x = 1\n"
    p = cli("grade", "--tasks", "builtin:1", "--instance", task.instance_id, "--patch", "-", "--json", stdin=hack)
    out = json.loads(p.stdout)
    assert p.returncode == 1 and out["resolved"] is False and out["dropped_paths"] == ["conftest.py"]
    p = cli("grade", "--tasks", "builtin:1", "--instance", "nope", "--patch", str(patch))
    assert p.returncode == 2 and "no task 'nope'" in p.stderr


def test_validate_fails_a_broken_task_and_a_leak(tmp_path: Path) -> None:
    task = generate_tasks(["wrong_operator"], 1, seed=11)[0]
    wrong_gold = task.model_copy(update={"patch": "", "instance_id": "broken-gold"})
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(wrong_gold.model_dump()) + "\n")
    p = cli("tasks", "validate", str(path), "--canary", "syntax_error")
    assert p.returncode == 1 and "FAIL" in p.stdout and "broken-gold gold" in p.stdout, p.stdout + p.stderr
    # --drop-failing: the failing row moves out with its reason, a valid one and an unchecked one stay as they were.
    good, unchecked = (json.dumps(t.model_dump()) + "\n" for t in generate_tasks(["wrong_operator"], 2, seed=12))
    path.write_text(good + json.dumps(wrong_gold.model_dump()) + "\n" + unchecked)
    ids = [json.loads(line)["instance_id"] for line in (good, unchecked)]
    p = cli("tasks", "validate", str(path), "--canary", "syntax_error", "--drop-failing",
            "--instance", ids[0], "--instance", "broken-gold")
    assert p.returncode == 0 and "dropped 1 rows" in p.stdout, p.stdout + p.stderr
    assert path.read_text() == good + unchecked
    (row,) = [json.loads(line) for line in Path(f"{path}.dropped.jsonl").read_text().splitlines()]
    assert row["instance_id"] == "broken-gold" and row["dropped_because"].startswith("bwrap: gold")
    p = cli("tasks", "validate", "builtin:1", "--drop-failing")
    assert p.returncode == 2 and "--drop-failing rewrites a .jsonl task file" in p.stderr
    # The lookup canary does find hidden tests that a sandbox can see.
    leak = tmp_path / "leak"
    leak.mkdir()
    (leak / "copy.py").write_text(task.hidden_files["tests/test_hidden.py"])
    os.chmod(tmp_path, 0o755)
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    check = asyncio.run(hidden_test_lookup(task, work, [], visible_paths=(leak,)))
    assert not check.ok and "copy.py" in check.detail
