"""The agent's changes, computed inside its sandbox once nothing of the agent's runs there.

Never run git on the host in a workspace the agent controlled: its .git/config or
hooks could run code on the host. Inside the sandbox, every process the agent's
commands left (a daemon outliving its harness) is ended first (``Sandbox.quiesce``):
none can then stop the diff's shell or append to its output through /proc. The worst
left is what the workspace's own git config can do to the diff command, which only
changes what the patch says, and the grader judges a patch by its effect.
"""

from __future__ import annotations

import shlex
from typing import Protocol

from legorl.sandbox.client import ExecResult, SandboxError

GIT = (
    "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c safe.directory='*' "
    "-c core.pager=cat -c diff.noprefix=false -c diff.mnemonicPrefix=false"
)
# Bytecode and caches are never part of a fix.
EXCLUDES = "':(exclude,glob)**/__pycache__/**' ':(exclude,glob)**/*.pyc' ':(exclude,glob)**/.pytest_cache/**'"


class ExecSandbox(Protocol):
    async def exec(
        self, command: str, timeout: float = 30, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ExecResult: ...

    async def quiesce(self, timeout: float = 30) -> list[str]: ...


async def workspace_diff(sandbox: ExecSandbox, base: str | None = None, timeout: float = 60) -> str:
    """Diff of the workspace (untracked files included) against ``base`` (default: the root commit).

    Pass the sha prepare_repo returned: the agent may have committed or moved HEAD. Every process the
    sandbox's commands left running is ended first: call it when the agent is done.
    """
    ref = shlex.quote(base) if base else "$(" + GIT + " rev-list --max-parents=0 HEAD | tail -n 1)"
    err = "/tmp/.legorl_diff_err"  # stderr kept apart: warnings must not end up inside the patch
    cmd = (
        f"{GIT} add -A --ignore-errors -- . {EXCLUDES} >/dev/null 2>&1; "
        f"{GIT} diff --cached --binary --no-color --no-ext-diff --no-textconv --full-index {ref} -- . {EXCLUDES}"
        f" 2>{err} || {{ cat {err}; exit 3; }}"
    )
    await sandbox.quiesce()  # raises SandboxError when some of the agent's processes survive
    ws = getattr(sandbox, "inside_workspace", "/workspace")
    result = await sandbox.exec(cmd, timeout=timeout, cwd=ws, env={"GIT_DIR": f"{ws}/.git", "GIT_WORK_TREE": ws})
    if result.returncode != 0 or result.timed_out:
        raise SandboxError(
            f"could not compute the workspace diff (exit {result.returncode}): {result.output[-500:]}"
        )
    return result.output
