"""Task environments: a package's dependencies, built once on the host, shown read-only to its sandboxes.

An environment is a directory of installed Python distributions (``pip install --target``). A task
names it in ``environment`` (a path; relative to the tasks file in a JSONL row); every sandbox made
for the task, the agent's and the grader's, on either backend, mounts it read-only at
``/opt/legorl-env`` and puts that on ``PYTHONPATH`` (``legorl.sandbox.factory``). Nothing inside can
change it, and tasks of one package share one build.

``build_environment(requirements, dest)`` builds one, or finds it already built for the same
requirements (a ``.legorl-env.json`` stamp). A build that fails or outlasts its timeout raises
``TaskEnvironmentError`` with the reason, and leaves nothing half-built at ``dest``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from legorl.tasks.schema import TaskError

STAMP = ".legorl-env.json"


class TaskEnvironmentError(TaskError):
    """A task environment could not be built, or is missing or broken."""


def environment_key(requirements: Sequence[str], python: str) -> str:
    """What a build depends on: the requirements and the interpreter's version."""
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True,
                             timeout=60, check=False).stdout.strip()  # fmt: skip
    return hashlib.sha256(json.dumps([sorted(requirements), version]).encode()).hexdigest()[:16]


def built(dest: Path, key: str | None = None) -> bool:
    """True when ``dest`` holds a finished build (of ``key``, when given)."""
    try:
        stamp = json.loads((Path(dest) / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return key is None or stamp.get("key") == key


def build_environment(
    requirements: Sequence[str],
    dest: Path,
    *,
    python: str | None = None,
    timeout: float = 900.0,
    pip_args: Sequence[str] = (),
) -> Path:
    """Install ``requirements`` (pip requirement strings or local paths) into ``dest`` once; returns ``dest``.

    Built with ``python -m pip install --target`` into a temporary sibling, then renamed into place,
    so a failed, killed or timed-out build never leaves a partial environment that looks usable.
    """
    python = python or sys.executable
    dest = Path(dest).resolve()
    key = environment_key(requirements, python)
    if built(dest, key):
        return dest
    tmp = dest.with_name(f".{dest.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    argv = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
            "--no-warn-script-location", "--target", str(tmp), *pip_args, *requirements]  # fmt: skip
    t0 = time.monotonic()
    try:
        if requirements:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise TaskEnvironmentError(
                    f"building the environment {dest.name} took longer than {timeout:.0f}s: {' '.join(requirements)}"
                ) from None
            if proc.returncode != 0:
                tail = out.decode(errors="replace").strip()[-1500:]
                raise TaskEnvironmentError(f"building the environment {dest.name} failed (pip exit "
                                           f"{proc.returncode}): {tail}")  # fmt: skip
        (tmp / STAMP).write_text(json.dumps({"key": key, "requirements": list(requirements),
                                             "seconds": round(time.monotonic() - t0, 1)}))  # fmt: skip
        for dirpath, dirnames, filenames in os.walk(tmp):  # readable by every sandbox uid
            os.chmod(dirpath, 0o755)
            for name in filenames:
                p = os.path.join(dirpath, name)
                if not os.path.islink(p):
                    os.chmod(p, os.stat(p).st_mode & 0o755 | 0o444)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
