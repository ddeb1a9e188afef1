"""Async side of the control-socket protocol, shared by the bubblewrap and docker backends."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
from pathlib import Path
from typing import Any, Self

from legorl.sandbox.client import (
    REPLY_SLACK_S,
    ExecResult,
    SandboxError,
    connect_unix,
    exec_request,
    parse_exec_reply,
)
from legorl.sandbox.watchdog import Watch

READ_LIMIT = 64 * 1024 * 1024  # one JSON reply line may carry a large command output


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
        """Run ``bash -c command`` (cwd: the workspace); on timeout the command's process group is killed."""
        reply = await self._request(exec_request(command, timeout, cwd, env), timeout + REPLY_SLACK_S)
        return parse_exec_reply(reply)

    async def write_file(self, path: str, content: str | bytes) -> None:
        data = content.encode() if isinstance(content, str) else content
        reply = await self._request(
            {"op": "write_file", "path": path, "content_b64": base64.b64encode(data).decode()}, 30
        )
        if "error" in reply:
            raise SandboxError(f"write_file {path} failed: {reply['error']}")

    async def read_file(self, path: str, max_bytes: int = READ_LIMIT // 2) -> bytes:
        reply = await self._request({"op": "read_file", "path": path, "max_bytes": max_bytes}, 30)
        if "error" in reply:
            raise SandboxError(f"read_file {path} failed: {reply['error']}")
        return base64.b64decode(reply["content_b64"])

    async def close(self) -> None:  # pragma: no cover - backends override
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
