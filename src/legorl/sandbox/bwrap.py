"""Bubblewrap sandbox: one per rollout (and one per grading).

Layout inside the sandbox:

* ``/`` is a fresh tmpfs, remounted read-only, holding read-only binds of the standard
  system dirs and the runtimes only (see ``rootfs.py``): not the host's /home, /root,
  /work, /var, /tmp, /run or /sys;
* ``/workspace`` (or the task's ``inside_workspace``) is the task repo (host ``workspace``, read-write);
* ``/run/legorl`` is host ``<sandbox_dir>/ctl`` (read-write): the agent's control socket
  ``control.sock`` lives there, and the proxy's Unix socket is bind-mounted at
  ``/run/legorl/proxy.sock`` when given;
* ``/tmp`` and ``/dev/shm`` are private size-limited tmpfs mounts; every ``hide_paths``
  entry inside a visible dir is covered by an empty read-only dir (or /dev/null);
* no network (own net namespace with only loopback), own pid/ipc/uts/user/cgroup
  namespaces, no capabilities, ``--die-with-parent``, and resource limits (``limits.py``);
* the agent's stdin is a pipe whose write end only the driver holds (``--lifeline``): the
  sandbox ends with the driver even when a SIGKILL lands before bwrap armed ``--die-with-parent``.

When the driver runs as root, everything inside runs as an unprivileged uid of its own
(random per sandbox in [SANDBOX_UID_BASE, +SANDBOX_UID_SPAN), or ``LEGORL_SANDBOX_UID``):
RLIMIT_NPROC does not apply to uid 0, a uid per sandbox makes that limit per sandbox, and
host file permissions become a second line of defence. bwrap then runs privileged without a
user namespace (a root-mapped one could not switch uid) keeping only CAP_SETUID/CAP_SETGID,
and the in-sandbox agent drops to the uid after binding its sockets, which clears every
capability; bwrap's no_new_privs and nosuid mounts keep it that way. The workspace is
chowned to the uid. A non-root driver runs bwrap unprivileged in a user namespace, where
RLIMIT_NPROC is counted per namespace (Linux >= 5.14).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from legorl.sandbox.client import SandboxError
from legorl.sandbox.control import RELAY_PORT, ControlledSandbox, open_to, sandbox_dirs
from legorl.sandbox.cpushare import CpuShare, remove_empty
from legorl.sandbox.limits import MiB, SandboxLimits
from legorl.sandbox.procs import alive, cmdline, kill_tree, process_tree
from legorl.sandbox.rootfs import hidden_inside, passwd_lines, visible_paths
from legorl.sandbox.spawn import Spawned, spawn

__all__ = ["BwrapSandbox", "bwrap_argv", "kill_tree", "process_tree", "reap_orphans", "sandbox_ids"]

AGENT_SCRIPT = Path(__file__).with_name("sandbox_agent.py")
RESOLV_CONF = Path(__file__).with_name("resolv.conf")  # bound over /etc/resolv.conf: lookups fail fast
INSIDE_WORKSPACE = "/workspace"
INSIDE_CTL = "/run/legorl"
INSIDE_AGENT = "/run/legorl-agent/sandbox_agent.py"
PROXY_SOCKET_INSIDE = f"{INSIDE_CTL}/proxy.sock"
SANDBOX_UID_BASE = 200_000
SANDBOX_UID_SPAN = 1 << 20
NAMESPACES = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]


def host_python() -> str:
    """The real interpreter behind the venv's python: runs the agent with only the stdlib."""
    return os.path.realpath(sys.executable)


def sandbox_ids(uid: int | None = None) -> tuple[int, int] | None:
    """(uid, gid) the sandbox's processes run as, or None to keep the current user (always None
    unless root). ``uid=None``: ``LEGORL_SANDBOX_UID`` if set, else a random uid for this sandbox."""
    if os.geteuid() != 0:
        return None
    if uid is None:
        fixed = os.environ.get("LEGORL_SANDBOX_UID")
        uid = int(fixed) if fixed else SANDBOX_UID_BASE + secrets.randbelow(SANDBOX_UID_SPAN)
    return (uid, uid) if uid != 0 else None


# What every sandbox (bwrap or docker) sets, whatever its PATH.
SANDBOX_ENV = {
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "TMPDIR": "/tmp",
    # Same pytest as the grader runs (no plugin autoload: also seconds faster per run).
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    # Agents commit; git refuses without an identity (HOME is an empty /tmp).
    "GIT_AUTHOR_NAME": "agent",
    "GIT_AUTHOR_EMAIL": "agent@sandbox",
    "GIT_COMMITTER_NAME": "agent",
    "GIT_COMMITTER_EMAIL": "agent@sandbox",
}


def sandbox_path_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # First, so `python` has pytest & co.; resolved, as the sandbox mounts it (a venv reached
    # through a symlinked checkout path would otherwise be on PATH under a name that does not exist there).
    venv_bin = os.path.realpath(Path(sys.executable).parent)
    path = f"{venv_bin}:/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin"
    return {"PATH": path, **SANDBOX_ENV, **(extra or {})}


_DISCARDING: set[asyncio.Task] = set()


async def _discard(proc: Spawned, start_timeout: float) -> None:
    """Kill a sandbox whose creator was cancelled, once it has started: killing bwrap mid-fork can
    orphan its inner process before that one has asked to die with its parent."""
    try:
        assert proc.stdout is not None
        await asyncio.wait_for(proc.stdout.readline(), start_timeout)
    except Exception:  # noqa: BLE001, S110 - any end of the start will do; the kill follows
        pass
    finally:
        kill_tree(proc.pid)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(proc.wait(), 10)
    proc.close_pipes()


def _discard_later(proc: Spawned, start_timeout: float) -> None:
    task = asyncio.get_running_loop().create_task(_discard(proc, start_timeout))
    _DISCARDING.add(task)  # held: the cancelled creator no longer references it
    task.add_done_callback(_DISCARDING.discard)


def discarding() -> set[asyncio.Task]:
    """The discards of cancelled creations still running: a loop that ends should let them finish."""
    return set(_DISCARDING)


def bwrap_argv(
    *,
    workspace: Path,
    ctl_dir: Path,
    label: str,
    proxy_socket: Path | None,
    relay_port: int,
    hide_paths: Sequence[Path] = (),
    env: dict[str, str] | None = None,
    extra_binds: dict[str, Path] | None = None,
    ro_binds: dict[str, Path] | None = None,
    limits: SandboxLimits | None = None,
    inside_workspace: str = INSIDE_WORKSPACE,
    visible: Sequence[Path | str] = (),
    empty_dir: Path | None = None,
    passwd_dir: Path | None = None,
    drop_to: tuple[int, int] | None = None,
    nice: int | None = None,
) -> list[str]:
    limits = limits or SandboxLimits()
    argv = ["bwrap", "--tmpfs", "/"]
    shown = visible_paths(visible)
    made: set[str] = set()

    def parents(dest: str) -> list[str]:
        # Mount points' parent dirs made explicitly world-traversable (bwrap would copy e.g. /root's 0700).
        out = []
        for parent in reversed(Path(dest).parents[:-1]):
            if str(parent) not in made:
                made.add(str(parent))
                out += ["--perms", "0755", "--dir", str(parent)]
        return out

    argv += ["--dev", "/dev", "--proc", "/proc"]
    tmp = ["--perms", "1777", *(["--size", str(limits.tmp_mb * MiB)] if limits.tmp_mb else []), "--tmpfs"]
    argv += [*tmp, "/tmp", *tmp, "/dev/shm"]
    made.add("/tmp")
    for host in shown:  # after /tmp: a visible path below /tmp is bound on top of the private tmpfs
        argv += parents(str(host))
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), str(host)]
        else:
            argv += ["--ro-bind", str(host), str(host)]
    if not any(p == Path("/var") or Path("/var") in p.parents for p in shown):
        argv += ["--symlink", "/tmp", "/var/tmp"]
    # Over the file the host's /etc/resolv.conf resolves to (systemd-resolved's is a symlink into /run)
    resolv = Path(os.path.realpath("/etc/resolv.conf"))
    if Path("/etc") in shown and resolv.is_file():
        argv += [*parents(str(resolv)), "--ro-bind", str(RESOLV_CONF), str(resolv)]
    if passwd_dir is not None:
        argv += ["--ro-bind", str(passwd_dir / "passwd"), "/etc/passwd"]
        argv += ["--ro-bind", str(passwd_dir / "group"), "/etc/group"]
    for hidden in hidden_inside(hide_paths, shown):
        if hidden.is_dir() and empty_dir is not None:
            argv += ["--ro-bind", str(empty_dir), str(hidden)]
        elif hidden.is_dir():
            argv += ["--tmpfs", str(hidden), "--remount-ro", str(hidden)]
        else:
            argv += ["--ro-bind", "/dev/null", str(hidden)]
    # Bind sources are resolved on the host, so a workspace below a hidden dir still works.
    argv += [*parents(inside_workspace), "--bind", str(workspace), inside_workspace]
    argv += [*parents(INSIDE_CTL), "--bind", str(ctl_dir), INSIDE_CTL]
    argv += [*parents(INSIDE_AGENT), "--ro-bind", str(AGENT_SCRIPT), INSIDE_AGENT]
    if proxy_socket is not None:
        argv += ["--bind", str(proxy_socket), PROXY_SOCKET_INSIDE]
    for inside, host in (ro_binds or {}).items():
        argv += [*parents(inside), "--ro-bind", str(host), inside]
    for inside, host in (extra_binds or {}).items():
        argv += [*parents(inside), "--bind", str(host), inside]
    argv += ["--remount-ro", "/"]
    if drop_to is None:
        argv += ["--unshare-all", "--cap-drop", "ALL"]
    else:  # privileged bwrap, no user namespace; the agent drops to the uid (see the module doc)
        argv += [*NAMESPACES, "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    argv += ["--die-with-parent", "--new-session"]
    argv += ["--hostname", "sandbox", "--chdir", inside_workspace, "--clearenv"]
    for k, v in sandbox_path_env({**(env or {}), "LEGORL_SANDBOX": label}).items():
        argv += ["--setenv", k, v]
    argv += ["--", host_python(), "-I", "-S", INSIDE_AGENT, f"{INSIDE_CTL}/control.sock"]
    if proxy_socket is not None:
        argv += ["--relay", str(relay_port), PROXY_SOCKET_INSIDE]
    if spec := limits.agent_arg():
        argv += ["--limits", spec]
    argv += ["--workdir", inside_workspace, "--lifeline"]
    if nice:
        argv += ["--nice", str(nice)]
    if drop_to is not None:
        argv += ["--uid", str(drop_to[0]), "--gid", str(drop_to[1])]
    return argv


class BwrapSandbox(ControlledSandbox):
    def __init__(
        self,
        proc: Spawned,
        workspace: Path,
        sandbox_dir: Path,
        label: str,
        relay_port: int,
        inside_workspace: str = INSIDE_WORKSPACE,
    ) -> None:
        super().__init__(workspace, sandbox_dir, label, relay_port)
        self.proc = proc
        self.inside_workspace = inside_workspace
        self.cpu_share: CpuShare | None = None  # its cgroup (or nice) once started; see cpushare.py
        self.ids: tuple[int, int] | None = None  # the uid/gid it runs as (a root driver), else None
        self.pool_slot: Path | None = None  # its dir while it waits in the pool (pool.py); None once handed out

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def create(
        cls,
        *,
        workspace: Path,
        sandbox_dir: Path,
        label: str,
        proxy_socket: Path | None = None,
        relay_port: int = RELAY_PORT,
        hide_paths: Sequence[Path] = (),
        memory_mb: int | None = None,
        env: dict[str, str] | None = None,
        extra_binds: dict[str, Path] | None = None,
        start_timeout: float = 20.0,
        limits: SandboxLimits | None = None,
        ro_binds: dict[str, Path] | None = None,
        inside_workspace: str = INSIDE_WORKSPACE,
        visible_paths: Sequence[Path | str] = (),
        sandbox_uid: int | None = None,
        cpus: float | None = None,
        cpu_share: bool = True,
        watch: bool = True,
    ) -> BwrapSandbox:
        """Start bwrap and return once the in-sandbox agent accepts commands.

        ``limits`` bounds processes, memory, CPU, file and workspace size and the sandbox's
        lifetime (``memory_mb`` is a shortcut for ``limits.memory_mb``). ``extra_binds`` /
        ``ro_binds`` map an inside path to a host path bound read-write / read-only;
        ``visible_paths`` adds host paths to the read-only view (toolchains); ``hide_paths``
        are covered even when inside a visible dir. ``sandbox_uid`` overrides the uid a root
        driver drops to (default: a random one per sandbox; 0: stay root, no process limit).
        ``watch=False`` leaves it off the watchdog: the pool (pool.py) puts it there at hand-out.
        """
        limits = limits or SandboxLimits()
        if memory_mb is not None:
            limits = limits.with_(memory_mb=memory_mb)
        workspace, sandbox_dir, ctl = sandbox_dirs(workspace, sandbox_dir, proxy_socket)
        empty = sandbox_dir / "empty"  # bound over hidden dirs
        empty.mkdir(exist_ok=True)
        ids = sandbox_ids(sandbox_uid)
        passwd_dir = await _enter_as(ids, workspace, proxy_socket, sandbox_dir) if ids is not None else None
        share = CpuShare.create(label, cpus) if cpu_share else None
        argv = bwrap_argv(
            workspace=workspace,
            ctl_dir=ctl,
            label=label,
            proxy_socket=proxy_socket,
            relay_port=relay_port,
            hide_paths=hide_paths,
            env=env,
            extra_binds=extra_binds,
            ro_binds=ro_binds,
            limits=limits,
            inside_workspace=inside_workspace,
            visible=visible_paths,
            empty_dir=empty,
            passwd_dir=passwd_dir,
            drop_to=ids,
            nice=share.nice if share is not None else None,
        )
        try:
            proc = await _spawn(argv, sandbox_dir / "bwrap.log", start_timeout)
        except BaseException:
            if share is not None:
                share.remove()
            raise
        (sandbox_dir / "label.json").write_text(  # what reap_orphans finds after a killed run
            json.dumps({"label": label, "bwrap_pid": proc.pid, "started": time.time(), "uid": ids and ids[0]})
        )
        box = cls(proc, workspace, sandbox_dir, label, relay_port, inside_workspace)
        box.cpu_share, box.ids = share, ids
        await box._until_ready(start_timeout)
        if share is not None and share.path is not None and not share.attach(process_tree(proc.pid)):
            share.remove()  # removed under us (another run's reap, between mkdir and here): once more
            box.cpu_share = share = CpuShare.create(label, cpus)
            share.attach(process_tree(proc.pid))
        if watch:
            box._watch(limits, proc.pid, memory=True)
        return box

    async def _until_ready(self, start_timeout: float) -> None:
        """Wait for the agent's ``ready`` line; a sandbox that does not start is closed, and the
        error carries the end of bwrap's log."""
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), start_timeout)
        except TimeoutError:
            line = b""
        except asyncio.CancelledError:
            _discard_later(self.proc, start_timeout)  # the caller never gets the box to close
            raise
        if line.strip() != b"ready":
            await self.close()
            tail = (self.sandbox_dir / "bwrap.log").read_text(errors="replace")[-2000:]
            exit_code = self.proc.returncode
            raise SandboxError(f"sandbox {self.label} did not start (bwrap exit {exit_code}): {tail}")

    async def _stop(self) -> None:
        """Kill bwrap and everything under it, then remove its cgroup."""
        kill_tree(self.proc.pid)
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            pass
        self.proc.close_pipes()
        share = self.cpu_share
        for _ in range(50):  # the last processes leave the cgroup a moment after bwrap is reaped
            if share is None or share.remove():
                break
            await asyncio.sleep(0.01)


async def _enter_as(
    ids: tuple[int, int], workspace: Path, proxy_socket: Path | None, sandbox_dir: Path
) -> Path | None:
    """Prepare for a sandbox that runs as uid/gid ``ids``: what it may use (``open_to``), and the
    dir holding the passwd and group files that name its user (None when not needed)."""
    await open_to(ids, workspace, proxy_socket)
    if (lines := passwd_lines(*ids)) is None:
        return None
    passwd_dir = sandbox_dir / "etc"
    passwd_dir.mkdir(exist_ok=True)
    (passwd_dir / "passwd").write_text(lines[0])
    (passwd_dir / "group").write_text(lines[1])
    return passwd_dir


async def _spawn(argv: list[str], log_path: Path, start_timeout: float) -> Spawned:
    """Start bwrap, its stderr to ``log_path``; its stdin a pipe (the agent's lifeline: it exits when this
    process is gone), its stdout the pipe the agent says ``ready`` on.

    Synchronous (spawn.py): asyncio's subprocess set-up, cancelled midway (as every task is at the end of
    ``asyncio.run``), could leave the started bwrap unowned or hang the loop's end on CPython 3.11; here
    there is nothing to interrupt between the fork and the caller owning the process.
    """
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        return spawn(argv, log)
    except OSError as e:
        raise SandboxError(f"could not start bwrap: {e}") from e
    finally:
        os.close(log)


def _is_our_bwrap(pid: int, ctl: str) -> bool:
    cmd = cmdline(pid)
    return bool(cmd) and any(Path(a).name == "bwrap" for a in cmd[:3]) and ctl in cmd


async def reap_orphans(sandboxes_root: Path, label: str | None = None) -> list[int]:
    """Kill bwrap processes left by an earlier (killed) run under ``sandboxes_root``.

    A pid is only killed when its command line still is a bwrap mentioning that sandbox's
    dir, so a recycled pid is never hit. With ``label``, every bwrap of the host carrying that
    run label is killed too (wherever its dir). Returns the pids killed.
    """
    killed: list[int] = []
    root = Path(sandboxes_root)
    if root.exists():
        for label_file in root.rglob("label.json"):
            try:
                data = json.loads(label_file.read_text())
                pid = int(data["bwrap_pid"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            # "ctl": where its bwrap bound the control dir from, when it was started in the pool (pool.py)
            ctl = data.get("ctl") if isinstance(data.get("ctl"), str) else str(label_file.parent.resolve() / "ctl")
            if _is_our_bwrap(pid, ctl):
                kill_tree(pid)
                killed.append(pid)
    if label is not None:
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in killed:
                continue
            cmd = cmdline(int(name))
            if cmd and Path(cmd[0]).name == "bwrap" and f"\0LEGORL_SANDBOX\0{label}\0" in "\0".join(["", *cmd, ""]):
                kill_tree(int(name))
                killed.append(int(name))
    for pid in killed:  # wait (briefly) until they are gone, so callers can rely on it
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    remove_empty()  # the cgroups of sandboxes gone with an earlier run
    return killed
