"""`legorl tasks validate` and `legorl grade` through the real CLI on the three task formats."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_tasks import make_swebench_jsonl, make_task_dirs

from legorl.grading.validate import hidden_test_lookup
from legorl.tasks import generate_tasks, load_tasks

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
LEGORL = [sys.executable, "-m", "legorl.cli"]


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LEGORL, *args], capture_output=True, text=True, input=stdin, timeout=600,
                          env={**os.environ, "COLUMNS": "200"})  # fmt: skip


def test_validate_swebench_file_from_a_real_package(tmp_path: Path) -> None:
    path, _ = make_swebench_jsonl(tmp_path)
    p = cli("tasks", "validate", str(path), "--concurrency", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 tasks, 1 passed every check" in p.stdout
    for column in ("gold", "empty", "conftest", "test-edit", "stdout", "syntax", "exit-code", "reward-file",
                   "runner-hook", "lookup"):  # fmt: skip
        assert column in p.stdout


def test_validate_builtin_and_harbor_dirs(tmp_path: Path) -> None:
    p = cli("tasks", "validate", "builtin:1", "--concurrency", "3")
    assert p.returncode == 0 and "1 passed every check" in p.stdout, p.stdout + p.stderr
    p = cli("tasks", "validate", str(make_task_dirs(tmp_path)), "--concurrency", "3",
            "--canary", "conftest_hook", "--canary", "hidden_test_lookup")  # fmt: skip
    assert p.returncode == 0 and "2 tasks, 2 passed every check" in p.stdout, p.stdout + p.stderr


def test_validate_fails_a_broken_task_and_a_leak(tmp_path: Path) -> None:
    task = generate_tasks(["wrong_operator"], 1, seed=11)[0]
    wrong_gold = task.model_copy(update={"patch": "", "instance_id": "broken-gold"})
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(wrong_gold.model_dump()) + "\n")
    p = cli("tasks", "validate", str(path), "--canary", "syntax_error")
    assert p.returncode == 1 and "FAIL" in p.stdout and "broken-gold gold" in p.stdout, p.stdout + p.stderr
    # The lookup canary does find hidden tests that a sandbox can see.
    leak = tmp_path / "leak"
    leak.mkdir()
    (leak / "copy.py").write_text(task.hidden_files["tests/test_hidden.py"])
    os.chmod(tmp_path, 0o755)
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    check = asyncio.run(hidden_test_lookup(task, work, [], visible_paths=(leak,)))
    assert not check.ok and "copy.py" in check.detail


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
