"""Bubblewrap sandbox: one per rollout (and one per grading).

Layout inside the sandbox:

* ``/`` is a read-only view of the host root (each top-level host entry ro-bound onto a
  tmpfs that is remounted read-only, so new mount points such as /workspace can exist);
* ``/workspace`` is the task repo (host ``workspace``, read-write);
* ``/run/legorl`` is host ``<sandbox_dir>/ctl`` (read-write): the agent's control socket
  ``control.sock`` lives there, and the proxy's Unix socket is bind-mounted at
  ``/run/legorl/proxy.sock`` when given;
* ``/tmp`` is a private tmpfs; every ``hide_paths`` entry is covered by an empty tmpfs;
* no network (own net namespace with only loopback), own pid/ipc/uts/user namespaces,
  no capabilities.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Self

from legorl.sandbox.client import (
    REPLY_SLACK_S,
    ExecResult,
    SandboxClient,
    SandboxError,
    connect_unix,
    exec_request,
    parse_exec_reply,
)

AGENT_SCRIPT = Path(__file__).with_name("sandbox_agent.py")
INSIDE_WORKSPACE = "/workspace"
INSIDE_CTL = "/run/legorl"
INSIDE_AGENT = "/run/legorl-agent/sandbox_agent.py"
PROXY_SOCKET_INSIDE = f"{INSIDE_CTL}/proxy.sock"
# Host top-level entries never shown inside: replaced by fresh mounts or meaningless there.
_SKIP_TOP = {"proc", "dev", "tmp", "run", "workspace", "lost+found", "old_root"}
_READ_LIMIT = 64 * 1024 * 1024  # one JSON reply line may carry a large command output
# Host credentials never belong in a sandbox (HOME inside is /tmp, so nothing needs them).
DEFAULT_HIDDEN = tuple(
    Path.home() / p
    for p in (".ssh", ".aws", ".azure", ".gnupg", ".docker", ".kube", ".netrc", ".git-credentials", ".config",
              ".cache/huggingface", ".huggingface")
)  # fmt: skip


def host_python() -> str:
    """The real interpreter behind the venv's python: runs the agent with only the stdlib."""
    return os.path.realpath(sys.executable)


def sandbox_path_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)  # first, so `python` has pytest & co.
    env = {
        "PATH": f"{venv_bin}:/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin",
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
    env.update(extra or {})
    return env


def bwrap_argv(
    *,
    workspace: Path,
    ctl_dir: Path,
    label: str,
    proxy_socket: Path | None,
    relay_port: int,
    hide_paths: list[Path] | tuple[Path, ...] = (),
    env: dict[str, str] | None = None,
    extra_binds: dict[str, Path] | None = None,
) -> list[str]:
    argv = ["bwrap", "--tmpfs", "/"]
    for entry in sorted(os.listdir("/")):
        if entry in _SKIP_TOP:
            continue
        host = Path("/") / entry
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{entry}"]
        else:
            argv += ["--ro-bind", str(host), f"/{entry}"]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run"]
    for hidden in (*DEFAULT_HIDDEN, *hide_paths):
        hidden = Path(hidden).resolve()
        if hidden.is_dir():
            argv += ["--tmpfs", str(hidden)]
        elif hidden.exists():
            argv += ["--ro-bind", "/dev/null", str(hidden)]
    # Bind sources are resolved on the host, so a workspace below a hidden dir still works.
    argv += ["--bind", str(workspace), INSIDE_WORKSPACE, "--bind", str(ctl_dir), INSIDE_CTL]
    argv += ["--ro-bind", str(AGENT_SCRIPT), INSIDE_AGENT]
    if proxy_socket is not None:
        argv += ["--bind", str(proxy_socket), PROXY_SOCKET_INSIDE]
    for inside, host in (extra_binds or {}).items():
        argv += ["--bind", str(host), inside]
    argv += ["--remount-ro", "/"]
    argv += ["--unshare-all", "--cap-drop", "ALL", "--die-with-parent", "--new-session"]
    argv += ["--hostname", "sandbox", "--chdir", INSIDE_WORKSPACE, "--clearenv"]
    for k, v in sandbox_path_env({**(env or {}), "LEGORL_SANDBOX": label}).items():
        argv += ["--setenv", k, v]
    argv += ["--", host_python(), "-I", "-S", INSIDE_AGENT, f"{INSIDE_CTL}/control.sock"]
    if proxy_socket is not None:
        argv += ["--relay", str(relay_port), PROXY_SOCKET_INSIDE]
    return argv


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(name))
    return children


def process_tree(pid: int) -> list[int]:
    """pid and all its descendants (parents first)."""
    children = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(pid: int) -> None:
    for p in process_tree(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


class BwrapSandbox:
    inside_workspace = INSIDE_WORKSPACE

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        workspace: Path,
        sandbox_dir: Path,
        label: str,
        relay_port: int,
    ) -> None:
        self.proc = proc
        self.workspace = workspace
        self.sandbox_dir = sandbox_dir
        self.label = label
        self.relay_port = relay_port
        self.control_socket = sandbox_dir / "ctl" / "control.sock"
        self.client = SandboxClient(self.control_socket)
        self._closed = False

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
        relay_port: int = 18000,
        hide_paths: list[Path] | tuple[Path, ...] = (),
        memory_mb: int | None = None,
        env: dict[str, str] | None = None,
        extra_binds: dict[str, Path] | None = None,
        start_timeout: float = 20.0,
    ) -> BwrapSandbox:
        """Start bwrap and return once the in-sandbox agent answers a ping.

        ``extra_binds`` maps an inside path to a host dir bound read-write (the grader's
        verifier dir). ``memory_mb`` caps the address space of everything in the sandbox.
        """
        workspace, sandbox_dir = Path(workspace).resolve(), Path(sandbox_dir).resolve()
        ctl = sandbox_dir / "ctl"
        ctl.mkdir(parents=True, exist_ok=True)
        if proxy_socket is not None and not Path(proxy_socket).exists():
            raise SandboxError(f"proxy socket {proxy_socket} does not exist: start the proxy first")
        argv = bwrap_argv(
            workspace=workspace,
            ctl_dir=ctl,
            label=label,
            proxy_socket=proxy_socket,
            relay_port=relay_port,
            hide_paths=hide_paths,
            env=env,
            extra_binds=extra_binds,
        )
        if memory_mb is not None:
            argv = ["prlimit", f"--as={memory_mb * 1024 * 1024}", "--", *argv]
        log = os.open(sandbox_dir / "bwrap.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
            )
        except OSError as e:
            raise SandboxError(f"could not start bwrap: {e}") from e
        finally:
            os.close(log)
        (sandbox_dir / "label.json").write_text(
            json.dumps({"label": label, "bwrap_pid": proc.pid, "started": time.time()})
        )
        box = cls(proc, workspace, sandbox_dir, label, relay_port)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                break
            if box.control_socket.exists() and await asyncio.to_thread(box.client.ping, 2.0):
                return box
            await asyncio.sleep(0.02)
        await box.close()
        tail = (sandbox_dir / "bwrap.log").read_text(errors="replace")[-2000:]
        raise SandboxError(f"sandbox {label} did not start (bwrap exit {proc.returncode}): {tail}")

    async def _request(self, payload: dict, timeout: float) -> dict:
        if self._closed:
            raise SandboxError(f"sandbox {self.label} is closed")
        try:
            sock = connect_unix(self.control_socket, 5.0)
            sock.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=_READ_LIMIT)
        except OSError as e:
            raise SandboxError(f"sandbox {self.label}: control socket unreachable: {e}") from e
        try:
            writer.write(json.dumps(payload).encode() + b"\n")
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), timeout)
        except (TimeoutError, OSError, ValueError) as e:
            raise SandboxError(f"sandbox {self.label}: no reply from agent: {e!r}") from e
        finally:
            writer.close()
        if not line:
            raise SandboxError(f"sandbox {self.label}: agent closed the connection (sandbox died?)")
        return json.loads(line)

    async def exec(
        self,
        command: str,
        timeout: float = 30,
        cwd: str = INSIDE_WORKSPACE,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run ``bash -c command``; on timeout the command's process group is killed."""
        reply = await self._request(exec_request(command, timeout, cwd, env), timeout + REPLY_SLACK_S)
        return parse_exec_reply(reply)

    async def write_file(self, path: str, content: str | bytes) -> None:
        import base64

        data = content.encode() if isinstance(content, str) else content
        reply = await self._request(
            {"op": "write_file", "path": path, "content_b64": base64.b64encode(data).decode()}, 30
        )
        if "error" in reply:
            raise SandboxError(f"write_file {path} failed: {reply['error']}")

    async def close(self) -> None:
        """Kill bwrap and everything under it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        kill_tree(self.proc.pid)
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            pass

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def reap_orphans(sandboxes_root: Path) -> list[int]:
    """Kill bwrap processes left by an earlier (killed) run under ``sandboxes_root``.

    A pid is only killed when its command line still is a bwrap mentioning that sandbox's
    dir, so a recycled pid is never hit. Returns the pids killed.
    """
    killed: list[int] = []
    root = Path(sandboxes_root)
    if not root.exists():
        return killed
    for label_file in root.rglob("label.json"):
        try:
            pid = int(json.loads(label_file.read_text())["bwrap_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        cmd = _cmdline(pid)
        ctl = str(label_file.parent.resolve() / "ctl")
        if cmd and any(Path(a).name == "bwrap" for a in cmd[:3]) and ctl in cmd:
            kill_tree(pid)
            killed.append(pid)
    return killed
