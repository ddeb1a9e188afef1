"""The grading zygote: one clean process per grading sandbox that forks a fresh pytest process per patch.

Stdlib + pytest only, no legorl imports: it is copied into the verifier dir (read-only in the
sandbox) and started there by ``exec python -c`` (compiled as ``<legorl-zygote>``, see pool.py)
with the grader's environment, so its interpreter is the one ``python -m pytest`` would be.

It imports pytest and pytest's default plugins, never anything of a task's repository, runs one
pytest session on a test file of its own (``warm_up``: what every run would fill lazily is filled
once), builds pytest's Config with its default plugins (``prebuild_config``: each run's fork starts
from its own copy), freezes the heap (``gc.freeze``), connects to the host's socket and answers
requests, one at a time. For each patch it forks, and the fork (C) unshares new user, mount, pid,
ipc and network namespaces; there it binds the patch's own fresh repo copy (``slot``) over the
workspace path, mounts fresh ``/tmp`` and ``/dev/shm`` tmpfs, covers the zygote's and the agent's
control dirs, brings up its own loopback, and forks the pid namespace's init (I), which forks the
test process (P): P drops every capability, makes itself what ``python -m pytest ARGS`` would be
(argv, ``sys.path[0]``, ``__main__``, cwd, environment, CPU limit, stdio on the host's output file)
and runs pytest's ``__main__`` at the top of the stack, so the interpreter exits as a fresh one
would (atexit, threads, flushes). When P has exited, I kills every process left in the namespace,
copies pytest's JUnit report (from P's private ``/tmp``) to the host's file and exits, which ends
the namespace; C enforces the timeout by killing I. Nothing a test run leaves (processes, files,
mounts, IPC objects, sockets, modules, environment) reaches the next patch.

Code under test cannot reach the zygote: it sees no process outside its pid namespace to signal,
and every process outside it is non-dumpable or another uid (checked at start: otherwise the
zygote refuses, and the grader falls back to a fresh sandbox per patch), so /proc/<pid>/mem and
ptrace are closed to it.

Protocol (JSON lines over the host's Unix socket): the zygote sends ``{"ready": pid}`` or
``{"refused": why}``; then each request ``{"slot", "workdir", "args", "env", "timeout", "cpu",
"tmp_bytes", "junit", "cover"}`` carrying two fds (output, JUnit copy) gets one reply
``{"status": wait status, "test_cpu": s}``, ``{"timed_out": true}`` or ``{"error": message}``.
"""

import ctypes
import json
import os
import socket
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
NAMESPACES = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWNET
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
PR_SET_DUMPABLE = 4
CAP_VERSION_3 = 0x20080522
MAX_JUNIT = 64 * 1024 * 1024
LIBC = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target: str, fstype, flags: int, data=None) -> None:
    enc = (lambda s: s.encode() if isinstance(s, str) else s)
    _check(LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _mounts_below(tops: tuple[str, ...], mountinfo: str | None = None) -> list[tuple[str, bool]]:
    """The sandbox's mounts strictly below ``tops`` (e.g. a venv bound read-only under ``/tmp`` when the
    checkout lives there), outermost first and without those nested in another, with whether each is
    read-only: a run's fresh ``/tmp`` must not hide its own interpreter."""
    def unescape(field: str) -> str:  # mountinfo writes space, tab, newline and backslash as octal
        for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
            field = field.replace(code, char)
        return field

    found: list[tuple[str, bool]] = []
    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    rows = [line.split() for line in mountinfo.splitlines() if line.strip()]
    points = [(unescape(row[4]), "ro" in row[5].split(",")) for row in rows]
    for point, ro in sorted(points, key=lambda p: p[0].count("/")):
        if any(point.startswith(top + "/") for top in tops) and not any(
            point.startswith(kept + "/") or point == kept for kept, _ in found
        ):
            found.append((point, ro))
    return found


def _fresh_tmp(size: str) -> None:
    """Fresh ``/tmp`` and ``/dev/shm`` tmpfs for a run, with the sandbox's own binds below them (its
    interpreter, read-only) bound back as they were."""
    tops = ("/tmp", "/dev/shm")
    keep = [(path, ro, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path, ro in _mounts_below(tops)]
    for tmp in tops:
        _mount("tmpfs", tmp, "tmpfs", MS_NOSUID | MS_NODEV, f"{size}mode=1777")
    for path, ro, fd in keep:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(path, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "a").close()  # a mount point
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
        if ro and not os.statvfs(path).f_flag & os.ST_RDONLY:
            raise OSError(f"{path} would be writable in the run (read-only in the sandbox)")


def preload() -> None:
    """What every pytest run imports anyway: pytest, its default plugins and the verifier plugin's stdlib."""
    import importlib

    import _pytest.config
    import pytest  # noqa: F401

    for name in (*_pytest.config.default_plugins, "_argcomplete"):
        importlib.import_module(f"_pytest.{name}")
    importlib.import_module("pdb")  # the debugging plugin's, at every configure (stdlib, no side effects)
    import importlib.metadata

    # `-p NAME` makes pytest look NAME up among the installed distributions' entry points: the listings of
    # the interpreter's dirs are cached per dir and mtime, so list them once here. Not '' (the cwd): a run's
    # cwd is its own repo.
    list(importlib.metadata.distributions(path=[p for p in sys.path if p and os.path.isabs(p)]))
    warm_up()
    prebuild_config()
    import gc

    gc.freeze()  # the imported heap: never scanned again, so the forks' collections stay small


WARM_UP_TEST = """import pytest


@pytest.fixture
def value():
    return 1


def test_passes(value):
    assert value == 1


def test_fails(value):
    assert value == 2, "expected"
"""


def warm_up() -> None:
    """One pytest session in this process on a test file of its own (a pass, a failed assertion, a
    fixture), in a throwaway dir: what every run would fill lazily (the imports of its terminal,
    debugging and JUnit paths, the regex and function caches) is filled once, before the forks,
    so each run is about a fifth cheaper. No task code is involved; what the session left in this
    process's state is put back (modules of its dir, sys.path, meta path, warning filters, cwd,
    stdio)."""
    import shutil
    import tempfile
    import warnings

    import pytest

    work = tempfile.mkdtemp(prefix="legorl-zygote-warm-up-")
    with open(os.path.join(work, "test_legorl_warm_up.py"), "w") as f:
        f.write(WARM_UP_TEST)
    saved = (list(sys.path), list(sys.meta_path), list(warnings.filters), set(sys.modules), os.getcwd())
    stdio = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        os.chdir(work)
        pytest.main(["-p", "no:cacheprovider", f"--rootdir={work}", f"--junitxml={work}/junit.xml",
                     "test_legorl_warm_up.py"])
    except BaseException:  # noqa: BLE001, S110 - only a speed-up: a run works the same without it
        pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved_fd in ((1, stdio[0]), (2, stdio[1])):
            os.dup2(saved_fd, fd)
            os.close(saved_fd)
        os.close(null)
        sys.path[:], sys.meta_path[:], warnings.filters[:], modules, cwd = saved
        os.chdir(cwd)
        for name in set(sys.modules) - modules:
            if getattr(sys.modules[name], "__file__", None) and sys.modules[name].__file__.startswith(work):
                del sys.modules[name]
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        shutil.rmtree(work, ignore_errors=True)


PREBUILT_ARGS = ("-p", "no:cacheprovider")  # the `-p no:` exclusions of every grader command line
PREBUILT: dict = {}


def prebuild_config() -> None:
    """pytest's Config with the default plugins registered, as ``get_config`` builds it first thing in
    every session (about a quarter of a run's CPU, all of it independent of the run): built once here,
    before any run, so that each test process's fork of this one starts from its own copy."""
    import _pytest.config

    try:
        PREBUILT["config"] = _pytest.config.get_config(list(PREBUILT_ARGS))
    except Exception:  # noqa: BLE001 - another pytest's internals: each run builds its own, as before
        PREBUILT.clear()


def _exclusions(args) -> set:
    """The ``-p no:NAME`` arguments of a command line, as pytest's ``consider_preparse`` reads them."""
    found, words = set(), iter(args)
    for word in words:
        if not isinstance(word, str) or not word.startswith("-p"):
            continue
        arg = next(words, None) if word == "-p" else word[2:]
        if arg is not None and arg.strip().startswith("no:"):
            found.add(arg.strip())
    return found


def _use_prebuilt_config() -> None:
    """In a test process: the session's ``get_config`` returns the prebuilt Config (once), given this
    run's arguments and directory, when the run blocks exactly the plugins it was built without;
    otherwise (other ``-p no:`` arguments, plugins passed in, PYTEST_DEBUG) pytest builds its own."""
    config = PREBUILT.pop("config", None)
    if config is None:
        return
    import pathlib

    import _pytest.config as pytest_config

    build = pytest_config.get_config

    def get_config(args=None, plugins=None, **kwargs):
        pytest_config.get_config = build
        same = _exclusions(args or ()) == _exclusions(PREBUILT_ARGS)
        if plugins or kwargs or os.environ.get("PYTEST_DEBUG") or not same:
            return build(args, plugins, **kwargs)
        try:
            config.invocation_params = pytest_config.Config.InvocationParams(
                args=args or (), plugins=plugins, dir=pathlib.Path.cwd())
        except Exception:  # noqa: BLE001 - another pytest's internals: build it as usual
            return build(args, plugins, **kwargs)
        return config

    pytest_config.get_config = get_config


def exposed() -> list:
    """Processes this one could ptrace or write through /proc/<pid>/mem (its own and its children's aside)."""
    me = int(os.readlink("/proc/self"))
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                os.close(os.open(f"/proc/{name}/mem", os.O_RDONLY))
            except OSError:
                continue
            out.append(int(name))
    return out


def _enter_namespaces() -> None:
    uid, gid = os.getuid(), os.getgid()
    # A non-dumpable process's /proc/self files belong to root: dumpable just while it writes its maps. No test
    # process exists meanwhile (one run at a time), and only trusted processes share this uid outside runs.
    LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    try:
        _check(LIBC.unshare(NAMESPACES), "unshare")
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    finally:
        LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    _mount("none", "/", None, MS_REC | MS_PRIVATE)


def _loopback_up() -> None:
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", 0x1 | 0x8 | 0x40, b""))  # SIOCSIFFLAGS: up


def probe() -> str:
    """Why runs cannot be isolated here ("" when they can): a throwaway run's namespaces are made, and its
    test process, without capabilities, must reach no process outside them (a dumpable one of this uid)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _enter_namespaces()
            _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=65536")
            _loopback_up()
            inner = os.fork()
            if inner == 0:
                _drop_capabilities()
                if others := exposed():
                    os.write(w, f"processes {others} outside a run are open to it (dumpable, same uid)".encode())
                os._exit(0)
            os.waitpid(inner, 0)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, str(e).encode()[:500])
        os._exit(0)
    os.close(w)
    why = _read_all(r).decode(errors="replace")
    os.waitpid(pid, 0)
    return why


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _drop_capabilities() -> None:
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(LIBC.capset(header, data), "capset")
    with open("/proc/self/status") as f:
        caps = {k: v.strip() for k, _, v in (line.partition(":") for line in f) if k.startswith("Cap")}
    if int(caps.get("CapEff", "1"), 16) or int(caps.get("CapPrm", "1"), 16):
        raise OSError(1, f"capabilities still held: {caps}")


def _test_process(req: dict, out_fd: int) -> dict:
    """P: becomes `python -m pytest ARGS` minus the interpreter start; returns the job for main()."""
    os.setsid()
    _drop_capabilities()
    LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # as any process started from a shell: its own children may inspect it
    if req.get("cpu"):
        import resource

        resource.setrlimit(resource.RLIMIT_CPU, (int(req["cpu"]), int(req["cpu"])))
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.closerange(3, 1 << 16)
    os.chdir(req["workdir"])
    for k, v in req["env"].items():
        os.environ[k] = v
    os.environ["PWD"] = req["workdir"]
    return req


def _init(req: dict, out_fd: int, junit_fd: int, report_w: int):
    """I, pid 1 of the run's namespace: forks P, reaps, then ends everything else and hands back the JUnit report."""
    pid = os.fork()
    if pid == 0:
        os.close(report_w)
        os.close(junit_fd)
        return _test_process(req, out_fd)
    os.close(out_fd)
    status, cpu = None, 0.0
    while status is None:
        try:
            done, st, usage = os.wait4(-1, 0)
        except ChildProcessError:
            break
        if done == pid:
            status, cpu = st, usage.ru_utime + usage.ru_stime
    try:
        os.kill(-1, 9)  # every other process of this pid namespace: what the tests left running
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
    try:
        with open(req["junit"], "rb") as f:
            data = f.read(MAX_JUNIT + 1)
        view = memoryview(data if len(data) <= MAX_JUNIT else b"")
        while view:
            view = view[os.write(junit_fd, view):]
    except OSError:
        pass  # no report: the host says it is missing
    os.write(report_w, f"X {status if status is not None else -1} {cpu}\n".encode())
    os._exit(0)


def _run_child(req: dict, out_fd: int, junit_fd: int, report_w: int):
    """C: the run's namespaces and mounts, then I; kills I (and with it the namespace) at the deadline."""
    import select

    try:
        _enter_namespaces()
        _mount(req["slot"], req["workdir"], None, MS_BIND | MS_REC)
        size = f"size={req['tmp_bytes']}," if req.get("tmp_bytes") else ""
        _fresh_tmp(size)
        for path in req.get("cover", ()):
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4096,mode=755")
        _loopback_up()
    except OSError as e:
        os.write(report_w, f"E {e}\n".encode())
        os._exit(0)
    pid = os.fork()
    if pid == 0:
        return _init(req, out_fd, junit_fd, report_w)
    os.close(out_fd)
    os.close(junit_fd)
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    if not poller.poll(max(1, int(float(req["timeout"]) * 1000))):
        os.kill(pid, 9)  # the namespace's init: the kernel ends every process in it
        os.write(report_w, b"T\n")
    os.waitpid(pid, 0)
    os._exit(0)


def _recv_request(conn: socket.socket, buf: bytearray, fds: list) -> dict | None:
    while b"\n" not in buf:
        msg, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(4 * 8))
        if not msg:
            return None
        buf += msg
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, len(data), 4))
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return json.loads(line)


def _serve(conn: socket.socket):
    """Answers requests until the host hangs up (then exits); returns only in a test process (its job)."""
    buf = bytearray()
    while True:
        fds: list = []
        req = _recv_request(conn, buf, fds)
        if req is None:
            os._exit(0)
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"error": f"expected 2 fds, got {len(fds)}"}).encode() + b"\n")
            continue
        out_fd, junit_fd = fds
        sys.stdout.flush()
        sys.stderr.flush()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            conn.detach()  # its fd is closed below: the socket object must never close a reused number
            keep = sorted((out_fd, junit_fd, w))
            for lo, hi in zip([3, *(k + 1 for k in keep)], [*keep, 1 << 16], strict=True):
                os.closerange(lo, hi)  # nothing of the zygote's stays open in the run
            try:
                return _run_child(req, out_fd, junit_fd, w)
            except BaseException as e:  # noqa: BLE001 - any failure here is the run's, reported as such
                try:
                    os.write(w, f"E {type(e).__name__}: {e}\n".encode())
                finally:
                    os._exit(0)
        os.close(w)
        os.close(out_fd)
        os.close(junit_fd)
        report = _read_all(r).decode(errors="replace")
        os.waitpid(pid, 0)
        reply: dict = {"error": "the run ended without a report"}
        for line in report.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "T":
                reply = {"timed_out": True}
                break
            if kind == "E":
                reply = {"error": rest}
            elif kind == "X":
                status, _, test_cpu = rest.partition(" ")
                reply = {"status": int(status), "test_cpu": float(test_cpu or 0)}
        conn.sendall(json.dumps(reply).encode() + b"\n")


def _exec_pytest(job: dict) -> None:
    """At the top of the stack of a test process: run pytest's __main__ as `python -m pytest` would."""
    import runpy

    _use_prebuilt_config()
    main = sys.modules["__main__"].__dict__
    builtins = main.get("__builtins__")
    main.clear()
    main.update(__name__="__main__", __builtins__=builtins)
    sys.path[0] = job["workdir"]  # `python -m` puts the working directory first
    sys.argv = ["-m", *job["args"]]
    runpy._run_module_as_main("pytest")


def main(socket_path: str) -> None:
    LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # first: code under test must never write this process's memory
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(socket_path)
    preload()
    for _ in range(100):  # the sandbox agent makes itself non-dumpable just after it signals ready (a busy host: later)
        if not (refused := probe()) or "outside a run" not in refused:
            break
        time.sleep(0.05)
    if refused:
        conn.sendall(json.dumps({"refused": refused}).encode() + b"\n")
        os._exit(3)
    conn.sendall(json.dumps({"ready": os.getpid()}).encode() + b"\n")
    job = _serve(conn)
    _exec_pytest(job)
