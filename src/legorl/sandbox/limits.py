"""Resource limits of one sandbox, so that a fork bomb, a memory bomb or a disk filler kills only its rollout.

Two mechanisms, both portable (no cgroup delegation needed):

* kernel rlimits set by the in-sandbox agent on itself (inherited by every command):
  ``processes`` (RLIMIT_NPROC, counted per user namespace on Linux >= 5.14, so per sandbox),
  ``memory_mb`` (RLIMIT_DATA per process: private writable memory, which unlike RLIMIT_AS
  leaves V8/Go address-space reservations alone), ``file_size_mb`` (RLIMIT_FSIZE),
  ``open_files`` (RLIMIT_NOFILE), no core dumps; ``cpu_seconds`` (RLIMIT_CPU) is set on each
  command (not on the agent, which lives for the whole rollout);
* a host-side watchdog (``watchdog.py``) that kills the sandbox when the anonymous memory of
  all its processes together exceeds ``memory_mb``, when the workspace grows past
  ``workspace_mb``, or when the sandbox outlives ``lifetime_s``.

``/tmp`` and ``/dev/shm`` are tmpfs mounts of ``tmp_mb`` each (writes past it get ENOSPC).
RLIMIT_NPROC is ignored for host uid 0, which is why a root driver runs sandboxes under an
unprivileged uid (see ``bwrap.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

MiB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    processes: int | None = 1024  # tasks (processes + threads) inside the sandbox
    memory_mb: int | None = 8192  # total anonymous memory (watchdog) and per-process RLIMIT_DATA
    address_space_mb: int | None = None  # RLIMIT_AS per process; off: it breaks node and the JVM
    cpu_seconds: int | None = 3600  # RLIMIT_CPU of each command's process tree (per process)
    file_size_mb: int | None = 2048  # largest file a process may write
    open_files: int | None = 4096
    workspace_mb: int | None = 8192  # disk used under the workspace (watchdog)
    tmp_mb: int | None = 1024  # size of the /tmp and /dev/shm tmpfs mounts
    lifetime_s: float | None = None  # hard stop for the whole sandbox (set from Deadlines)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and v <= 0:
                raise ValueError(f"sandbox limit {f.name} must be > 0 or None (unlimited), got {v}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SandboxLimits:
        """From a config mapping; unknown keys are an error naming the known ones."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(d) - known):
            raise ValueError(f"unknown sandbox limit(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> SandboxLimits:
        return replace(self, **changes)

    def agent_arg(self) -> str:
        """`name=value,...` for the in-sandbox agent (parsed there without importing json)."""
        values = {
            "nproc": self.processes,
            "data": self.memory_mb and self.memory_mb * MiB,
            "as": self.address_space_mb and self.address_space_mb * MiB,
            "cpu": self.cpu_seconds,
            "fsize": self.file_size_mb and self.file_size_mb * MiB,
            "nofile": self.open_files,
        }
        return ",".join(f"{k}={v}" for k, v in values.items() if v is not None)


UNLIMITED = SandboxLimits(
    processes=None, memory_mb=None, cpu_seconds=None, file_size_mb=None, open_files=None, workspace_mb=None,
    tmp_mb=None,
)  # fmt: skip
