"""Docker backend: the same protocol as the bubblewrap sandbox (control socket, relay, limits, labels).

The in-sandbox agent (``sandbox_agent.py``) runs as the container's main process; the control
dir, the workspace and the proxy socket are bind mounts, so ``SandboxClient`` and the harness
workers work unchanged. Isolation: ``--network none`` (the relay reaches only the proxy's Unix
socket), read-only root, no-new-privileges, and the limits as engine flags (``--pids-limit``,
``--memory``, ulimits, tmpfs sizes) plus the agent's own rlimits. As with bwrap, a root driver
starts the agent as root with only CAP_SETUID/CAP_SETGID: it binds its control socket in a
root-owned dir, sets its limits, then drops to an unprivileged uid of its own per sandbox
(which clears every capability) before anything else runs. The host watchdog enforces the
workspace size, the lifetime and (where the container's processes are visible on this host)
the memory of the whole sandbox; it stops a container with ``docker kill``.

Every container carries the label ``legorl.run=<label>``; ``reap_docker(label)`` removes
leftovers (containers and volumes) of a killed run. Needs the ``docker`` CLI and an engine
that shares this host's file system (local Docker, or podman serving the Docker API:
``scripts/sandbox-image.sh``); ``docker_host`` (``sandbox.docker_host``) is passed to the CLI
as ``DOCKER_HOST``. The image needs ``python3`` (and what the tasks run: pytest, git, bash);
``legorl/debian-python:bookworm`` is built offline from Debian packages by the same script.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from legorl.sandbox.bwrap import (
    AGENT_SCRIPT,
    INSIDE_AGENT,
    INSIDE_CTL,
    PROXY_SOCKET_INSIDE,
    RESOLV_CONF,
    SANDBOX_ENV,
    sandbox_ids,
)
from legorl.sandbox.client import SandboxClient, SandboxError
from legorl.sandbox.control import RELAY_PORT, ControlledSandbox, open_to, sandbox_dirs
from legorl.sandbox.limits import SandboxLimits

DEFAULT_IMAGE = "legorl/debian-python:bookworm"  # built offline by scripts/sandbox-image.sh
LABEL_KEY = "legorl.run"
PIDS_HEADROOM = 64  # the cgroup's pids limit sits above RLIMIT_NPROC: the agent's threads count there too
_OK_TTL_S = 60.0  # a positive engine check is reused this long (one `docker info` per minute, not per sandbox)
_ok_until: dict[tuple[str, str | None, str | None], float] = {}
_ok_lock = threading.Lock()


def docker_env(docker_host: str | None) -> dict[str, str] | None:
    """The CLI's environment: ours, with DOCKER_HOST set when a host is configured (None: inherit)."""
    if not docker_host:
        return None
    return {**os.environ, "DOCKER_HOST": docker_host}


def _run(argv: list[str], docker_host: str | None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          env=docker_env(docker_host))  # fmt: skip


def docker_unavailable(docker: str = "docker", docker_host: str | None = None, image: str | None = None) -> str | None:
    """None when an engine answers (and holds ``image``, when given), else the reason, for skips and errors."""
    key = (docker, docker_host, image)
    with _ok_lock:
        if _ok_until.get(key, 0.0) > time.monotonic():
            return None
    exe = shutil.which(docker)
    if exe is None:
        return f"the {docker} CLI is not installed"
    where = docker_host or os.environ.get("DOCKER_HOST") or "the docker CLI's default engine"
    try:
        p = _run([exe, "info", "--format", "{{.ServerVersion}}"], docker_host, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{docker} info` failed ({where}): {e}"
    if p.returncode != 0:
        return f"no Docker engine answers at {where}: {(p.stderr or p.stdout).strip()[-300:]}"
    if image is not None:
        try:
            p = _run([exe, "image", "inspect", "--format", "{{.Id}}", image], docker_host, timeout=15)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"`{docker} image inspect {image}` failed: {e}"
        if p.returncode != 0:
            return (f"the engine at {where} has no image {image} (legorl never pulls one): build it with "
                    "scripts/sandbox-image.sh, or set sandbox.image / the task's image (docs/sandbox.md)")
    with _ok_lock:
        _ok_until[key] = time.monotonic() + _OK_TTL_S
    return None


def container_env(label: str, extra: dict[str, str] | None) -> dict[str, str]:
    return {**SANDBOX_ENV, "LEGORL_SANDBOX": label, **(extra or {})}


def docker_run_argv(
    *,
    name: str,
    image: str,
    workspace: Path,
    ctl_dir: Path,
    label: str,
    sandbox_dir: Path,
    proxy_socket: Path | None,
    relay_port: int,
    limits: SandboxLimits,
    inside_workspace: str = "/workspace",
    env: dict[str, str] | None = None,
    drop_to: tuple[int, int] | None = None,
    user: tuple[int, int] | None = None,
    cpus: float | None = None,
    ro_binds: dict[str, Path] | None = None,
    memory_headroom_mb: int = 0,
    docker: str = "docker",
) -> list[str]:
    """``drop_to``: start the agent as root with CAP_SETUID/CAP_SETGID only and let it drop to this uid/gid
    (a root driver); ``user``: run everything as this uid/gid from the start (a non-root driver)."""
    argv = [docker, "run", "-d", "--pull", "never", "--name", name, "--label", f"{LABEL_KEY}={label}",
            "--label", f"legorl.sandbox_dir={sandbox_dir}", "--network", "none", "--read-only",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--ipc", "private",
            "--hostname", "sandbox", "--ulimit", "core=0"]  # fmt: skip
    if drop_to is not None:
        argv += ["--user", "0:0", "--cap-add", "SETUID", "--cap-add", "SETGID"]
    elif user is not None:
        argv += ["--user", f"{user[0]}:{user[1]}"]
    if limits.processes:
        argv += ["--pids-limit", str(limits.processes + PIDS_HEADROOM)]
        argv += ["--ulimit", f"nproc={limits.processes}:{limits.processes}"]
    if limits.memory_mb:
        mem = limits.memory_mb + memory_headroom_mb
        argv += ["--memory", f"{mem}m", "--memory-swap", f"{mem}m"]
    if limits.open_files:
        argv += ["--ulimit", f"nofile={limits.open_files}:{limits.open_files}"]
    if limits.file_size_mb:
        size = limits.file_size_mb * 1024 * 1024
        argv += ["--ulimit", f"fsize={size}:{size}"]
    if cpus:
        argv += ["--cpus", str(cpus)]
    tmp = f"rw,nosuid,nodev,mode=1777{f',size={limits.tmp_mb}m' if limits.tmp_mb else ''}"
    argv += ["--tmpfs", f"/tmp:{tmp}", "--tmpfs", f"/dev/shm:{tmp}"]
    argv += ["-v", f"{workspace}:{inside_workspace}:rw", "-v", f"{ctl_dir}:{INSIDE_CTL}:rw",
             "-v", f"{AGENT_SCRIPT}:{INSIDE_AGENT}:ro",
             "-v", f"{RESOLV_CONF}:/etc/resolv.conf:ro"]  # no network: a lookup fails at once  # fmt: skip
    if proxy_socket is not None:
        argv += ["-v", f"{proxy_socket}:{PROXY_SOCKET_INSIDE}"]
    for inside, host in (ro_binds or {}).items():
        argv += ["-v", f"{host}:{inside}:ro"]
    for k, v in container_env(label, env).items():
        argv += ["-e", f"{k}={v}"]
    argv += ["-w", inside_workspace, "--entrypoint", "python3", image,
             "-I", "-S", INSIDE_AGENT, f"{INSIDE_CTL}/control.sock"]  # fmt: skip
    if proxy_socket is not None:
        argv += ["--relay", str(relay_port), PROXY_SOCKET_INSIDE]
    if limits_arg := limits.agent_arg():  # per-process rlimits, as under bwrap; the engine bounds the whole
        argv += ["--limits", limits_arg]
    argv += ["--workdir", inside_workspace]
    if drop_to is not None:
        argv += ["--uid", str(drop_to[0]), "--gid", str(drop_to[1])]
    return argv


async def _run_cli(argv: list[str], timeout: float, docker_host: str | None,
                   on_cancel: Callable[[asyncio.subprocess.Process], None] | None = None) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=docker_env(docker_host)
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -1, f"{' '.join(argv[:3])} timed out after {timeout:.0f}s"
    except asyncio.CancelledError:
        if on_cancel is not None:
            on_cancel(proc)
        raise
    return proc.returncode or 0, out.decode(errors="replace")


async def _docker(*args: str, timeout: float = 60, docker_host: str | None = None) -> tuple[int, str]:
    return await _run_cli(list(args), timeout, docker_host)


_DISCARDING: set[asyncio.Task] = set()


async def _start_container(argv: list[str], name: str, timeout: float, docker_host: str | None) -> tuple[int, str]:
    """`docker run -d`; a caller cancelled meanwhile leaves at once, and the container is removed once the
    CLI is done starting it (removing it earlier could come before the engine made it)."""

    def discard_later(proc: asyncio.subprocess.Process) -> None:
        async def discard() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), timeout)
            await _docker(argv[0], "rm", "-f", "-v", name, timeout=60, docker_host=docker_host)

        task = asyncio.get_running_loop().create_task(discard())
        _DISCARDING.add(task)  # held: the cancelled creator no longer references it
        task.add_done_callback(_DISCARDING.discard)

    return await _run_cli(argv, timeout, docker_host, discard_later)


def _covers(hide_paths: Sequence[Path], binds: dict[str, Path], sandbox_dir: Path) -> dict[str, Path]:
    """Read-only covers for the hide paths that a bind would show: an empty dir over a dir, /dev/null over
    a file (nothing else of the host is in a container to hide)."""
    out: dict[str, Path] = {}
    empty = sandbox_dir / "empty"
    for hidden in (Path(p).resolve() for p in hide_paths):
        for inside, host in list(binds.items()):
            host = Path(host).resolve()
            if hidden != host and host not in hidden.parents or not hidden.exists():
                continue
            if hidden.is_dir():
                empty.mkdir(mode=0o755, exist_ok=True)
            out[str(Path(inside) / hidden.relative_to(host))] = empty if hidden.is_dir() else Path("/dev/null")
    return out


def _host_pid(pid_text: str) -> int:
    """The container's main process as this host sees it (0 when the engine runs elsewhere: a VM, a remote host)."""
    try:
        pid = int(pid_text.strip() or 0)
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes() if pid > 0 else b""
    except (ValueError, OSError):
        return 0
    return pid if AGENT_SCRIPT.name.encode() in cmd else 0


class DockerSandbox(ControlledSandbox):
    def __init__(self, container: str, workspace: Path, sandbox_dir: Path, label: str, relay_port: int,
                 inside_workspace: str, docker: str, docker_host: str | None = None) -> None:  # fmt: skip
        super().__init__(workspace, sandbox_dir, label, relay_port)
        self.container = container
        self.inside_workspace = inside_workspace
        self.docker = docker
        self.docker_host = docker_host

    @classmethod
    async def create(
        cls,
        *,
        workspace: Path,
        sandbox_dir: Path,
        label: str,
        proxy_socket: Path | None = None,
        relay_port: int = RELAY_PORT,
        image: str = DEFAULT_IMAGE,
        limits: SandboxLimits | None = None,
        inside_workspace: str = "/workspace",
        env: dict[str, str] | None = None,
        ro_binds: dict[str, Path] | None = None,
        visible_paths: Sequence[Path | str] = (),
        sandbox_uid: int | None = None,
        cpus: float | None = None,
        start_timeout: float = 60.0,
        docker: str = "docker",
        docker_host: str | None = None,
        hide_paths: Sequence[Path] = (),  # nothing of the host is visible in a container anyway
    ) -> DockerSandbox:
        """Start a container running the in-sandbox agent; return once it accepts commands.

        ``visible_paths`` are host paths shown read-only at the same place (a toolchain); ``ro_binds``
        map an inside path to a host path shown read-only; ``sandbox_uid`` as for bwrap (default: a
        random unprivileged uid per sandbox when the driver is root; 0 stays root).
        """
        if reason := await asyncio.to_thread(docker_unavailable, docker, docker_host, image):
            raise SandboxError(f"docker backend unavailable: {reason}")
        limits = limits or SandboxLimits()
        workspace, sandbox_dir, ctl = sandbox_dirs(workspace, sandbox_dir, proxy_socket)
        drop_to, user = None, None
        if os.geteuid() == 0:
            drop_to = sandbox_ids(sandbox_uid)
            if drop_to is not None:
                await open_to(drop_to, workspace, proxy_socket)  # ctl stays root's: nothing inside can replace it
        else:
            user = (os.getuid(), os.getgid())
        binds = {str(Path(p).resolve()): Path(p).resolve() for p in visible_paths}
        binds.update(ro_binds or {})
        binds.update(_covers(hide_paths, binds, sandbox_dir))
        name = "legorl-" + re.sub(r"[^a-zA-Z0-9_.-]", "-", label)[:40] + "-" + secrets.token_hex(4)
        # The watchdog sums the sandbox's memory where it can see the processes; the engine's cgroup limit is a
        # backstop above it then (an OOM kill says less than the watchdog's reason).
        headroom = max(256, (limits.memory_mb or 0) // 4)
        argv = docker_run_argv(
            name=name, image=image, workspace=workspace, ctl_dir=ctl, label=label, sandbox_dir=sandbox_dir,
            proxy_socket=proxy_socket, relay_port=relay_port, limits=limits, inside_workspace=inside_workspace,
            env=env, drop_to=drop_to, user=user, cpus=cpus, ro_binds=binds, memory_headroom_mb=headroom,
            docker=docker,
        )  # fmt: skip
        rc, out = await _start_container(argv, name, start_timeout, docker_host)
        if rc != 0:
            await _docker(docker, "rm", "-f", "-v", name, timeout=30, docker_host=docker_host)
            raise SandboxError(f"docker run failed for {label}: {out.strip()[-1000:]}")
        container = out.strip().splitlines()[-1]
        box = cls(container, workspace, sandbox_dir, label, relay_port, inside_workspace, docker, docker_host)
        try:
            pid = await box._until_ready(start_timeout)
        except BaseException:
            await asyncio.shield(box.close())
            raise

        def kill() -> None:
            _run([docker, "kill", container], docker_host, timeout=30)

        box._watch(limits, pid or -1, memory=bool(pid), on_kill=kill)
        return box

    async def _until_ready(self, start_timeout: float) -> int:
        """Wait until the agent answers a ping; a container that exits first fails at once, with its log.
        Returns the container's main pid on this host (0 when not visible here)."""
        client = SandboxClient(self.control_socket)
        deadline = time.monotonic() + start_timeout
        next_state = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if self.control_socket.exists() and await asyncio.to_thread(client.ping, 2.0):
                rc, out = await self._inspect("{{.State.Pid}}")
                return _host_pid(out) if rc == 0 else 0
            if time.monotonic() >= next_state:
                next_state = time.monotonic() + 0.5
                rc, state = await self._inspect("{{.State.Status}} {{.State.ExitCode}}")
                if rc == 0 and state.split()[:1] in (["exited"], ["dead"]):
                    raise SandboxError(f"docker sandbox {self.label} exited before it started (status, exit code: "
                                       f"{state.strip()}): {await self._logs()}")
            await asyncio.sleep(0.02)
        raise SandboxError(f"docker sandbox {self.label} did not start in {start_timeout:.0f}s: {await self._logs()}")

    async def _inspect(self, fmt: str) -> tuple[int, str]:
        return await _docker(self.docker, "inspect", "--format", fmt, self.container, timeout=30,
                             docker_host=self.docker_host)  # fmt: skip

    async def _logs(self) -> str:
        _, logs = await _docker(self.docker, "logs", "--tail", "50", self.container, timeout=30,
                                docker_host=self.docker_host)  # fmt: skip
        return logs[-1000:]

    def _dead(self, what: str) -> SandboxError:
        """As for bwrap, plus what the engine knows: its OOM killer, or the container's exit."""
        if not self.violation and self.watch is not None and what:
            try:
                fmt = "{{.State.OOMKilled}} {{.State.Status}} {{.State.ExitCode}}"
                p = _run([self.docker, "inspect", "--format", fmt, self.container], self.docker_host, timeout=10)
                oom, status, code = (p.stdout.split() + ["", "", ""])[:3] if p.returncode == 0 else ("", "", "")
            except (OSError, subprocess.TimeoutExpired):
                oom, status, code = "", "", ""
            if oom == "true":
                self.watch.kill("memory limit exceeded (the engine's OOM killer ended the sandbox)")
            elif status in ("exited", "dead"):
                self.watch.kill(f"the sandbox's container exited (exit code {code})")
        return super()._dead(what)

    async def _stop(self) -> None:
        await _docker(self.docker, "rm", "-f", "-v", self.container, timeout=60, docker_host=self.docker_host)


async def reap_docker(label: str, docker: str = "docker", docker_host: str | None = None) -> list[str]:
    """Remove every container (any state) and volume labelled with this run; returns container ids."""
    if await asyncio.to_thread(docker_unavailable, docker, docker_host):
        return []
    rc, out = await _docker(docker, "ps", "-aq", "--filter", f"label={LABEL_KEY}={label}", docker_host=docker_host)
    ids = out.split() if rc == 0 else []
    if ids:
        await _docker(docker, "rm", "-f", "-v", *ids, docker_host=docker_host)
    await _docker(docker, "volume", "prune", "-f", "--filter", f"label={LABEL_KEY}={label}", docker_host=docker_host)
    return ids
