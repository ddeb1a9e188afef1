"""Host-side watchdog: kills a sandbox that outgrows its memory, workspace or lifetime, or whose agent
reports it can no longer run commands (its process budget exhausted).

One daemon thread per host process watches every live sandbox (it cannot be killed from
inside a sandbox, unlike anything running there). Each tick it reads /proc once, sums the
anonymous memory of each sandbox's processes (its process tree, and every process of the pid
namespaces that tree's processes entered, so a process put into the sandbox from outside, such as
a prefork server's runner (harness/prefork.py), counts too), checks lifetimes, and walks workspaces on
an adaptive schedule (a big repo is walked less often). A sandbox over a limit is killed
whole and its ``violation`` says why; the next request to it raises SandboxError with that
reason.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from legorl.sandbox.procs import (
    anon_kib,
    children_map,
    kill_tree,
    namespace_members,
    pid_namespace,
    process_tree,
)

TICK_S = 0.25
MIN_WALK_INTERVAL_S = 0.5


def disk_usage(root: Path, stop_after: int | None = None) -> int:
    """Bytes allocated under root (st_blocks, hard links counted once); stops early past stop_after."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [str(root)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except OSError:
            continue
        with it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
        if stop_after is not None and total > stop_after:
            break
    return total


@dataclass(eq=False)
class Watch:
    pid: int
    label: str
    workspace: Path | None = None
    memory_bytes: int | None = None
    workspace_bytes: int | None = None
    deadline: float | None = None  # time.monotonic() value
    violation: str = ""
    peak_memory_bytes: int = 0
    workspace_used_bytes: int = 0
    on_kill: Callable[[], None] | None = None  # backends whose processes are not our children (docker)
    failure_file: Path | None = None  # where the in-sandbox agent says it can no longer run commands
    on_violation: Callable[[], None] | None = None  # told once the sandbox is killed (the rollout's guard)
    _next_walk: float = field(default=0.0, repr=False)

    def kill(self, reason: str) -> None:
        if not self.violation:
            self.violation = reason
        if self.on_kill is not None:
            self.on_kill()
        else:
            kill_tree(self.pid)
        if self.on_violation is not None:
            try:
                self.on_violation()
            except Exception:  # noqa: BLE001, S110 - a listener gone (its loop closed) changes nothing here
                pass

    def agent_failure(self) -> str:
        """What the agent wrote to its failure file ("" while it has nothing to report)."""
        if self.failure_file is None:
            return ""
        try:
            if os.stat(self.failure_file).st_size == 0:
                return ""
            return self.failure_file.read_text(errors="replace").strip()[:2000]
        except OSError:
            return ""


def sandbox_processes(roots: list[int]) -> dict[int, set[int]]:
    """Each root's processes: its process tree, and every process of the pid namespaces the tree's
    processes are in other than the watchdog's own (the sandbox's, whoever started the process)."""
    children = children_map()
    trees = {root: set(process_tree(root, children)) for root in roots}
    host = pid_namespace("self")
    spaces = {root: {ns for p in tree if (ns := pid_namespace(p)) not in (None, host)} for root, tree in trees.items()}
    members = namespace_members(set().union(*spaces.values()))
    return {root: tree.union(*(members.get(ns, ()) for ns in spaces[root])) for root, tree in trees.items()}


class Watchdog:
    def __init__(self, tick: float = TICK_S) -> None:
        self.tick = tick
        self._watches: set[Watch] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, watch: Watch) -> Watch:
        with self._lock:
            self._watches.add(watch)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="legorl-sandbox-watchdog", daemon=True)
                self._thread.start()
        return watch

    def remove(self, watch: Watch) -> None:
        with self._lock:
            self._watches.discard(watch)

    def _run(self) -> None:
        while True:
            time.sleep(self.tick)
            with self._lock:
                watches = list(self._watches)
            if watches:
                try:
                    self.check(watches)
                except Exception:  # noqa: BLE001, S110 - the watchdog must outlive any one bad tick
                    pass

    def check(self, watches: list[Watch]) -> None:
        now = time.monotonic()
        memory = [w for w in watches if w.memory_bytes and not w.violation]
        processes = sandbox_processes([w.pid for w in memory]) if memory else {}
        for w in watches:
            if w.violation:
                continue
            if w.deadline is not None and now > w.deadline:
                w.kill("sandbox lifetime exceeded")
                continue
            if failure := w.agent_failure():  # e.g. its process budget is exhausted: no command can start
                w.kill(failure)
                continue
            if w.memory_bytes:
                used = 1024 * sum(anon_kib(p) for p in processes.get(w.pid, ()))
                w.peak_memory_bytes = max(w.peak_memory_bytes, used)
                if used > w.memory_bytes:
                    w.kill(f"memory limit exceeded: {used >> 20} MiB > {w.memory_bytes >> 20} MiB")
                    continue
            if w.workspace_bytes and w.workspace is not None and now >= w._next_walk:
                t = time.monotonic()
                used = disk_usage(w.workspace, stop_after=w.workspace_bytes)
                w.workspace_used_bytes = used
                w._next_walk = time.monotonic() + max(MIN_WALK_INTERVAL_S, 20 * (time.monotonic() - t))
                if used > w.workspace_bytes:
                    w.kill(f"workspace size limit exceeded: {used >> 20} MiB > {w.workspace_bytes >> 20} MiB")


WATCHDOG = Watchdog()
