"""Sandboxes: a bubblewrap sandbox per rollout, reached through a control socket."""

from legorl.sandbox.base import Sandbox
from legorl.sandbox.client import ExecResult, SandboxClient, SandboxError

__all__ = ["BwrapSandbox", "ExecResult", "Sandbox", "SandboxClient", "SandboxError", "reap_orphans"]


def __getattr__(name: str):  # lazy: the client stays importable without asyncio machinery
    if name in ("BwrapSandbox", "reap_orphans"):
        from legorl.sandbox import bwrap

        return getattr(bwrap, name)
    raise AttributeError(name)
