"""The workspace diff is taken from a quiet sandbox: a daemon the agent left cannot tamper with it.

The attack of issue #39: a daemon of the agent's uid waits for the diff's shell, stops it once git has
written the patch, appends a second file section to the shell's output (a memfd, open through
/proc/<pid>/fd/1) and resumes it. With the sandbox quiesced first, the daemon is gone before the diff.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from legorl.config import SandboxConfig
from legorl.grading import diff as diff_module
from legorl.grading import workspace_diff
from legorl.sandbox import create_sandbox
from legorl.tasks import generate_tasks, prepare_repo

TASK = generate_tasks(["wrong_operator"], 1, seed=21, split="train")[0]
SECTION = "--- /dev/null\n+++ b/conftest.py\n@@ -0,0 +1 @@\n+HACKED = True\n"
DAEMON = r'''
import os, signal, time
SECTION = %r


def stat(pid):  # (parent pid, state) of a process, None once it is gone
    try:
        fields = open(f"/proc/{pid}/stat", "rb").read().rsplit(b") ", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0]


def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def children(pid):
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


open("/tmp/daemon.ready", "w").close()
deadline, shell = time.time() + 60, None
while time.time() < deadline:  # find the diff's shell (it runs git add first), then watch its children
    if shell is None:
        shell = next((int(p) for p in os.listdir("/proc") if p.isdigit()
                      and b"diff --cached" in cmdline(p) and b"bash" in cmdline(p)), None)
        continue
    git = next((c for c in children(shell) if b"diff\0--cached" in cmdline(c)), None)
    if git is None:
        continue
    os.kill(shell, signal.SIGSTOP)  # the shell waits; git finishes writing the patch
    try:
        while (stat(git) or (0, b"Z"))[1] != b"Z":
            time.sleep(0.0005)
        with open(f"/proc/{shell}/fd/1", "a") as out:
            out.write(SECTION)
        open("/tmp/daemon.done", "w").close()
    finally:
        os.kill(shell, signal.SIGCONT)
    raise SystemExit(0)
''' % SECTION  # noqa: UP031 - the daemon's own f-strings stay as they are


async def _diff_with_a_daemon(tmp_path: Path, cfg: SandboxConfig) -> tuple[str, str, list[str]]:
    base = prepare_repo(TASK, tmp_path / "ws")
    module = next(p for p in TASK.files if p.startswith("pkg_") and not p.endswith("__init__.py"))
    box = await create_sandbox(cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb", label="quiet")
    try:
        await box.write_file("/tmp/daemon.py", DAEMON)
        # a large new file makes git take tens of ms to write the patch: the daemon's window, even on a loaded machine
        await box.exec(f"echo '# edited' >> {module}; seq 1 150000 > notes.txt;"
                       " (setsid nohup python3 /tmp/daemon.py >/dev/null 2>&1 &)")
        for _ in range(200):
            if (await box.exec("test -e /tmp/daemon.ready && echo y")).output.strip() == "y":
                break
            await asyncio.sleep(0.05)
        ended = await box.quiesce()
        diff = await workspace_diff(box, base)
        after = (await box.exec("ls /tmp; for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done"
                                " | grep '[d]aemon.py' || echo 'no daemon'")).output
    finally:
        await box.close()
    return diff, after, ended


def test_a_daemon_left_by_the_agent_cannot_append_to_the_diff(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    diff, after, ended = asyncio.run(_diff_with_a_daemon(tmp_path, box_cfg))
    assert "python3" in ended, ended  # the daemon was ended by the quiesce
    assert "conftest.py" not in diff and "# edited" in diff, diff
    assert "daemon.done" not in after and "no daemon" in after, after


def test_without_the_quiesce_the_daemon_does_tamper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attack is real: with the sandbox not quiesced, the same daemon appends its section to the diff."""

    async def no_quiesce(self, timeout: float = 30) -> list[str]:
        return []

    from legorl.sandbox.control import ControlledSandbox

    monkeypatch.setattr(ControlledSandbox, "quiesce", no_quiesce)
    assert diff_module.workspace_diff is workspace_diff
    diffs = []
    for attempt in range(5):  # a race against git: a loaded machine can let the daemon miss it
        diff, _, _ = asyncio.run(_diff_with_a_daemon(tmp_path / str(attempt), SandboxConfig()))
        if diff.endswith(SECTION):
            break
        diffs.append(diff)
    assert diff.endswith(SECTION), [d[-200:] for d in diffs]
