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
from test_tasks import make_swebench_jsonl

from legorl.grading.validate import hidden_test_lookup
from legorl.tasks import generate_tasks

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
LEGORL = [sys.executable, "-m", "legorl.cli"]


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*LEGORL, *args], capture_output=True, text=True, input=stdin, timeout=600, env=env,
                          check=False)  # fmt: skip


def test_validate_swebench_file_from_a_real_package(tmp_path: Path) -> None:
    path, _ = make_swebench_jsonl(tmp_path)
    p = cli("tasks", "validate", str(path), "--concurrency", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 tasks, 1 passed every check" in p.stdout
    for column in ("gold", "empty", "conftest", "test-edit", "stdout", "syntax", "exit-code", "reward-file",
                   "runner-hook", "lookup"):  # fmt: skip
        assert column in p.stdout


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
