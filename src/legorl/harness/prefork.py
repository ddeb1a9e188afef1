"""A harness's Python with its modules imported once, forked into each rollout's sandbox (the server's side is
prefork_server.py, which says how the fork becomes a process of the sandbox).

It applies where the sandbox is a bubblewrap sandbox started by a root driver (privileged bwrap, the sandbox's
own uid): `sandbox_target` finds the sandbox's agent, whose namespaces, limits, cgroup, uid and environment the
fork takes. Elsewhere (docker, a driver that is not root, a sandbox run as uid 0) it returns None, and the
harness starts afresh in the sandbox through its control socket as before.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path

from legorl.harness.base import HarnessCrashed
from legorl.sandbox.bwrap import INSIDE_AGENT, INSIDE_WORKSPACE
from legorl.sandbox.cpushare import cgroup_mounts
from legorl.sandbox.procs import cmdline, process_tree

SERVER = Path(__file__).with_name("prefork_server.py")
MAX_OUTPUT = 2_000_000  # bytes of the runner's output kept (its end: the result line is last), as a command's
# /proc/<pid>/limits rows -> resource names (prlimit(2) on a sandbox's process is refused even to root here)
LIMIT_ROWS = {"Max processes": "nproc", "Max data size": "data", "Max address space": "as",
              "Max file size": "fsize", "Max open files": "nofile", "Max core file size": "core"}


@dataclass(frozen=True)
class SandboxTarget:
    """What a fork must take on to be a process of one sandbox: those of its agent (its host pid)."""

    pid: int
    uid: int
    gid: int
    cgroups: list[str]  # the agent's cgroup dirs on the host where they are not the driver's (its CPU share)
    limits: dict[str, tuple[int, int]]  # its resource limits: name -> (soft, hard), -1 unlimited
    nice: int
    env: dict[str, str]  # the sandbox's environment, as a command there starts with
    cpu: int  # the CPU seconds each command may use (the agent's `ulimit -t`), 0: no limit


def _agent_below(bwrap_pid: int) -> int | None:
    """The host pid of the sandbox's agent: the first process under bwrap (parents first) running INSIDE_AGENT;
    its own zygote, below it, runs it too."""
    return next((p for p in process_tree(bwrap_pid) if (cmd := cmdline(p)) and cmd[0] != "bwrap"
                 and INSIDE_AGENT in cmd[:4]), None)


def _cgroups(pid: int | str) -> dict[str, str]:
    """controllers -> cgroup path ("" is the v2 hierarchy) of a process."""
    rows = (line.split(":", 2) for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    return {controllers: path for _, controllers, path in rows}


def _cgroup_dirs(pid: int) -> list[str]:
    """The host dirs of the cgroups `pid` is in and this process is not (the sandbox's CPU share)."""
    own, out = _cgroups("self"), []
    for controllers, path in _cgroups(pid).items():
        if own.get(controllers) == path:
            continue
        for root, point, fstype, options in cgroup_mounts():
            v2 = controllers == "" and fstype == "cgroup2"
            if v2 or (controllers and fstype == "cgroup" and set(controllers.split(",")) <= set(options.split(","))):
                out.append(os.path.normpath(os.path.join(point, os.path.relpath(path, root))))
                break
    return out


def _limits(pid: int) -> dict[str, tuple[int, int]]:
    """The resource limits of `pid`: name -> (soft, hard), -1 for unlimited."""
    out = {}
    for row in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        for label, name in LIMIT_ROWS.items():
            if row.startswith(label + " "):
                soft, hard = row[len(label):].split()[:2]
                out[name] = (-1 if soft == "unlimited" else int(soft), -1 if hard == "unlimited" else int(hard))
    return out


def forks_can_enter_sandboxes() -> bool:
    """Entering a sandbox's namespaces and cgroup takes root (bwrap under a root driver; see the module doc)."""
    return os.geteuid() == 0


def sandbox_target(control_socket: str) -> SandboxTarget | None:
    """The sandbox whose control socket is `control_socket`, if a fork can enter it (see the module doc)."""
    if not forks_can_enter_sandboxes():
        return None
    try:
        label = json.loads((Path(control_socket).parents[1] / "label.json").read_text())
    except (OSError, ValueError):
        return None
    if not label.get("bwrap_pid") or not label.get("uid"):
        return None
    agent = _agent_below(int(label["bwrap_pid"]))
    if agent is None:
        return None
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{agent}/status").read_text().splitlines())
        nice = int(Path(f"/proc/{agent}/stat").read_bytes().rpartition(b")")[2].split()[16])
        cgroups, limits = _cgroup_dirs(agent), _limits(agent)
        environ = Path(f"/proc/{agent}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return None
    uid, gid = int(status["Uid"].split()[0]), int(status["Gid"].split()[0])
    if uid == 0 or gid == 0:
        return None
    argv = cmdline(agent)
    spec = argv[argv.index("--limits") + 1].split(",") if "--limits" in argv else []
    cpu = next((int(item.split("=")[1]) for item in spec if item.startswith("cpu=")), 0)
    env = dict(item.split("=", 1) for item in environ.split("\0") if "=" in item)
    return SandboxTarget(agent, uid, gid, cgroups, limits, nice, env, cpu)


class PreforkServer:
    """One harness Python that imported `runner` once (its `preload()`), forking an episode's runner (its
    `main()`) into a sandbox per `run`. Started with `env` only: nothing of the driver's environment reaches
    the forks (a process's initial environment stays readable in /proc/self/environ)."""

    def __init__(self, python: str, runner: Path, env: dict[str, str]):
        self.python, self.runner, self.env = python, runner, env
        self.proc: asyncio.subprocess.Process | None = None
        self.dir: Path | None = None
        self.forked = 0  # episodes run through it

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def socket_path(self) -> Path:
        assert self.dir is not None
        return self.dir / "prefork.sock"

    async def start(self, timeout: float = 120.0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="legorl-prefork-"))
        log = self.dir / "server.log"
        with open(log, "wb") as err:  # noqa: ASYNC230 - a new empty file
            # -P: the server's dir is not on sys.path (legorl's own openhands.py would shadow the SDK)
            self.proc = await asyncio.create_subprocess_exec(
                self.python, "-P", str(SERVER), str(self.socket_path), str(self.runner), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=err, env=self.env, cwd=self.dir)
        assert self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            line = b""
        except BaseException:  # cancelled while it imports: no server is left behind
            await asyncio.shield(self.close())
            raise
        if line.strip() != b"ready":
            tail = log.read_text(errors="replace")[-2000:]
            await self.close()
            raise HarnessCrashed(f"the prefork server ({self.python} {SERVER.name}) did not start: {tail}")

    def run(self, target: SandboxTarget, env: dict[str, str], timeout: float,
            argv: list[str] | None = None) -> tuple[str, int | None]:
        """The runner's episode in the target's sandbox (blocking: call it in a thread): (its output, its exit
        code), or None for the code when it ran out of `timeout` and was ended."""
        request = {"pid": target.pid, "uid": target.uid, "gid": target.gid, "cgroups": target.cgroups,
                   "limits": target.limits, "nice": target.nice, "env": {**target.env, **env}, "cwd": INSIDE_WORKSPACE,
                   "cpu": target.cpu, "argv": argv or []}
        out = os.memfd_create("legorl-prefork-out")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                try:
                    conn.connect(str(self.socket_path))
                    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [out])
                except OSError as e:  # it died (killed, out of memory): the harness restarts it for the next episode
                    raise HarnessCrashed(f"the prefork server is gone ({e}); see {self.dir}/server.log") from e
                conn.settimeout(timeout)
                timed_out = False
                try:
                    reply = _line(conn)
                except TimeoutError:
                    timed_out = True
                    conn.settimeout(30)
                    conn.sendall(b"kill\n")
                    reply = _line(conn)
            size = os.lseek(out, 0, os.SEEK_END)
            output = os.pread(out, MAX_OUTPUT, max(0, size - MAX_OUTPUT)).decode(errors="replace")
        finally:
            os.close(out)
        if reply.startswith("error "):
            raise HarnessCrashed(f"the prefork server could not start the harness in sandbox pid {target.pid}: "
                                 f"{reply[6:]}")
        if not reply.startswith("exit "):
            raise HarnessCrashed(f"the prefork server ended without reporting the harness's exit: {reply!r}")
        self.forked += 1
        return output, None if timed_out else int(reply[5:])

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # its lifeline: it exits at end-of-file
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def _line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()
