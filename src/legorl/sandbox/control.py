"""What the bubblewrap and docker backends share: the set-up of a sandbox's host side (its dirs,
what an unprivileged sandbox uid may use, the watchdog's watch), the async side of the
control-socket protocol, and closing."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self, TypeVar

from legorl.config import SandboxConfig
from legorl.sandbox.client import (
    REPLY_SLACK_S,
    ExecResult,
    SandboxError,
    connect_unix,
    exec_request,
    parse_exec_reply,
)
from legorl.sandbox.limits import MiB, SandboxLimits
from legorl.sandbox.watchdog import WATCHDOG, Watch

T = TypeVar("T")
READ_LIMIT = 64 * 1024 * 1024  # one JSON reply line may carry a large command output
RELAY_PORT = SandboxConfig.model_fields["relay_port"].default  # sandbox.relay_port's default


async def _read_line(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """One reply line (b"" if the agent closed first). Plain socket reads: fewer loop hops than streams."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await loop.sock_recv(sock, 1 << 20)
        if not chunk:
            return b""
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)
        if size > READ_LIMIT:
            raise ValueError(f"reply longer than {READ_LIMIT} bytes")


def sandbox_dirs(workspace: Path, sandbox_dir: Path, proxy_socket: Path | None) -> tuple[Path, Path, Path]:
    """(workspace, sandbox_dir, ctl dir) resolved, the ctl dir (the control socket's) made; a missing
    workspace or proxy socket is refused before anything starts."""
    workspace, sandbox_dir = Path(workspace).resolve(), Path(sandbox_dir).resolve()
    ctl = sandbox_dir / "ctl"
    ctl.mkdir(parents=True, exist_ok=True)
    if proxy_socket is not None and not Path(proxy_socket).exists():
        raise SandboxError(f"proxy socket {proxy_socket} does not exist: start the proxy first")
    if not workspace.is_dir():
        raise SandboxError(f"workspace {workspace} is not a directory")
    return workspace, sandbox_dir, ctl


def chown_tree(root: Path, uid: int, gid: int) -> None:
    os.lchown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            try:
                os.lchown(os.path.join(dirpath, name), uid, gid)
            except FileNotFoundError:
                pass


async def open_to(ids: tuple[int, int], workspace: Path, proxy_socket: Path | None) -> None:
    """Let a sandbox running as another uid use what it is given: its workspace (chowned to it) and
    the proxy's socket (connecting to a Unix socket needs write permission on it)."""
    await asyncio.to_thread(chown_tree, workspace, *ids)
    if proxy_socket is not None:
        mode = os.stat(proxy_socket).st_mode
        os.chmod(proxy_socket, (mode & 0o7777) | 0o666)


class ControlledSandbox:
    """A sandbox whose in-sandbox agent listens on ``control_socket`` (see sandbox_agent.py)."""

    inside_workspace = "/workspace"

    def __init__(self, workspace: Path, sandbox_dir: Path, label: str, relay_port: int) -> None:
        self.workspace = workspace
        self.sandbox_dir = sandbox_dir
        self.label = label
        self.relay_port = relay_port
        self.control_socket = sandbox_dir / "ctl" / "control.sock"
        self.watch: Watch | None = None
        self._closed = False
        self._violated: asyncio.Event | None = None  # set (on the creating loop) once the watchdog kills it

    @property
    def violation(self) -> str:
        """Why the watchdog killed this sandbox ("" while it is within its limits)."""
        return self.watch.violation if self.watch is not None else ""

    def _dead(self, what: str) -> SandboxError:
        if self.violation:
            return SandboxError(f"sandbox {self.label} was killed: {self.violation}")
        return SandboxError(f"sandbox {self.label}: {what}")

    async def _request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._closed:
            raise SandboxError(f"sandbox {self.label} is closed")
        if self.violation:
            raise self._dead("")
        loop = asyncio.get_running_loop()
        try:
            sock = connect_unix(self.control_socket, 5.0)
        except OSError as e:
            raise self._dead(f"control socket unreachable: {e}") from e
        sock.setblocking(False)
        try:
            await loop.sock_sendall(sock, json.dumps(payload).encode() + b"\n")
            line = await asyncio.wait_for(_read_line(loop, sock), timeout)
        except (TimeoutError, OSError, ValueError) as e:
            raise self._dead(f"no reply from agent: {e!r}") from e
        finally:
            sock.close()
        if not line:
            raise self._dead("agent closed the connection (sandbox died?)")
        return json.loads(line)

    async def exec(
        self,
        command: str,
        timeout: float = 30,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        """Run ``bash -c command`` (cwd: the workspace). On timeout, or when this call is cancelled, everything
        the command started is killed (its whole tree, daemons included) and the output says what was ended.
        A sandbox whose process budget is exhausted (no command can start) is killed: SandboxError with why."""
        reply = await self._request(exec_request(command, timeout, cwd, env), timeout + REPLY_SLACK_S)
        if reply.get("failure") and self.watch is not None:
            self.watch.kill(reply["failure"])
            raise self._dead("")
        return parse_exec_reply(reply)

    async def guard(self, work: Awaitable[T]) -> T:
        """Await ``work`` (the harness's run); if the watchdog kills the sandbox first (a limit blown, the
        process budget exhausted), cancel it and raise SandboxError with the reason, rather than let it go
        on issuing commands that can only fail."""
        task = asyncio.ensure_future(work)
        if self._violated is None:
            return await task
        waiter = asyncio.ensure_future(self._violated.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            waiter.cancel()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise
        waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise self._dead("")

    async def write_file(self, path: str, content: str | bytes) -> None:
        data = content.encode() if isinstance(content, str) else content
        reply = await self._request(
            {"op": "write_file", "path": path, "content_b64": base64.b64encode(data).decode()}, 30
        )
        if "error" in reply:
            raise SandboxError(f"write_file {path} failed: {reply['error']}")

    async def quiesce(self, timeout: float = 30) -> list[str]:
        """End every process the sandbox's commands left running (the names ended); SandboxError when some
        survive. Before the host reads what the agent did: nothing of the agent's can then tamper with it."""
        reply = await self._request({"op": "quiesce", "budget": min(10.0, timeout)}, timeout)
        if "error" in reply or reply.get("left"):
            raise SandboxError(f"sandbox {self.label}: could not end the agent's processes "
                               f"({reply.get('error') or str(reply.get('left')) + ' left'})")
        return list(reply.get("ended") or [])

    async def read_file(self, path: str, max_bytes: int = READ_LIMIT // 2) -> bytes:
        reply = await self._request({"op": "read_file", "path": path, "max_bytes": max_bytes}, 30)
        if "error" in reply:
            raise SandboxError(f"read_file {path} failed: {reply['error']}")
        return base64.b64decode(reply["content_b64"])

    def _watch(
        self, limits: SandboxLimits, pid: int, *, memory: bool, on_kill: Callable[[], None] | None = None
    ) -> None:
        """Put the started sandbox under the watchdog: its workspace size, its lifetime (counted from
        now), what its agent reports (``ctl/failure``) and, where the backend itself does not bound it
        (``memory``), its processes' memory."""
        loop = asyncio.get_running_loop()
        violated = self._violated = asyncio.Event()
        self.watch = WATCHDOG.add(
            Watch(
                pid=pid,
                label=self.label,
                workspace=self.workspace,
                memory_bytes=limits.memory_mb and limits.memory_mb * MiB if memory else None,
                workspace_bytes=limits.workspace_mb and limits.workspace_mb * MiB,
                deadline=time.monotonic() + limits.lifetime_s if limits.lifetime_s else None,
                on_kill=on_kill,
                failure_file=self.sandbox_dir / "ctl" / "failure",
                on_violation=lambda: loop.call_soon_threadsafe(violated.set),
            )
        )

    async def close(self) -> None:
        """Stop the sandbox and everything in it. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.watch is not None:
            WATCHDOG.remove(self.watch)
        await self._stop()

    async def _stop(self) -> None:  # pragma: no cover - backends override
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
