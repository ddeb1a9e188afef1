"""A pool of pre-started bubblewrap sandboxes (``sandbox.pool_size``), handed out with their workspace in
about a millisecond instead of a ~20-200 ms start.

A pooled sandbox is started like any other (``BwrapSandbox.create``: namespaces, mounts, limits, CPU share,
the in-sandbox agent up and its zygote forked) in a *slot*, ``<sandbox_dir's parent>/.pool/<id>``, whose
``ws`` dir, empty, is bound at the inside workspace. Nothing runs in it while it waits. At hand-out:

* the caller's prepared workspace moves in: each of its top-level entries is renamed into ``ws``, then
  ``ws`` itself is renamed to the caller's workspace path. A bind mount holds the directory, not its path,
  so the sandbox now shows exactly the caller's files, and the host path the caller gave is the same
  directory (diffs, the watchdog's size walk, ``keep_workspaces``). Renames only: same file system, no copy;
* the slot's control dir, passwd files, log and empty dir move into the caller's ``sandbox_dir``, so a
  handed-out sandbox is laid out like a fresh one (``control_socket`` is ``<sandbox_dir>/ctl/control.sock``);
  its ``label.json`` records where bwrap bound the control dir from, for ``reap_orphans``;
* a root driver chowns the workspace to the sandbox's own uid (as a fresh start does), and the sandbox goes
  under the watchdog, its lifetime counted from now.

Each pooled sandbox is handed out once and never returns to the pool: it never held another rollout's
workspace, and nothing ran in it before its user. Its ``/tmp`` is its own fresh tmpfs, like any sandbox's.

What a sandbox is started with (label, proxy socket, relay port, hidden and visible paths, read-only binds
such as a task environment, environment variables, inside workspace, uid, CPU cap, the limits the agent
applies) is its ``PoolKey``; a request is served from the pool only by a sandbox of the same key, else it
starts fresh. A key is pooled once it has been asked for ``POOL_AFTER`` times (a one-off, such as a grading
sandbox with its own result dir, never is), and the pool keeps up to ``size`` sandboxes waiting or starting,
all keys together, refilled in the background ``FILL_PARALLEL`` at a time; when full, the waiting sandbox of
the key asked for least recently makes room. A request that finds none waiting but a start in flight for its
key takes that one rather than starting another.

One pool per event loop (its sandboxes' processes belong to that loop). ``close_pools`` (called by
``reap_sandboxes`` at the end of a run) ends them; a loop ended by ``asyncio.run`` ends its pool too (its
keeper task is cancelled there), and a driver that dies takes them along (each agent's lifeline).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import stat
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.sandbox.bwrap import BwrapSandbox
from legorl.sandbox.bwrap import discarding as bwrap_discarding
from legorl.sandbox.control import open_to
from legorl.sandbox.limits import SandboxLimits
from legorl.sandbox.procs import cmdline, kill_tree

__all__ = ["POOL_AFTER", "PoolKey", "PoolStats", "SandboxPool", "close_pools", "pool_for", "pool_key"]

POOL_AFTER = 3  # requests of one key before it is pooled: one-offs (a grading's own result dir) never are
FILL_PARALLEL = 2  # background starts at once: each is mostly CPU (bwrap, CPython), and rollouts need it too
FAILURE_BACKOFF_S = 10.0  # after a pooled start failed, that key waits this long before the next try
KEYS_REMEMBERED = 256
END_WAIT_S = 10.0  # at the loop's end, how long cancelled starts get to be ended
CHOWN_INLINE = 512  # workspace entries a root driver chowns on the loop at hand-out; more go to a thread
POOL_DIR = ".pool"
SLOT_FILES = ("ctl", "empty", "etc", "bwrap.log")  # what a slot holds besides its workspace and label.json
PER_REQUEST = ("workspace", "sandbox_dir", "start_timeout")  # create_sandbox arguments a hand-out brings


def _ident(path: Path | str) -> tuple[str, int, int]:
    """A path and what is there now (device, inode; 0, 0 if nothing): a socket or dir made anew differs."""
    try:
        st = os.stat(path)
    except OSError:
        return str(path), 0, 0
    return str(path), st.st_dev, st.st_ino


@dataclass(frozen=True)
class PoolKey:
    """What a sandbox is started with, beyond its workspace and dir: equal keys, interchangeable sandboxes."""

    root: str  # the slots' dir
    device: int  # its file system: a workspace elsewhere cannot be renamed in
    label: str
    proxy: tuple[str, int, int] | None
    relay_port: int
    hide: tuple[tuple[str, int, int], ...]
    visible: tuple[tuple[str, int, int], ...]
    ro_binds: tuple[tuple[str, tuple[str, int, int]], ...]
    env: tuple[tuple[str, str], ...]
    inside_workspace: str
    agent_limits: str  # the rlimits the agent sets on itself at start
    tmp_mb: int | None
    uid: int | None
    cpus: float | None


def pool_key(spec: dict[str, Any]) -> PoolKey | None:
    """The key of a ``create_sandbox`` request (its backend arguments), or None when it cannot be pooled."""
    sandbox_dir = os.path.abspath(spec["sandbox_dir"])  # not realpath: an lstat per component, on every request
    workspace = os.path.abspath(spec["workspace"])
    if workspace == sandbox_dir or sandbox_dir.startswith(workspace + "/"):
        return None  # its control dir would land inside the workspace
    parent = os.path.dirname(sandbox_dir)
    root = os.path.join(parent, POOL_DIR)
    try:
        device = os.stat(parent).st_dev
    except OSError:
        return None
    limits: SandboxLimits = spec.get("limits") or SandboxLimits()
    proxy = spec.get("proxy_socket")
    return PoolKey(
        root=str(root), device=device, label=spec["label"], proxy=_ident(proxy) if proxy is not None else None,
        relay_port=spec["relay_port"], hide=tuple(_ident(p) for p in spec.get("hide_paths") or ()),
        visible=tuple(_ident(p) for p in spec.get("visible_paths") or ()),
        ro_binds=tuple(sorted((k, _ident(v)) for k, v in (spec.get("ro_binds") or {}).items())),
        env=tuple(sorted((spec.get("env") or {}).items())), inside_workspace=spec["inside_workspace"],
        agent_limits=limits.agent_arg(), tmp_mb=limits.tmp_mb, uid=spec.get("sandbox_uid"), cpus=spec.get("cpus"),
    )  # fmt: skip


@dataclass
class PoolStats:
    """Counts since the pool was made: ``hits`` handed out from those waiting, ``claimed`` taken from a start
    in flight, ``misses`` started fresh, ``started`` / ``failed`` background starts, ``retired`` closed unused."""

    hits: int = 0
    claimed: int = 0
    misses: int = 0
    started: int = 0
    failed: int = 0
    retired: int = 0
    last_error: str = ""


@dataclass(eq=False)
class _Kind:
    """The sandboxes of one key: waiting, starting, and the requests waiting on a start in flight."""

    key: PoolKey
    spec: dict[str, Any]
    idle: deque[BwrapSandbox] = field(default_factory=deque)
    starting: int = 0  # background starts, queued or running
    running: int = 0  # of which running now: a request may claim one of those
    waiters: deque[asyncio.Future] = field(default_factory=deque)
    requests: int = 0
    last_request: float = 0.0
    retry_at: float = 0.0
    fills: set[asyncio.Task] = field(default_factory=set)
    closed: bool = False

    def live_waiters(self) -> int:
        return sum(not w.done() for w in self.waiters)


class SandboxPool:
    """Pre-started sandboxes of the running loop; ``create`` is ``BwrapSandbox.create`` served from it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.stats = PoolStats()
        self.closed = False
        self._kinds: OrderedDict[PoolKey, _Kind] = OrderedDict()
        self._sem = asyncio.Semaphore(FILL_PARALLEL)
        self._retiring: set[asyncio.Task] = set()
        self._abandoned: set[str] = set()  # slots of starts cancelled midway
        self._slots_to_remove: list[Path] = []  # emptied slots of handed-out sandboxes
        self._remover: asyncio.Task | None = None
        self._keeper = asyncio.get_running_loop().create_task(self._keep(), name="legorl-sandbox-pool")

    # ---- requests -------------------------------------------------------------------------------------
    async def create(self, spec: dict[str, Any]) -> BwrapSandbox:
        """A sandbox for ``spec`` (``BwrapSandbox.create``'s arguments): a pooled one when one of its key is
        waiting or starting, else a fresh start."""
        key = None if self.closed or self.size <= 0 else pool_key(spec)
        if key is None:
            return await BwrapSandbox.create(**spec)
        kind = self._note(key, spec)
        fits = _can_hand_out(key, spec)
        box = self._take(kind) if fits else None
        if box is None:
            self._level(kind)
            if fits and kind.running > kind.live_waiters():
                box = await self._claim(kind, spec.get("start_timeout", 20.0))
        if box is None:
            self.stats.misses += 1
            return await BwrapSandbox.create(**spec)
        try:
            slot = box.pool_slot
            box = await hand_out(box, spec)
            self._level(kind)  # the refill, once this one is out: its spawn would hold the loop up
            self._trash(slot)
            return box
        except BaseException as e:
            await asyncio.shield(_discard(box))  # it may have seen the workspace: never back to the pool
            if not isinstance(e, OSError):
                raise
            self.stats.last_error = f"hand-out failed: {e}"
            self.stats.misses += 1
            return await BwrapSandbox.create(**spec)

    def waiting(self, spec: dict[str, Any] | None = None) -> int:
        """Sandboxes waiting (of ``spec``'s key, or all)."""
        if spec is None:
            return sum(len(k.idle) for k in self._kinds.values())
        kind = self._kinds.get(pool_key(spec))  # type: ignore[arg-type]
        return len(kind.idle) if kind is not None else 0

    async def prewarm(self, spec: dict[str, Any], n: int, timeout: float = 300.0) -> int:
        """Start sandboxes of ``spec``'s key until ``n`` wait (at most ``size``), and wait for them; returns
        how many wait. For benchmarks, and for a run that knows what it will ask for."""
        key = pool_key(spec)
        if key is None or self.closed:
            return 0
        kind = self._note(key, spec, request=False)
        kind.requests = max(kind.requests, POOL_AFTER)
        deadline = time.monotonic() + timeout
        while len(kind.idle) < min(n, self.size) and time.monotonic() < deadline:
            self._level(kind, want=n)
            if kind.starting == 0 and len(kind.idle) < min(n, self.size):
                break  # nothing more can start (failures back off)
            await asyncio.sleep(0.01)
        return len(kind.idle)

    def _note(self, key: PoolKey, spec: dict[str, Any], request: bool = True) -> _Kind:
        kind = self._kinds.get(key)
        if kind is None:
            kind = self._kinds[key] = _Kind(key, {k: v for k, v in spec.items() if k not in PER_REQUEST})
            self._forget_old()
        self._kinds.move_to_end(key)
        if request:
            kind.requests += 1
            kind.last_request = time.monotonic()
        return kind

    def _forget_old(self) -> None:
        """Bound what is remembered: drop the oldest keys that have nothing waiting or starting."""
        for key in list(self._kinds)[: max(0, len(self._kinds) - KEYS_REMEMBERED)]:
            kind = self._kinds[key]
            if not kind.idle and not kind.starting:
                del self._kinds[key]

    def _take(self, kind: _Kind) -> BwrapSandbox | None:
        while kind.idle:
            box = kind.idle.popleft()
            if box.proc.returncode is None:
                self.stats.hits += 1
                return box
            self._retire(box)  # died while waiting
        return None

    async def _claim(self, kind: _Kind, timeout: float) -> BwrapSandbox | None:
        """Wait for a start in flight of this key (None if it fails or takes longer than ``timeout``)."""
        waiter = asyncio.get_running_loop().create_future()
        kind.waiters.append(waiter)
        try:
            box = await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except TimeoutError:
            box = None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._deposit(kind, waiter.result())  # handed to us as we were cancelled: keep it
            waiter.cancel()
            raise
        finally:
            with contextlib.suppress(ValueError):
                kind.waiters.remove(waiter)
        if box is None:
            waiter.cancel()
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self._deposit(kind, waiter.result())  # arrived just after the timeout
            return None
        self.stats.claimed += 1
        return box

    # ---- filling --------------------------------------------------------------------------------------
    def _total(self) -> int:
        return sum(len(k.idle) + k.starting for k in self._kinds.values())

    def _level(self, kind: _Kind, want: int | None = None) -> None:
        """Start sandboxes of ``key`` in the background until ``want`` (default ``size``) wait or start for it,
        the whole pool holding at most ``size``; room is made by retiring the least recently asked-for kind."""
        if kind.closed or self.closed or kind.requests < POOL_AFTER or time.monotonic() < kind.retry_at:
            return
        want = min(self.size, want if want is not None else self.size)
        while len(kind.idle) + kind.starting - kind.live_waiters() < want:
            if self._total() >= self.size and not self._make_room(kind):
                return
            kind.starting += 1
            task = asyncio.get_running_loop().create_task(self._start_one(kind))
            kind.fills.add(task)
            task.add_done_callback(kind.fills.discard)

    def _make_room(self, kind: _Kind) -> bool:
        others = [k for k in self._kinds.values() if k is not kind and k.idle]
        if not others:
            return False
        oldest = min(others, key=lambda k: k.last_request)
        self._retire(oldest.idle.pop())
        return True

    async def _start_one(self, kind: _Kind) -> None:
        box = None
        slot = None
        try:
            async with self._sem:
                if kind.closed or self.closed:
                    return
                kind.running += 1
                try:
                    slot = Path(kind.key.root) / secrets.token_hex(8)
                    (slot / "ws").mkdir(parents=True)
                    box = await BwrapSandbox.create(**kind.spec, workspace=slot / "ws", sandbox_dir=slot, watch=False)
                finally:
                    kind.running -= 1
                box.pool_slot = slot
                self.stats.started += 1
        except Exception as e:  # noqa: BLE001 - a failed background start: requests start fresh, see it there
            self.stats.failed += 1
            self.stats.last_error = f"{type(e).__name__}: {e}"
            kind.retry_at = time.monotonic() + FAILURE_BACKOFF_S
            if slot is not None:
                self._trash(slot)
        except asyncio.CancelledError:
            if slot is not None:
                self._abandoned.add(str(slot))  # its bwrap may still come up: _keep makes sure it goes
            raise
        finally:
            kind.starting -= 1
            if box is not None:
                self._deposit(kind, box)
            else:
                self._wake_one(kind, None)

    def _deposit(self, kind: _Kind, box: BwrapSandbox) -> None:
        """A started sandbox: to the first request waiting for one, else it waits in the pool."""
        if kind.closed or self.closed:
            self._retire(box)
        elif not self._wake_one(kind, box):
            kind.idle.append(box)

    def _wake_one(self, kind: _Kind, box: BwrapSandbox | None) -> bool:
        for waiter in kind.waiters:
            if not waiter.done():
                waiter.set_result(box)
                return True
        return False

    def _trash(self, slot: Path | None) -> None:
        """Remove a handed-out sandbox's emptied slot later, in one thread for a burst of hand-outs (removing a
        dir costs ~7 ms on some file systems, and a thread per slot more than the hand-out itself)."""
        if slot is None:
            return
        self._slots_to_remove.append(slot)
        if self._remover is None or self._remover.done():
            self._remover = asyncio.get_running_loop().create_task(self._remove_slots())

    async def _remove_slots(self) -> None:
        await asyncio.sleep(0.1)  # let the burst of hand-outs finish first
        while self._slots_to_remove:
            slots, self._slots_to_remove = self._slots_to_remove, []
            await asyncio.to_thread(_rmtrees, slots)

    def _retire(self, box: BwrapSandbox) -> None:
        self.stats.retired += 1
        task = asyncio.get_running_loop().create_task(_discard(box))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    # ---- shutting down --------------------------------------------------------------------------------
    async def close(self, under: Path | None = None) -> None:
        """Close every waiting sandbox (those whose slots lie under ``under``, or all, which closes the pool),
        once the starts in flight for them have finished. Idempotent."""
        roots = {os.path.abspath(under), os.path.realpath(under)} if under is not None else set()
        kinds = [k for key, k in self._kinds.items() if not roots or any(_below(key.root, r) for r in roots)]
        if not roots:
            self.closed = True
        for kind in kinds:
            kind.closed = True
        fills = [t for k in kinds for t in k.fills]
        await asyncio.gather(*fills, return_exceptions=True)
        for kind in kinds:
            while kind.idle:
                self._retire(kind.idle.pop())
            while self._wake_one(kind, None):  # the requests waiting on a start start fresh
                pass
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._remover is not None:
            await asyncio.gather(self._remover, return_exceptions=True)
        for key in [key for key, k in self._kinds.items() if k in kinds]:
            del self._kinds[key]  # a later run under the same dir starts counting again
            with contextlib.suppress(OSError):
                Path(key.root).rmdir()
        if not roots and self._keeper is not asyncio.current_task():
            self._keeper.cancel()

    async def _keep(self) -> None:
        """Idle until the loop's end: ``asyncio.run`` cancels every task there, and this one closes the pool,
        starts in flight included: their cancelled creations hand the sandbox to a discarding task
        (bwrap.py), awaited here so that the loop ends only once those are gone too."""
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()
            # A start cancelled midway (asyncio.run cancels every task at once) hands its bwrap to a discarding
            # task (bwrap.py) that would wait for the agent's ready line: end those bwraps now, and wait for it.
            deadline = time.monotonic() + END_WAIT_S
            while self._abandoned and (pending := bwrap_discarding()) and time.monotonic() < deadline:
                for pid in _bwraps_naming(self._abandoned):
                    kill_tree(pid)
                await asyncio.wait(pending, timeout=0.05)
            for slot in self._abandoned:
                shutil.rmtree(slot, ignore_errors=True)


async def _discard(box: BwrapSandbox) -> None:
    await box.close()
    if box.pool_slot is not None:
        await asyncio.to_thread(shutil.rmtree, box.pool_slot, True)


async def hand_out(box: BwrapSandbox, spec: dict[str, Any]) -> BwrapSandbox:
    """Give the pooled ``box`` the request's workspace and sandbox dir (see the module doc); OSError when the
    workspace cannot move in (then it is where it was)."""
    assert box.pool_slot is not None
    slot = box.pool_slot
    workspace = Path(os.path.realpath(spec["workspace"]))
    sandbox_dir = Path(os.path.realpath(spec["sandbox_dir"]))
    if not os.path.isdir(sandbox_dir):
        sandbox_dir.mkdir(parents=True, exist_ok=True)
    _move_in(workspace, slot / "ws", slot / "was")
    for name in SLOT_FILES:
        if os.path.lexists(slot / name):
            os.replace(slot / name, sandbox_dir / name)  # over an empty dir of that name, if any
    (sandbox_dir / "label.json").write_text(json.dumps({  # what reap_orphans finds after a killed run
        "label": box.label, "bwrap_pid": box.proc.pid, "started": time.time(), "uid": box.ids and box.ids[0],
        "ctl": str(slot / "ctl"),
    }))  # fmt: skip
    box.pool_slot = None  # the slot (its label.json, the emptied dir) is the pool's to remove
    box.workspace, box.sandbox_dir = workspace, sandbox_dir
    box.control_socket = sandbox_dir / "ctl" / "control.sock"
    if box.ids is not None and not _chown_small(workspace, box.ids):
        await open_to(box.ids, workspace, None)  # a large tree: in a thread (the proxy socket was opened at start)
    box._watch(spec.get("limits") or SandboxLimits(), box.proc.pid, memory=True)
    return box


def _can_hand_out(key: PoolKey, spec: dict[str, Any]) -> bool:
    """Whether a pooled sandbox can take this request: its workspace a dir on the slots' file system, and
    nothing in its sandbox dir that the slot's files would replace (else it starts fresh, and fails there
    with the reason if the request itself is wrong)."""
    try:
        if os.stat(spec["workspace"]).st_dev != key.device or not os.path.isdir(spec["workspace"]):
            return False
    except OSError:
        return False
    try:
        present = set(os.listdir(spec["sandbox_dir"])) & {*SLOT_FILES, "label.json"}
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return not any(_occupied(Path(spec["sandbox_dir"]) / n) for n in present)


def _chown_small(root: Path, ids: tuple[int, int], budget: int = CHOWN_INLINE) -> bool:
    """chown a tree of at most ``budget`` entries right here (a thread hop costs more on a loaded host);
    False, having changed part of it, when it is larger."""
    os.lchown(root, *ids)
    todo = [str(root)]
    while todo:
        with os.scandir(todo.pop()) as it:
            for entry in it:
                budget -= 1
                if budget < 0:
                    return False
                with contextlib.suppress(FileNotFoundError):
                    os.lchown(entry.path, *ids)
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
    return True


def _bwraps_naming(slots: set[str]) -> list[int]:
    """bwrap processes whose command line names one of ``slots`` (bound from there)."""
    found = []
    for name in os.listdir("/proc"):
        cmd = cmdline(int(name)) if name.isdigit() else []
        if cmd and os.path.basename(cmd[0]) == "bwrap" and any(a.startswith(s + "/") for a in cmd for s in slots):
            found.append(int(name))
    return found


def _rmtrees(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def _below(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _occupied(path: Path) -> bool:
    """Whether ``path`` holds something a hand-out would overwrite (an empty dir does not count)."""
    if not os.path.lexists(path):
        return False
    return not (path.is_dir() and not path.is_symlink() and not any(path.iterdir()))


def _move_in(workspace: Path, ws: Path, aside: Path) -> None:
    """Rename the entries of ``workspace`` into the (bound, empty) ``ws``, the emptied ``workspace`` to ``aside``
    and ``ws`` to ``workspace``'s path. On failure, what moved goes back and OSError is raised."""
    src = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)  # renames relative to both dirs: no path walks
    try:
        dst = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fchmod(dst, stat.S_IMODE(os.fstat(src).st_mode))
            _swap(src, dst, workspace, ws, aside)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _swap(src: int, dst: int, workspace: Path, ws: Path, aside: Path) -> None:
    moved: list[str] = []
    try:
        for name in os.listdir(src):
            os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)
            moved.append(name)
        os.rename(workspace, aside)
    except OSError:
        for name in moved:  # put the entries back
            with contextlib.suppress(OSError):
                os.rename(name, name, src_dir_fd=dst, dst_dir_fd=src)
        raise
    try:
        os.rename(ws, workspace)
    except OSError:
        os.rename(aside, workspace)
        for name in moved:
            with contextlib.suppress(OSError):
                os.rename(name, name, src_dir_fd=dst, dst_dir_fd=src)
        raise


_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, SandboxPool] = weakref.WeakKeyDictionary()


def pool_for(size: int) -> SandboxPool:
    """The running loop's pool (made on first use), holding up to ``size`` sandboxes."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None or pool.closed:
        pool = _POOLS[loop] = SandboxPool(size)
    pool.size = size
    return pool


def current_pool() -> SandboxPool | None:
    """The running loop's pool, if it has one."""
    with contextlib.suppress(RuntimeError):
        return _POOLS.get(asyncio.get_running_loop())
    return None


async def close_pools(under: Path | None = None) -> None:
    """Close the running loop's pooled sandboxes whose slots lie under ``under`` (all: the whole pool)."""
    pool = current_pool()
    if pool is not None:
        await pool.close(under)
