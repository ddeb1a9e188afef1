"""Host process-tree helpers (from /proc): descendants, kill, memory, command lines."""

from __future__ import annotations

import os
import signal


def children_map() -> dict[int, list[int]]:
    from legorl.sandbox.sandbox_agent import scan_processes  # the agent's /proc reader (stdlib only)

    children: dict[int, list[int]] = {}
    for pid, (ppid, *_rest) in scan_processes().items():
        children.setdefault(ppid, []).append(pid)
    return children


def process_tree(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """pid and all its descendants (parents first)."""
    children = children_map() if children is None else children
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def pid_namespace(pid: int | str) -> int | None:
    """The inode of pid's pid namespace (None when it is gone or hidden)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def namespace_members(namespaces: set[int]) -> dict[int, list[int]]:
    """Every visible process of each pid namespace in `namespaces`: namespace inode -> pids."""
    members: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (ns := pid_namespace(name)) in namespaces:
            members.setdefault(ns, []).append(int(name))
    return members


def kill_tree(pid: int) -> None:
    """SIGKILL pid and its descendants. Stopping the sandbox's pid-namespace init takes the rest
    down with it; the explicit walk covers processes that are mid-fork."""
    for _ in range(2):
        for p in process_tree(pid):
            try:
                os.kill(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def anon_kib(pid: int) -> int:
    """Private anonymous memory (RssAnon) of one process, KiB; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False
