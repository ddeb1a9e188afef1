"""The Sandbox protocol the rest of legorl codes against (bubblewrap is the default backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from legorl.sandbox.client import ExecResult


class Sandbox(Protocol):
    workspace: Path  # host path of the task repo
    inside_workspace: str  # the same dir as seen inside ("/workspace")
    control_socket: Path  # host path; SandboxClient(control_socket) works from any process
    relay_port: int  # 127.0.0.1:<relay_port> inside reaches the LLM proxy (when one was given)

    async def exec(
        self, command: str, timeout: float = 30, cwd: str = "/workspace", env: dict[str, str] | None = None
    ) -> ExecResult: ...

    async def write_file(self, path: str, content: str | bytes) -> None: ...

    async def close(self) -> None: ...
