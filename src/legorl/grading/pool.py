"""Grading sandboxes that stay, each with a zygote that forks a fresh pytest process per patch.

Why a pool and not a fresh sandbox per patch: the fresh sandbox's isolation is kept where it
matters, per patch, one level down. Every run gets new user, mount, pid, ipc and network
namespaces inside the member sandbox, its own fresh copy of the pristine repo (plus the patch
and the hidden tests) bound at the workspace path, fresh ``/tmp`` and ``/dev/shm``, the control
dirs covered, and everything it started killed with its pid namespace (``zygote.py``). What a
member keeps between patches is what no patch can write: the read-only system view, the zygote
(imported pytest, never task code; non-dumpable and outside the run's pid namespace) and the
agent. One run at a time per member, so the sandbox's limits (memory watchdog, process budget,
CPU share, workspace size) hold per patch as before; concurrent gradings use several members.
What a patch no longer gets of its own: a new bwrap and cgroup, a new Python hash seed (the
zygote's), and root-owned files show as ``nobody`` in its user namespace.

A member is refused (and every grading of its kind falls back to a fresh sandbox per patch) when
the zygote finds it cannot make the namespaces, or finds a dumpable process of its uid that code
under test could write (a non-root driver, whose sandbox agent keeps its uid). ``fallback_reason``
says which tasks and set-ups never use the pool. ``LEGORL_GRADING_ZYGOTE=0`` turns it off.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shlex
import shutil
import socket
import tempfile
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from legorl.config import SandboxConfig
from legorl.grading.stream import install_verifier_files
from legorl.sandbox.base import Sandbox
from legorl.sandbox.bwrap import sandbox_ids
from legorl.sandbox.client import ExecResult
from legorl.sandbox.factory import create_sandbox
from legorl.sandbox.limits import MiB, SandboxLimits
from legorl.sandbox.sandbox_agent import read_trimmed
from legorl.tasks.pristine import PRISTINE, Pristine
from legorl.tasks.schema import Task

log = logging.getLogger(__name__)

SWITCH = "LEGORL_GRADING_ZYGOTE"
ZYGOTE_SOURCE = Path(__file__).with_name("zygote.py")
ZYGOTE_MODULE = "legorl_zygote"
HOST_DIR = "z"  # in the verifier dir: the host's socket the zygote connects to; covered in every run
MAX_USES = 200  # then a member is replaced (hygiene: the zygote's own heap grows a little per run)
MAX_IDLE = 8  # idle members kept per kind
IDLE_S = 120.0  # an idle member is closed after this
REFUSED_S = 600.0  # a kind whose zygote refused is tried again after this
START_TIMEOUT_S = 60.0
REPLY_SLACK_S = 30.0  # past the tests' timeout, which the zygote enforces itself
ZYGOTE_LIFETIME_S = 7 * 24 * 3600.0
SHELL_CHARS = set("$;&|<>`*?~(){}[]!\\'\"#\n")  # (an `=` only assigns before the command: words[0] is checked)


def pytest_args(test_command: str) -> list[str] | None:
    """The arguments after ``python -m pytest`` when the task's test command is exactly that (no shell
    syntax, no other interpreter); None otherwise."""
    if SHELL_CHARS & set(test_command):
        return None
    words = shlex.split(test_command)
    if len(words) < 3 or words[0] != "python" or words[1:3] != ["-m", "pytest"]:
        return None
    return words[3:]


def fallback_reason(task: Task, cfg: SandboxConfig | None, keep: bool) -> str | None:
    """Why this grading takes a fresh sandbox of its own (the path without the pool); None: the pool."""
    if os.environ.get(SWITCH, "1") == "0":
        return f"{SWITCH}=0"
    if keep:
        return "keep: the fresh-sandbox path leaves its work dir to inspect"
    if cfg is not None and cfg.kind != "bwrap":
        return f"sandbox kind {cfg.kind}: a container's seccomp profile refuses nested user namespaces"
    if os.geteuid() != 0:
        return "a non-root driver: the sandbox agent keeps the sandbox's uid and stays dumpable"
    if task.environment or task.image:
        return "the task brings its own environment or image"
    if task.setup.strip():
        return "the task has a setup command (it may change the environment)"
    if task.tests_dir:
        return "the task's tests are mounted (tests_dir)"
    if pytest_args(task.test_command) is None:
        return f"test command {task.test_command!r} is not `python -m pytest [options]`"
    return None


# ---- one member: a grading sandbox and its zygote -------------------------------------------------


class Refused(Exception):
    """The zygote cannot give runs their own namespaces here, or would be reachable from them."""


@dataclass
class RunResult:
    result: ExecResult
    junit: bytes | None


def _read_output(path: Path) -> str:
    with open(path, "rb") as f:
        return read_trimmed(f)


@dataclass
class Member:
    """A grading sandbox whose workspace is the dir of slots (one fresh repo copy per patch) and whose
    zygote serves one run at a time."""

    root: Path
    box: Sandbox
    ids: tuple[int, int]
    workdir: str
    verifier: Path  # host dir, read-only at VERIFIER_INSIDE: the plugin, the zygote, the runs' sockets
    cpu_seconds: int | None
    tmp_bytes: int | None
    conn: socket.socket | None = None
    zygote: asyncio.Task | None = None
    uses: int = 0
    test_cpu_s: float = 0.0  # CPU seconds of its runs' test processes (pytest and what it started)
    idle_timer: asyncio.TimerHandle | None = None
    closed: bool = False
    _buf: bytes = b""

    @property
    def slots(self) -> Path:
        return self.root / "slots"

    @classmethod
    async def start(cls, cfg: SandboxConfig | None, *, label: str, hide_paths: tuple[Path, ...],
                    limits: SandboxLimits, workdir: str, verifier_inside: str, env: dict[str, str]) -> Member:
        root = Path(tempfile.mkdtemp(prefix="legorl-gz-"))
        (root / "slots").mkdir()
        (root / "io").mkdir()
        verifier = root / "v"
        verifier.mkdir(mode=0o755)
        os.chmod(verifier, 0o755)
        install_verifier_files(verifier, (ZYGOTE_SOURCE, ZYGOTE_MODULE))
        (verifier / HOST_DIR).mkdir(mode=0o755)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(verifier / HOST_DIR / "zygote.sock"))
        os.chmod(verifier / HOST_DIR / "zygote.sock", 0o666)  # the sandbox's uid connects
        listener.listen(1)
        listener.setblocking(False)
        ids = sandbox_ids()
        assert ids is not None, "the pool needs a root driver (fallback_reason checks it)"
        member: Member | None = None
        try:
            box = await create_sandbox(
                cfg, workspace=root / "slots", sandbox_dir=root / "sandbox", label=label,
                hide_paths=[*hide_paths, root], ro_binds={verifier_inside: verifier}, limits=limits,
                inside_workspace=workdir, sandbox_uid=ids[0],
            )  # fmt: skip
            member = cls(root, box, ids, workdir, verifier, limits.cpu_seconds,
                         limits.tmp_mb * MiB if limits.tmp_mb else None)  # fmt: skip
            sock = f"{verifier_inside}/{HOST_DIR}/zygote.sock"
            zygote = f"{verifier_inside}/{ZYGOTE_MODULE}.py"
            # Compiled as "<legorl-zygote>": its frames stay under every test, and the verifier plugin trusts
            # "<...>" code as it trusts `python -m`'s runpy frames (a file name there would read as repository code).
            code = (f"exec(compile(open({zygote!r}).read(), '<legorl-zygote>', 'exec'), (z := {{'__name__': "
                    f"'{ZYGOTE_MODULE}'}})); z['main']({sock!r})")  # fmt: skip
            command = f"exec python -c {shlex.quote(code)}"
            member.zygote = asyncio.ensure_future(box.exec(command, timeout=ZYGOTE_LIFETIME_S, env=env, cwd=workdir))
            await member._connect(listener)
            return member
        except BaseException:
            if member is not None:
                await member.close()
            else:
                shutil.rmtree(root, ignore_errors=True)
            raise
        finally:
            listener.close()

    async def _connect(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        assert self.zygote is not None
        accept = asyncio.ensure_future(loop.sock_accept(listener))
        done, _ = await asyncio.wait({accept, self.zygote}, timeout=START_TIMEOUT_S,
                                     return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        if accept not in done:
            accept.cancel()
            why = self.zygote.result().output[-1000:] if self.zygote in done else "no connection in time"
            raise RuntimeError(f"the grading zygote did not start: {why}")
        self.conn = accept.result()[0]
        self.conn.setblocking(False)
        hello = json.loads(await asyncio.wait_for(self._line(), START_TIMEOUT_S))
        if "refused" in hello:
            raise Refused(hello["refused"])

    async def _line(self) -> bytes:
        loop = asyncio.get_running_loop()
        assert self.conn is not None
        while b"\n" not in self._buf:
            chunk = await loop.sock_recv(self.conn, 65536)
            if not chunk:
                raise ConnectionError("the grading zygote hung up")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def new_slot(self, task: Task) -> tuple[Path, str, Pristine]:
        """A fresh copy of the task's pristine repo: (host path, path inside the member, the pristine)."""
        name = secrets.token_hex(6)
        pristine = PRISTINE.copy(task, self.slots / name, self.ids)
        return self.slots / name, f"{self.workdir}/{name}", pristine

    async def run(self, slot_inside: str, args: list[str], env: dict[str, str], timeout: float,
                  junit_inside: str, cover: list[str]) -> RunResult:
        """One test run in a fresh forked process with its own namespaces (see zygote.py)."""
        assert self.conn is not None
        self.uses += 1
        token = secrets.token_hex(6)
        out_path, junit_path = self.root / "io" / f"{token}.out", self.root / "io" / f"{token}.junit"
        fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600) for p in (out_path, junit_path)]
        request = {"slot": slot_inside, "workdir": self.workdir, "args": args, "env": env, "timeout": timeout,
                   "cpu": self.cpu_seconds, "tmp_bytes": self.tmp_bytes, "junit": junit_inside, "cover": cover}
        try:
            data = json.dumps(request).encode() + b"\n"
            self.conn.setblocking(True)  # one small message into an empty buffer: no wait
            try:
                self.conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            finally:
                self.conn.setblocking(False)
        finally:
            for fd in fds:
                os.close(fd)
        try:
            reply = json.loads(await asyncio.wait_for(self._line(), timeout + REPLY_SLACK_S))
            self.test_cpu_s += float(reply.get("test_cpu") or 0.0)
            if "error" in reply:
                raise RuntimeError(f"grading zygote: {reply['error']}")
            output = _read_output(out_path)
            if reply.get("timed_out"):
                note = f"[legorl] timed out after {timeout:g} s; ended the test run's namespace"
                output += ("" if not output or output.endswith("\n") else "\n") + note + "\n"
                return RunResult(ExecResult(output, -1, timed_out=True), None)
            junit = junit_path.read_bytes() if junit_path.stat().st_size else None
            return RunResult(ExecResult(output, os.waitstatus_to_exitcode(int(reply["status"]))), junit)
        finally:
            out_path.unlink(missing_ok=True)
            junit_path.unlink(missing_ok=True)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.conn is not None:
            self.conn.close()  # the zygote exits on end-of-file
        with contextlib.suppress(Exception):
            await self.box.close()
        if self.zygote is not None:
            self.zygote.cancel()
            with contextlib.suppress(BaseException):
                await self.zygote
        await asyncio.to_thread(shutil.rmtree, self.root, True)


# ---- the pool of one event loop -------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """Members of one kind are interchangeable: same backend config, label, hidden paths, limits, workdir."""

    cfg: str
    label: str
    hide_paths: tuple[str, ...]
    limits: str
    workdir: str


@dataclass
class GradingPool:
    idle: dict[Kind, list[Member]] = field(default_factory=dict)
    live: dict[int, Member] = field(default_factory=dict)
    refused: dict[Kind, tuple[str, float]] = field(default_factory=dict)  # why, when (retried after REFUSED_S)
    keeper: asyncio.Task | None = None
    started: int = 0  # members started (for benchmarks and tests)

    async def acquire(self, kind: Kind, start) -> Member | None:
        """An idle member of ``kind`` or a new one (``start()``); None when members of this kind are refused."""
        if kind in self.refused and time.monotonic() - self.refused[kind][1] < REFUSED_S:
            return None
        while self.idle.get(kind):
            member = self.idle[kind].pop()
            if member.idle_timer is not None:
                member.idle_timer.cancel()
                member.idle_timer = None
            if not member.box.violation and member.zygote is not None and not member.zygote.done():
                return member
            await member.close()
        try:
            member = await start()
        except Refused as e:
            self.refused[kind] = (str(e), time.monotonic())
            log.warning("grading falls back to a fresh sandbox per patch: %s", e)
            return None
        self.started += 1
        self.live[id(member)] = member
        return member

    def release(self, kind: Kind, member: Member, reusable: bool) -> None:
        idle = self.idle.setdefault(kind, [])
        if not reusable or member.uses >= MAX_USES or len(idle) >= MAX_IDLE or member.closed:
            self._close_later(member)
            return
        loop = asyncio.get_running_loop()
        member.idle_timer = loop.call_later(IDLE_S, self._expire, kind, member)
        idle.append(member)

    def _expire(self, kind: Kind, member: Member) -> None:
        if member in self.idle.get(kind, []):
            self.idle[kind].remove(member)
            self._close_later(member)

    def _close_later(self, member: Member) -> None:
        self.live.pop(id(member), None)
        task = asyncio.get_running_loop().create_task(member.close())
        _CLOSING.add(task)
        task.add_done_callback(_CLOSING.discard)

    async def aclose(self) -> None:
        members = list(self.live.values())
        self.live.clear()
        self.idle.clear()
        await asyncio.gather(*(m.close() for m in members), return_exceptions=True)

    async def _keep(self) -> None:
        """Held until the loop shuts down: asyncio.run cancels it, and the members close with it."""
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            await self.aclose()


_CLOSING: set[asyncio.Task] = set()
_POOLS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GradingPool] = weakref.WeakKeyDictionary()


def current_pool() -> GradingPool:
    """The grading pool of the running event loop (made on first use, closed when the loop shuts down)."""
    loop = asyncio.get_running_loop()
    pool = _POOLS.get(loop)
    if pool is None:
        pool = _POOLS[loop] = GradingPool()
    if pool.keeper is None or pool.keeper.done():  # (cancelled with every task by someone: held again)
        pool.keeper = loop.create_task(pool._keep())
    return pool


def kind_of(cfg: SandboxConfig | None, label: str, hide_paths, limits: SandboxLimits, workdir: str) -> Kind:
    return Kind((cfg or SandboxConfig()).model_dump_json(), label, tuple(sorted(str(Path(p)) for p in hide_paths)),
                json.dumps(limits.to_dict(), sort_keys=True), workdir)  # fmt: skip


def member_limits(limits: SandboxLimits) -> SandboxLimits:
    """A member outlives any one grading: no lifetime limit (its idle timer and the loop end it)."""
    return limits.with_(lifetime_s=None)


__all__ = ["PRISTINE", "GradingPool", "Member", "Refused", "current_pool", "fallback_reason", "pytest_args"]
