"""Synchronous client for a sandbox's control socket (no asyncio: usable from any process).

A harness worker process gets the host path of the control socket and runs commands
inside the same sandbox the driver created.
"""

from __future__ import annotations

import base64
import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Slack added to a command's own timeout before the client gives up on the reply.
REPLY_SLACK_S = 15.0
_SUN_PATH_MAX = 100  # sockaddr_un holds 108 bytes; stay clear of it


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command run in it)."""


@dataclass
class ExecResult:
    output: str
    returncode: int
    timed_out: bool = False
    ended: list[str] = field(default_factory=list)  # names of the processes a timeout ended (its tree)


def connect_unix(path: Path, timeout: float | None) -> socket.socket:
    """Connect to a Unix socket, even when its path is longer than sockaddr_un allows."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    target = str(path)
    dir_fd = None
    if len(target.encode()) > _SUN_PATH_MAX:
        # Reach it through a short /proc/self/fd/N/name path to its directory.
        dir_fd = os.open(str(path.parent), os.O_PATH)
        target = f"/proc/self/fd/{dir_fd}/{path.name}"
    try:
        sock.connect(target)
    except OSError:
        sock.close()
        raise
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    return sock


def exec_request(
    command: str, timeout: float, cwd: str | None, env: dict[str, str] | None
) -> dict[str, Any]:
    """``cwd=None``: the sandbox's workspace."""
    return {"op": "exec", "command": command, "timeout": timeout, "cwd": cwd, "env": env or {}}


def parse_exec_reply(reply: dict[str, Any]) -> ExecResult:
    if reply.get("failure"):  # the sandbox can no longer run anything (its process budget is exhausted)
        raise SandboxError(f"sandbox failed: {reply['failure']}")
    if "error" in reply:
        raise SandboxError(f"sandbox agent rejected the request: {reply['error']}")
    return ExecResult(reply["output"], int(reply["returncode"]), bool(reply["timed_out"]), list(reply.get("ended", ())))


class SandboxClient:
    """Blocking client: one connection per request, so it is safe to share across threads."""

    def __init__(self, control_socket: Path | str) -> None:
        self.control_socket = Path(control_socket)

    def request(self, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            with connect_unix(self.control_socket, timeout) as sock, sock.makefile("rwb") as f:
                f.write(json.dumps(payload).encode() + b"\n")
                f.flush()
                line = f.readline()
        except OSError as e:
            raise SandboxError(f"sandbox control socket {self.control_socket} failed: {e}") from e
        if not line:
            raise SandboxError(f"sandbox at {self.control_socket} closed the connection (sandbox died?)")
        return json.loads(line)

    def exec(
        self, command: str, timeout: float = 30, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        reply = self.request(exec_request(command, timeout, cwd, env), timeout + REPLY_SLACK_S)
        return parse_exec_reply(reply)

    def ping(self, timeout: float = 5) -> bool:
        try:
            return bool(self.request({"op": "ping"}, timeout).get("ok"))
        except (SandboxError, ValueError):
            return False

    def write_file(self, path: str, content: str | bytes, timeout: float = 30) -> None:
        data = content.encode() if isinstance(content, str) else content
        reply = self.request(
            {"op": "write_file", "path": path, "content_b64": base64.b64encode(data).decode()}, timeout
        )
        if "error" in reply:
            raise SandboxError(f"write_file {path} failed: {reply['error']}")

    def read_file(self, path: str, timeout: float = 30, max_bytes: int = 64 * 1024 * 1024) -> bytes:
        reply = self.request({"op": "read_file", "path": path, "max_bytes": max_bytes}, timeout)
        if "error" in reply:
            raise SandboxError(f"read_file {path} failed: {reply['error']}")
        return base64.b64decode(reply["content_b64"])
