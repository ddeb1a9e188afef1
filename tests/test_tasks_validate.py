"""`legorl tasks validate` through the real CLI on a SWE-bench-format file built from a real package."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_tasks import make_swebench_jsonl

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
