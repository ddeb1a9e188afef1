"""`legorl tasks validate` on the built-in suite and on Harbor / terminal-bench dirs; `legorl grade` JSON."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_tasks import make_task_dirs
from test_tasks_validate import cli

from legorl.tasks import load_tasks

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def test_validate_builtin_and_harbor_dirs(tmp_path: Path) -> None:
    p = cli("tasks", "validate", "builtin:1", "--concurrency", "3")
    assert p.returncode == 0 and "1 passed every check" in p.stdout, p.stdout + p.stderr
    p = cli("tasks", "validate", str(make_task_dirs(tmp_path)), "--concurrency", "3",
            "--canary", "conftest_hook", "--canary", "hidden_test_lookup")  # fmt: skip
    assert p.returncode == 0 and "2 tasks, 2 passed every check" in p.stdout, p.stdout + p.stderr


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
