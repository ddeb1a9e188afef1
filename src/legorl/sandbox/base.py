"""The Sandbox protocol the rest of legorl codes against (bubblewrap is the default backend, docker the other)."""

from __future__ import annotations

from collections.abc import Awaitable
from pathlib import Path
from typing import Protocol, TypeVar

from legorl.sandbox.client import ExecResult

T = TypeVar("T")


class Sandbox(Protocol):
    workspace: Path  # host path of the task repo
    inside_workspace: str  # the same dir as seen inside ("/workspace" unless the task says otherwise)
    control_socket: Path  # host path; SandboxClient(control_socket) works from any process
    relay_port: int  # 127.0.0.1:<relay_port> inside reaches the LLM proxy (when one was given)
    label: str  # the run's label: every sandbox of a run carries it, for reaping

    @property
    def violation(self) -> str: ...  # why the watchdog killed it ("" while within its limits)

    async def exec(
        self, command: str, timeout: float = 30, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> ExecResult: ...

    async def write_file(self, path: str, content: str | bytes) -> None: ...

    async def read_file(self, path: str, max_bytes: int = ...) -> bytes: ...

    async def quiesce(self, timeout: float = ...) -> list[str]: ...  # end what its commands left running

    async def guard(self, work: Awaitable[T]) -> T: ...  # await work; SandboxError if the sandbox is killed first

    async def close(self) -> None: ...
