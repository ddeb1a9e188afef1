"""`legorl tasks validate` on the built-in suite and on Harbor / terminal-bench dirs; `legorl grade` JSON."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_tasks import make_task_dirs
from test_tasks_validate import cli

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@pytest.mark.slow
def test_validate_the_whole_builtin_suite() -> None:
    """The acceptance run: every built-in task (8 families) passes every check (minutes on 2 cores)."""
    p = cli("tasks", "validate", "builtin", "--concurrency", "3")
    assert p.returncode == 0 and "8 tasks, 8 passed every check" in p.stdout, p.stdout + p.stderr


def test_validate_builtin_and_harbor_dirs(tmp_path: Path) -> None:
    p = cli("tasks", "validate", "builtin:1", "--concurrency", "3")
    assert p.returncode == 0 and "1 passed every check" in p.stdout, p.stdout + p.stderr
    p = cli("tasks", "validate", str(make_task_dirs(tmp_path)), "--concurrency", "3",
            "--canary", "conftest_hook", "--canary", "hidden_test_lookup")  # fmt: skip
    assert p.returncode == 0 and "2 tasks, 2 passed every check" in p.stdout, p.stdout + p.stderr
