"""Sandboxes: one per rollout (bubblewrap by default, docker as the other backend), reached through a
control socket; resource limits, nested deadlines, a host-side watchdog and orphan reaping."""

from legorl.sandbox.base import Sandbox
from legorl.sandbox.client import ExecResult, SandboxClient, SandboxError
from legorl.sandbox.deadlines import DeadlineExceeded, Deadlines, RolloutClock
from legorl.sandbox.limits import SandboxLimits

__all__ = [
    "BwrapSandbox",
    "DeadlineExceeded",
    "Deadlines",
    "DockerSandbox",
    "ExecResult",
    "RolloutClock",
    "Sandbox",
    "SandboxClient",
    "SandboxError",
    "SandboxLimits",
    "create_sandbox",
    "reap_orphans",
    "reap_sandboxes",
    "sandbox_unavailable",
]


def __getattr__(name: str):  # lazy: the client stays importable without asyncio machinery
    if name in ("BwrapSandbox", "reap_orphans"):
        from legorl.sandbox import bwrap

        return getattr(bwrap, name)
    if name in ("create_sandbox", "reap_sandboxes", "sandbox_unavailable"):
        from legorl.sandbox import factory

        return getattr(factory, name)
    if name == "DockerSandbox":
        from legorl.sandbox.docker import DockerSandbox

        return DockerSandbox
    raise AttributeError(name)
