"""`legorl tasks validate` through the real CLI on a SWE-bench-format file built from a real package, and on
built-in tasks, with each sandbox backend (tests/backends.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_tasks import make_swebench_jsonl

from legorl.config import SandboxConfig

LEGORL = [sys.executable, "-m", "legorl.cli"]


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*LEGORL, *args], capture_output=True, text=True, input=stdin, timeout=600, env=env,
                          check=False)  # fmt: skip


def backend_args(cfg: SandboxConfig) -> list[str]:
    return ["--sandbox", cfg.kind, *(["--docker-host", cfg.docker_host] if cfg.docker_host else [])]


def test_validate_swebench_file_from_a_real_package(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    path, _ = make_swebench_jsonl(tmp_path)
    p = cli("tasks", "validate", str(path), "--concurrency", "3", *backend_args(box_cfg))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 tasks, 1 passed every check" in p.stdout
    for column in ("gold", "empty", "conftest", "test-edit", "stdout", "syntax", "exit-code", "reward-file",
                   "runner-hook", "lookup"):  # fmt: skip
        assert column in p.stdout


def test_validate_builtin_tasks_on_containers(docker_box_cfg: SandboxConfig) -> None:
    """On the docker backend: every gold patch resolves, no empty patch and no canary does (all 10 checks)."""
    p = cli("tasks", "validate", "builtin:3", "--concurrency", "3", *backend_args(docker_box_cfg))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "(docker sandboxes)" in p.stdout and "3 tasks, 3 passed every check" in p.stdout, p.stdout


def test_validate_refuses_an_unknown_backend_or_an_unusable_engine() -> None:
    p = cli("tasks", "validate", "builtin:1", "--sandbox", "lxc")
    assert p.returncode == 2 and "--sandbox" in p.stderr and "'lxc'" in p.stderr, p.stderr
    p = cli("tasks", "validate", "builtin:1", "--sandbox", "docker", "--docker-host", "unix:///nonexistent/docker.sock")
    assert p.returncode == 2 and "--sandbox docker: " in p.stderr, p.stderr
    assert "unix:///nonexistent/docker.sock" in p.stderr or "CLI is not installed" in p.stderr, p.stderr
