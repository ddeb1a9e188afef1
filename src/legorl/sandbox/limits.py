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

from legorl.config import MiB, SandboxLimits  # the limits are settings: defined with the others

__all__ = ["UNLIMITED", "MiB", "SandboxLimits"]

UNLIMITED = SandboxLimits(
    processes=None, memory_mb=None, cpu_seconds=None, file_size_mb=None, open_files=None, workspace_mb=None,
    tmp_mb=None,
)  # fmt: skip
