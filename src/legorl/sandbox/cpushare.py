"""A CPU share per sandbox, so that one busy sandbox cannot take the cores from the engine and the other rollouts.

Where the kernel offers a ``cpu`` cgroup controller this process may write to (cgroup v2 with ``cpu``
enabled, or the v1 ``cpu`` controller; as root both usually are), every sandbox gets a cgroup of its
own, ``legorl-<label>-<id>``, next to the driver's processes (v1: inside the driver's own cpu cgroup;
v2: at the root of the hierarchy, or next to the driver's cgroup, since a v2 cgroup that holds
processes cannot enable controllers for children):

* each sandbox weighs like one busy process (v1 ``cpu.shares`` 1024, v2 ``cpu.weight`` 100) against
  every other process there (the engine's threads, the trainer's, each other sandbox), however many
  processes it runs: a ``make -j16`` or a busy loop on every core gets one share, and a quiet sandbox
  next to it still gets its own, as does the engine;
* ``cpus`` (a task's ``limits.cpus``) caps it outright (v1 ``cpu.cfs_quota_us``, v2 ``cpu.max``).

The groups sit side by side, not under one ``legorl`` group: a common parent would weigh all
sandboxes together like a fixed number of processes, and on a host busy with other work every
sandbox command would then wait behind it (measured: a quiet sandbox's exec ~3x slower at a load
of 20 on 2 cores).

The bubblewrap backend moves the sandbox's first processes (bwrap, its init, the in-sandbox agent
and its zygote) into the cgroup once the agent is ready, before any command runs, so every command
inherits it; inside, the cgroup namespace shows it as ``/``, and nothing inside can move out
(``/sys`` is not mounted, and the files are root's). The cgroup is removed when the sandbox closes.

Elsewhere (no cgroup, or none writable: a non-root driver without a delegated cgroup) the
sandbox's processes run at nice ``NICE`` instead: the agent lowers its own priority before
anything runs, every command inherits it, and nothing inside can raise it back. A busy sandbox then
yields to the engine and to the host's other processes, but sandboxes compete with each other per
process: one running many busy processes takes a larger part than a quiet one. ``legorl doctor``
says which of the two this machine gets.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

NICE = 10  # the fallback: weight 110 against a normal process's 1024
PREFIX = "legorl-"  # the sandboxes' cgroups: PREFIX + label + id
V1_SHARES = 1024  # one normal process
V2_WEIGHT = 100  # one normal process
PERIOD_US = 100_000


@dataclass(frozen=True)
class Support:
    """What this machine offers: ``kind`` "cgroup2" / "cgroup1", the sandboxes' cgroups made in ``root``,
    or "nice" (no cgroup usable); ``detail`` says what and why, in words."""

    kind: Literal["cgroup2", "cgroup1", "nice"]
    root: Path | None
    detail: str


def cgroup_mounts() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fs type, super options) of every cgroup mount."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        pre, _, post = line.partition(" - ")
        f, p = pre.split(), post.split()
        if len(f) >= 5 and len(p) >= 3 and p[0] in ("cgroup", "cgroup2"):
            out.append((f[3], f[4].replace("\\040", " "), p[0], p[2]))
    return out


def _own(controller: str | None) -> str | None:
    """This process's cgroup path in the v1 hierarchy of ``controller`` (None: the v2 one)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if (controller is None and ctrls == "") or (controller is not None and controller in ctrls.split(",")):
            return path
    return None


def _under(mount_root: str, mount_point: str, path: str) -> Path | None:
    if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
        return None
    return Path(mount_point) / path[len(mount_root):].lstrip("/")


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _usable(parent: Path, kind: str) -> Path:
    """``parent`` once a sandbox cgroup can be made there with a CPU weight (v2: ``cpu`` enabled for
    its children); OSError if it cannot."""
    if kind == "cgroup2" and "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
        _write(parent / "cgroup.subtree_control", "+cpu")
    probe = parent / f"{PREFIX}probe-{os.getpid()}-{secrets.token_hex(3)}"
    probe.mkdir()
    try:
        _write(probe / ("cpu.shares" if kind == "cgroup1" else "cpu.weight"),
               str(V1_SHARES if kind == "cgroup1" else V2_WEIGHT))
    finally:
        probe.rmdir()
    return parent


def probe() -> Support:
    """Find a cpu controller this process can give sandboxes a share of (tries a cgroup, removes it)."""
    why: list[str] = []
    mounts = cgroup_mounts()
    for mroot, point, fstype, _ in mounts:  # cgroup v2 with the cpu controller
        if fstype != "cgroup2":
            continue
        try:
            controllers = (Path(point) / "cgroup.controllers").read_text().split()
        except OSError:
            controllers = []
        if "cpu" not in controllers:
            why.append(f"cgroup v2 at {point} without the cpu controller")
            continue
        own = _own(None)
        here = _under(mroot, point, own) if own is not None else None
        # A v2 cgroup holding processes cannot enable controllers for children: the root, or next to ours.
        for parent in dict.fromkeys(p for p in (Path(point), here and here.parent) if p is not None):
            try:
                return Support("cgroup2", _usable(parent, "cgroup2"),
                               f"cgroup v2: each sandbox in {parent}/{PREFIX}<sandbox>, cpu.weight {V2_WEIGHT} "
                               "(one busy process)")
            except OSError as e:
                why.append(f"cgroup v2: cannot make a cgroup in {parent}: {e.strerror or e}")
    for mroot, point, fstype, opts in mounts:  # the v1 cpu controller
        if fstype != "cgroup" or "cpu" not in opts.split(","):
            continue
        own = _own("cpu")
        here = _under(mroot, point, own) if own is not None else None
        if here is None:
            continue
        try:
            return Support("cgroup1", _usable(here, "cgroup1"),
                           f"cgroup v1 cpu controller: each sandbox in {here / PREFIX}<sandbox>, cpu.shares "
                           f"{V1_SHARES} (one busy process)")
        except OSError as e:
            why.append(f"cgroup v1 cpu at {point}: cannot make a cgroup in {here}: {e.strerror or e}")
    if not mounts:
        why.append("no cgroup file system mounted")
    elif not why:
        why.append("no cpu controller in any mounted cgroup hierarchy")
    return Support("nice", None, "; ".join(why))


@functools.cache
def support() -> Support:
    """``probe()``, once per process."""
    return probe()


def fallback_meaning() -> str:
    return (f"sandboxes run at nice {NICE} instead: a busy sandbox yields to the engine and the host's other "
            "processes, but sandboxes share the cores per process, so one running many busy processes takes "
            "more than its part from the other rollouts (run the driver as root, or give it a cgroup with the "
            "cpu controller delegated)")


@dataclass
class CpuShare:
    """One sandbox's share: a cgroup (``path``), or only ``nice`` where there is none."""

    kind: Literal["cgroup2", "cgroup1", "nice"]
    path: Path | None = None
    nice: int | None = None

    @classmethod
    def create(cls, name: str, cpus: float | None = None) -> CpuShare:
        """A cgroup for one sandbox (``name``: anything; made unique), or the nice fallback."""
        try:
            cpus = float(cpus) if cpus else None  # a task's limits.cpus may come as a string
        except (TypeError, ValueError):
            cpus = None
        sup = support()
        if sup.root is None:
            return cls("nice", nice=NICE)
        slug = re.sub(r"[^A-Za-z0-9_.-]", "-", name)[:40] + "-" + secrets.token_hex(4)
        path = sup.root / (PREFIX + slug)
        try:
            path.mkdir()
            if sup.kind == "cgroup1":
                _write(path / "cpu.shares", str(V1_SHARES))
                if cpus:
                    _write(path / "cpu.cfs_period_us", str(PERIOD_US))
                    _write(path / "cpu.cfs_quota_us", str(max(1000, int(cpus * PERIOD_US))))
            else:
                _write(path / "cpu.weight", str(V2_WEIGHT))
                if cpus:
                    _write(path / "cpu.max", f"{max(1000, int(cpus * PERIOD_US))} {PERIOD_US}")
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            return cls("nice", nice=NICE)
        return cls(sup.kind, path=path)

    def attach(self, pids: Iterable[int]) -> bool:
        """Move these processes (each with all its threads) into the cgroup; False if that failed."""
        if self.path is None:
            return False
        try:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    _write(self.path / "cgroup.procs", str(pid))
        except OSError:
            return False
        return True

    def remove(self) -> bool:
        """Remove the cgroup (its processes gone); False while it still holds some."""
        if self.path is None:
            return True
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True


def remove_empty() -> int:
    """Remove the empty sandbox cgroups left by earlier runs (a live sandbox's is never empty); how many."""
    root = support().root
    n = 0
    if root is None or not root.is_dir():
        return n
    for d in root.glob(PREFIX + "*"):
        if d.is_dir():
            try:
                d.rmdir()
                n += 1
            except OSError:
                pass
    return n
