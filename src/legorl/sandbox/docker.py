"""Docker backend: the same protocol as the bubblewrap sandbox (control socket, relay, limits, labels).

The in-sandbox agent (``sandbox_agent.py``) runs as the container's main process; the control
dir, the workspace and the proxy socket are bind mounts, so ``SandboxClient`` and the harness
workers work unchanged. Isolation: ``--network none`` (the relay reaches only the proxy's Unix
socket), read-only root, no capabilities, no-new-privileges, an unprivileged uid, and the
limits as docker flags (``--pids-limit``, ``--memory``, ulimits, tmpfs sizes); the host
watchdog still enforces the workspace size and the lifetime. Every container carries the
label ``legorl.run=<label>``; ``reap_docker(label)`` removes leftovers (containers and volumes)
of a killed run. Needs the ``docker`` CLI and a reachable engine; the image must have python3.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from legorl.sandbox.bwrap import (
    AGENT_SCRIPT,
    INSIDE_AGENT,
    INSIDE_CTL,
    PROXY_SOCKET_INSIDE,
    SANDBOX_ENV,
)
from legorl.sandbox.client import SandboxClient, SandboxError
from legorl.sandbox.control import RELAY_PORT, ControlledSandbox, open_to, sandbox_dirs
from legorl.sandbox.limits import SandboxLimits

DEFAULT_IMAGE = "python:3.11-slim"
LABEL_KEY = "legorl.run"
SANDBOX_UID = 47474


def docker_unavailable(docker: str = "docker") -> str | None:
    """None when a Docker engine answers, else the reason (for skips and clear errors)."""
    exe = shutil.which(docker)
    if exe is None:
        return f"the {docker} CLI is not installed"
    try:
        p = subprocess.run(
            [exe, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`{docker} info` failed: {e}"
    if p.returncode != 0:
        return f"no Docker engine answers: {(p.stderr or p.stdout).strip()[-200:]}"
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
    user: tuple[int, int] | None = (SANDBOX_UID, SANDBOX_UID),
    cpus: float | None = None,
    ro_binds: dict[str, Path] | None = None,
    docker: str = "docker",
) -> list[str]:
    argv = [docker, "run", "-d", "--name", name, "--label", f"{LABEL_KEY}={label}",
            "--label", f"legorl.sandbox_dir={sandbox_dir}", "--network", "none", "--read-only",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--ipc", "private",
            "--hostname", "sandbox", "--ulimit", "core=0"]  # fmt: skip
    if user is not None:
        argv += ["--user", f"{user[0]}:{user[1]}"]
    if limits.processes:
        argv += ["--pids-limit", str(limits.processes)]
    if limits.memory_mb:
        argv += ["--memory", f"{limits.memory_mb}m", "--memory-swap", f"{limits.memory_mb}m"]
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
             "-v", f"{AGENT_SCRIPT}:{INSIDE_AGENT}:ro"]  # fmt: skip
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
    limits_arg = limits.with_(processes=None, memory_mb=None).agent_arg()  # docker enforces those two
    if limits_arg:
        argv += ["--limits", limits_arg]
    argv += ["--workdir", inside_workspace]
    return argv


async def _docker(*args: str, timeout: float = 60) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        return -1, f"{' '.join(args[:3])} timed out"
    return proc.returncode or 0, out.decode(errors="replace")


class DockerSandbox(ControlledSandbox):
    def __init__(self, container: str, workspace: Path, sandbox_dir: Path, label: str, relay_port: int,
                 inside_workspace: str, docker: str) -> None:  # fmt: skip
        super().__init__(workspace, sandbox_dir, label, relay_port)
        self.container = container
        self.inside_workspace = inside_workspace
        self.docker = docker

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
        cpus: float | None = None,
        start_timeout: float = 60.0,
        docker: str = "docker",
        hide_paths: Sequence[Path] = (),  # nothing of the host is visible in a container anyway
    ) -> DockerSandbox:
        if reason := docker_unavailable(docker):
            raise SandboxError(f"docker backend unavailable: {reason}")
        limits = limits or SandboxLimits()
        workspace, sandbox_dir, ctl = sandbox_dirs(workspace, sandbox_dir, proxy_socket)
        user = (SANDBOX_UID, SANDBOX_UID) if os.geteuid() == 0 else (os.getuid(), os.getgid())
        if os.geteuid() == 0:
            await open_to(user, workspace, proxy_socket)
            os.chown(ctl, *user)  # the agent binds its control socket there
        name = "legorl-" + re.sub(r"[^a-zA-Z0-9_.-]", "-", label)[:40] + "-" + secrets.token_hex(4)
        argv = docker_run_argv(
            name=name, image=image, workspace=workspace, ctl_dir=ctl, label=label, sandbox_dir=sandbox_dir,
            proxy_socket=proxy_socket, relay_port=relay_port, limits=limits, inside_workspace=inside_workspace,
            env=env, user=user, cpus=cpus, ro_binds=ro_binds, docker=docker,
        )  # fmt: skip
        rc, out = await _docker(*argv, timeout=start_timeout)
        if rc != 0:
            raise SandboxError(f"docker run failed for {label}: {out.strip()[-1000:]}")
        container = out.strip().splitlines()[-1]
        box = cls(container, workspace, sandbox_dir, label, relay_port, inside_workspace, docker)
        client = SandboxClient(box.control_socket)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if box.control_socket.exists() and await asyncio.to_thread(client.ping, 2.0):
                break
            await asyncio.sleep(0.02)
        else:
            _, logs = await _docker(docker, "logs", "--tail", "50", container)
            await box.close()
            raise SandboxError(f"docker sandbox {label} did not start: {logs[-1000:]}")

        def kill() -> None:
            subprocess.run([docker, "kill", container], capture_output=True, timeout=30, check=False)

        box._watch(limits, -1, memory=False, on_kill=kill)  # docker bounds the memory (--memory)
        return box

    async def _stop(self) -> None:
        await _docker(self.docker, "rm", "-f", "-v", self.container)


async def reap_docker(label: str, docker: str = "docker") -> list[str]:
    """Remove every container (any state) and volume labelled with this run; returns container ids."""
    if docker_unavailable(docker):
        return []
    rc, out = await _docker(docker, "ps", "-aq", "--filter", f"label={LABEL_KEY}={label}")
    ids = out.split() if rc == 0 else []
    if ids:
        await _docker(docker, "rm", "-f", "-v", *ids)
    await _docker(docker, "volume", "prune", "-f", "--filter", f"label={LABEL_KEY}={label}")
    return ids
