"""In-sandbox agent: the sandbox's main process (stdlib only, no legorl imports).

It serves two things inside the sandbox:

* a control socket (JSON lines over a Unix socket, one thread per connection) that
  runs commands for the host or for a harness worker process;
* an optional TCP relay on 127.0.0.1:<port> (inside the sandbox's own network
  namespace) forwarding every connection byte-for-byte to the LLM proxy's Unix
  socket, so the harness reaches its model and nothing else.

Start-up is on the critical path of every rollout, so the agent binds its sockets using
only built-in modules, applies its resource limits, writes ``ready`` to its stdout (the
host waits on that pipe instead of polling) and only then imports the rest.

Usage: python3 -I -S sandbox_agent.py CONTROL_SOCKET [--relay PORT PROXY_SOCKET]
           [--limits nproc=N,data=BYTES,as=BYTES,cpu=S,fsize=BYTES,nofile=N] [--workdir DIR]
           [--uid UID --gid GID] [--lifeline] [--nice N]

Each command runs as ``bash -c``, forked by a small zygote (forked from the agent at start-up,
before any import, so a fork from it is cheap), in a session of its own and as a child subreaper
(PR_SET_CHILD_SUBREAPER): everything the command starts (background jobs, double forks, ``setsid``
daemons) stays below its ``bash`` while it runs. When the command times out or its client hangs
up, that whole tree is frozen, killed and waited for, and only that tree: concurrent commands each
have their own. The reply says what was ended. When the process budget (RLIMIT_NPROC) is so full
that no command can start, the sandbox declares itself exhausted: every later request gets that
reason, and so does the host's watchdog (``<control dir>/failure``), which ends the sandbox.

With ``--lifeline`` the agent exits when its stdin reaches end-of-file: the host keeps the write
end of that pipe and never writes, so the sandbox ends with the host process however it dies,
even a SIGKILL landing before bwrap armed ``--die-with-parent``.

With ``--uid``/``--gid`` (a root driver: bwrap runs privileged, without a user namespace,
keeping only CAP_SETUID/CAP_SETGID) the agent binds its sockets as root, then drops to that
uid for good (which clears every capability) before anything else runs.
"""

import _signal
import _socket
import _thread
import posix
import sys

MAX_OUTPUT = 2_000_000  # bytes kept per command (head + tail) so one reply stays bounded
MAX_READ = 64 * 1024 * 1024
CPU_LIMIT = [0]  # RLIMIT_CPU applied to each command (0: none)
NPROC_LIMIT = [0]  # RLIMIT_NPROC of the sandbox (0: none)
WORKDIR = ["/workspace"]
FAILURE = [""]  # why this sandbox can no longer run commands (sticky; see _declare)
STATUS_FD = [-1]  # <control dir>/failure, opened before dropping privileges: the host's watchdog reads it
LOCK = _thread.allocate_lock()
PRCTL = [None]  # libc prctl (ctypes), resolved in the zygote; False where unavailable
ZYGOTE = [None]  # (the agent's end of the zygote's socket, its pid); see zygote()
ZYGOTE_LOCK = _thread.allocate_lock()
ZYGOTE_MAX_MESSAGE = 128 * 1024  # larger requests go in a file
WHICH = {}  # (PATH, name) -> path
ZYGOTE_GONE = ("[legorl] the command never started: the sandbox's process launcher died before starting it, "
               "on every retry (something inside the sandbox kills it)\n")
FORK_RETRY_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)  # waits before a fork refused for the process budget is retried


def parse_args(argv: list) -> dict:
    opts = {"control": argv[0], "relay": None, "limits": "", "workdir": "/workspace", "uid": "", "gid": "",
            "lifeline": False, "nice": ""}
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--relay":
            opts["relay"] = (int(argv[i + 1]), argv[i + 2])
            i += 3
        elif arg == "--lifeline":
            opts["lifeline"] = True
            i += 1
        elif arg in ("--limits", "--workdir", "--uid", "--gid", "--nice"):
            opts[arg[2:]] = argv[i + 1]
            i += 2
        else:
            raise SystemExit(f"sandbox_agent: unknown argument {arg!r}")
    return opts


def apply_limits(spec: str) -> None:
    import resource

    names = {
        "nproc": resource.RLIMIT_NPROC,
        "data": resource.RLIMIT_DATA,
        "as": resource.RLIMIT_AS,
        "fsize": resource.RLIMIT_FSIZE,
        "nofile": resource.RLIMIT_NOFILE,
    }
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for item in filter(None, spec.split(",")):
        key, value = item.split("=")
        if key == "cpu":
            CPU_LIMIT[0] = int(value)
            continue
        if key == "nproc":
            NPROC_LIMIT[0] = int(value)
        which = names[key]
        _, hard = resource.getrlimit(which)
        v = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(which, (v, v))  # hard too: nothing inside can raise it back


def _prctl():
    """libc's prctl (ctypes), resolved once in the zygote before it forks; False where unavailable."""
    if PRCTL[0] is None:
        try:
            import ctypes

            PRCTL[0] = ctypes.CDLL(None, use_errno=True).prctl
        except (ImportError, OSError, AttributeError):
            PRCTL[0] = False
    return PRCTL[0]


def scan_processes() -> dict:
    """Every process of the sandbox (its own pid namespace): pid -> (ppid, state, threads, name)."""
    import os

    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        head, _, tail = stat.rpartition(b")")
        fields = tail.split()
        procs[int(name)] = (int(fields[1]), fields[0], int(fields[17]), head.partition(b"(")[2].decode(errors="replace"))
    return procs


def _below(root: int, procs: dict) -> list:
    """The descendants of root (parents first)."""
    children = {}
    for pid, (ppid, *_) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _tasks(procs: dict) -> int:
    """Processes and threads counted against this sandbox's RLIMIT_NPROC (those of its uid)."""
    import os

    uid, n = os.getuid(), 0
    for pid, (_, state, threads, _) in procs.items():
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += threads
        except OSError:
            pass
    return n


def _at_limit(procs: dict) -> bool:
    """Whether the process budget is (about) full: a fork bomb at the limit keeps the count just below it
    as its forks fail and its processes exit, so within a tenth of it."""
    limit = NPROC_LIMIT[0]
    return bool(limit) and _tasks(procs) >= limit - max(2, limit // 10)


def _names(names: list) -> str:
    """'sleep, sleep, python', or 'bash x60, sleep x3' for many."""
    if len(names) <= 6:
        return ", ".join(names)
    counts = {}
    for n in names:
        counts[n] = counts.get(n, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in top[:6]) + (", ..." if len(top) > 6 else "")


def _end_tree(root: int, budget: float = 10.0) -> tuple:
    """End the command whose ``bash`` is ``root`` and everything it started; (names ended, limit reached).

    ``bash`` is a child subreaper: whatever the command started (background jobs, double forks,
    ``setsid`` daemons) stays below it while it lives. So the tree is first frozen (SIGSTOP, in rounds
    until no member is left running: a fork bomb still has children in flight), then killed whole, and
    the kills are waited for: once the processes are reaped the process budget is free again.
    """
    return _end(lambda procs: [root, *_below(root, procs)] if root in procs else [], budget)


def quiesce(req: dict) -> dict:
    """End every process of the sandbox but this agent (and the processes above it) and its zygote: what the
    agent's commands left running (daemons of a finished harness) is frozen and killed, as a timed-out
    command's tree is. Asked before the host reads the workspace (its diff): nothing the agent started can
    then stop, read or rewrite a command of the host's, through /proc or otherwise."""
    import os

    procs = scan_processes()
    keep, pid = set(), os.getpid()
    while pid in procs and pid not in keep:
        keep.add(pid)
        pid = procs[pid][0]
    if ZYGOTE[0] is not None:
        keep.add(ZYGOTE[0][1])
    ended, _ = _end(lambda now: [p for p in now if p not in keep], float(req.get("budget", 10.0)))
    left = [p for p in scan_processes() if p not in keep]
    return {"ended": ended, "left": len(left)}


def _end(select, budget: float) -> tuple:
    """Freeze the processes ``select(procs)`` names, in rounds until none of them runs, then kill and reap them."""
    import os
    import signal
    import time

    frozen, at_limit, first = {}, False, True
    deadline = time.monotonic() + budget
    while time.monotonic() < deadline:
        procs = scan_processes()
        if first:
            at_limit, first = _at_limit(procs), False
        tree = select(procs)
        fresh = [p for p in tree if p not in frozen and procs[p][1] != b"Z"]
        if not fresh and all(procs[p][1] in b"ZTtX" for p in tree):
            break  # every member stopped: none can fork any more
        for pid in fresh:
            frozen[pid] = procs[pid][3]
            try:
                os.kill(pid, signal.SIGSTOP)
            except (ProcessLookupError, PermissionError):
                pass
        if not fresh:
            time.sleep(0.001)  # a stop is still on its way
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    while frozen and time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in frozen):
        time.sleep(0.002)  # zombies still count against the budget until their reaper collects them
    return list(frozen.values()), at_limit


def _declare(reason: str) -> str:
    """This sandbox can no longer run commands: say so once, to every later request and to the host's
    watchdog (through the status file), which ends the sandbox and the rollout with this reason."""
    import os

    with LOCK:
        if not FAILURE[0]:
            FAILURE[0] = reason
            if STATUS_FD[0] >= 0:
                try:
                    os.write(STATUS_FD[0], reason.encode() + b"\n")
                except OSError:
                    pass
    return FAILURE[0]


def _exhausted(what: str) -> str:
    procs = scan_processes()
    names = [procs[p][3] for p in procs if p != 1]
    limit = f" of {NPROC_LIMIT[0]}" if NPROC_LIMIT[0] else ""
    return _declare(f"process limit exhausted: fork bomb? {_tasks(procs)}{limit} processes and threads of the "
                    f"sandbox in use ({_names(names)}); {what}")


def _which(name: str, env: dict) -> str:
    import os

    path = env.get("PATH") or "/usr/bin:/bin"
    if (path, name) not in WHICH:
        found = [os.path.join(d or ".", name) for d in path.split(":") if os.access(os.path.join(d or ".", name), os.X_OK)]
        WHICH[(path, name)] = found[0] if found else "/bin/" + name
    return WHICH[(path, name)]


def _exec_bash(bash: bytes, command: bytes, env: dict, cwd: bytes, out_fd: int, wfd: int) -> None:
    """In the zygote's forked child: become ``bash -c command``, a child subreaper (PR_SET_CHILD_SUBREAPER)
    in a session of its own, so that everything the command starts (background jobs, double forks, ``setsid``
    daemons) stays below it while it runs. Writes ``E <errno> <message>`` to ``wfd`` (closed on exec) if that
    fails. Built-in modules only. Never returns."""
    try:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, ())
        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGCHLD):  # as Popen(restore_signals=True)
            _signal.signal(sig, _signal.SIG_DFL)
        if PRCTL[0]:
            PRCTL[0](36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the command reparent to its bash
        posix.setsid()
        null = posix.open("/dev/null", posix.O_RDONLY)
        posix.dup2(null, 0)
        posix.dup2(out_fd, 1)
        posix.dup2(out_fd, 2)
        posix.set_inheritable(wfd, False)
        posix.closerange(3, wfd)  # nothing of the agent or the zygote stays open in the command
        posix.closerange(wfd + 1, 1 << 16)
        posix.chdir(cwd)
        posix.execve(bash, [b"bash", b"-c", command], env)
    except OSError as e:
        name = e.filename.decode(errors="replace") if isinstance(e.filename, bytes) else e.filename
        try:
            posix.write(wfd, f"E {e.errno or 0} {e.strerror or e}{f': {name}' if name else ''}\n".encode())
        except OSError:
            pass
    finally:
        posix._exit(127)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := posix.read(fd, 1 << 20):
        chunks.append(chunk)
    posix.close(fd)
    return b"".join(chunks)


def zygote(sock) -> None:
    """A small process forked from the agent at start-up, before it imports anything, that forks each
    command's ``bash``: that costs a fraction of forking the grown, threaded agent (its page tables, and
    the copy-on-write faults that follow on both sides). A request is one message on a SOCK_SEQPACKET
    socket, ``bash NUL cwd NUL command NUL KEY=VALUE...`` (or ``-`` with the same in a third file, when
    too large for one message), carrying the output file and the write end of the report pipe
    (SCM_RIGHTS). Reports on that pipe: ``P <pid of bash>``, then ``X <wait status>`` once it has exited
    and been reaped here (``E <errno> <message>`` if it could not start). A child subreaper itself, it
    also reaps what finished commands left running once that exits (in a container the agent is pid 1
    and would not). Exits when the agent's end closes. Never returns."""
    jobs = {}  # bash pid -> its report pipe

    def reap() -> None:
        while True:
            try:
                pid, status = posix.waitpid(-1, posix.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            wfd = jobs.pop(pid, -1)
            if wfd >= 0:
                try:
                    posix.write(wfd, b"X %d\n" % status)
                except OSError:
                    pass
                posix.close(wfd)

    try:
        posix.closerange(3, sock.fileno())
        posix.closerange(sock.fileno() + 1, 1 << 16)
        null = posix.open("/dev/null", posix.O_RDWR)
        posix.dup2(null, 1)  # not the host's start-up pipe
        posix.close(null)
        import select

        # SIGCHLD only wakes the poll below (a byte on this pipe, written by the C-level handler); reaping
        # happens in the loop, never in a handler, so it cannot race the bookkeeping around a fork, and a
        # child exiting just before the poll is never missed.
        wake_r, wake_w = posix.pipe()
        posix.set_blocking(wake_r, False)
        posix.set_blocking(wake_w, False)
        _signal.set_wakeup_fd(wake_w)
        _signal.signal(_signal.SIGCHLD, lambda *_: None)
        _signal.signal(_signal.SIGTERM, _signal.SIG_DFL)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        _prctl()
        if PRCTL[0]:
            PRCTL[0](15, b"legorl-zygote", 0, 0, 0)  # PR_SET_NAME: what `ps` shows for it
            PRCTL[0](36, 1, 0, 0, 0)  # and what a finished command left running is reaped here, not by pid 1
            PRCTL[0](4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: no process of the sandbox may ptrace or write it
        while True:
            ready = dict(poller.poll())
            if wake_r in ready:
                try:
                    while posix.read(wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            reap()
            if sock.fileno() not in ready:
                continue
            msg, anc, _, _ = sock.recvmsg(ZYGOTE_MAX_MESSAGE + 1024, 64)
            if not msg:
                break
            fds = []
            for level, kind, data in anc:
                if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                    fds += [int.from_bytes(data[i:i + 4], sys.byteorder) for i in range(0, len(data) - 3, 4)]
            if len(fds) == 3:
                msg = _read_all(fds.pop())
            if len(fds) != 2 or msg.count(b"\0") < 2:
                for fd in fds:
                    posix.close(fd)
                continue
            out_fd, wfd = fds
            bash, cwd, command, *pairs = msg.split(b"\0")
            env = dict(pair.split(b"=", 1) for pair in pairs if b"=" in pair)
            try:
                pid = posix.fork()
                if pid == 0:
                    _signal.set_wakeup_fd(-1)
                    sock.close()
                    _exec_bash(bash, command, env, cwd, out_fd, wfd)
            except OSError as e:  # EAGAIN: the process budget is full
                try:
                    posix.write(wfd, f"E {e.errno or 0} {e}\n".encode())
                except OSError:
                    pass
                posix.close(wfd)
            else:
                jobs[pid] = wfd
                try:
                    posix.write(wfd, b"P %d\n" % pid)
                except OSError:
                    pass
            finally:
                posix.close(out_fd)
    finally:
        posix._exit(0)


def start_zygote() -> bool:
    """Fork the zygote (at start-up; again if it was killed from inside). False if it cannot be."""
    try:
        mine, its = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    except OSError:
        return False
    try:
        pid = posix.fork()
    except OSError:
        mine.close()
        its.close()
        return False
    if pid == 0:
        mine.close()
        zygote(its)
    its.close()
    ZYGOTE[0] = (mine, pid)
    return True


def _launch(bash: str, command: str, env: dict, cwd: str, out_fd: int) -> int:
    """Ask the zygote to start the command; the read end of its report pipe (see zygote()). A zygote that
    is gone (killed from inside) is started again; BlockingIOError when it cannot be (EAGAIN)."""
    import os
    import socket

    fields = [bash, cwd, command, *(f"{k}={v}" for k, v in env.items())]
    message = b"\0".join(f.encode() for f in fields)
    r, w = os.pipe()
    try:
        for _ in range(2):
            with ZYGOTE_LOCK:
                if ZYGOTE[0] is None and not start_zygote():
                    raise BlockingIOError(11, "cannot start the zygote")
                sock, zpid = ZYGOTE[0]
            try:
                if len(message) <= ZYGOTE_MAX_MESSAGE:
                    socket.send_fds(sock, [message], [out_fd, w])
                else:
                    with open(os.memfd_create("legorl-request"), "w+b") as f:
                        f.write(message)
                        f.seek(0)
                        socket.send_fds(sock, [b"-"], [out_fd, w, f.fileno()])
                return r
            except OSError:
                with ZYGOTE_LOCK:
                    if ZYGOTE[0] is not None and ZYGOTE[0][0] is sock:
                        ZYGOTE[0] = None
                        sock.close()
                        _reap(zpid)
        raise BlockingIOError(11, "the zygote did not take the command")
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)


def _zygote_gone() -> bool:
    """Whether the zygote has exited (then forgotten: the next command starts a new one)."""
    with ZYGOTE_LOCK:
        if ZYGOTE[0] is None:
            return True
        sock, pid = ZYGOTE[0]
        try:
            if posix.waitpid(pid, posix.WNOHANG)[0] == 0:
                return False
        except ChildProcessError:
            pass
        ZYGOTE[0] = None
        sock.close()
        return True


def _reap(pid: int) -> None:
    try:
        posix.waitpid(pid, 0)
    except ChildProcessError:
        pass


def read_trimmed(f) -> str:
    """A command's output file, its head and tail when over MAX_OUTPUT (the grading pool reads its runs' alike)."""
    import os

    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    if size <= MAX_OUTPUT:
        data = f.read()
        return data.decode("utf-8", errors="replace")
    half = MAX_OUTPUT // 2
    head = f.read(half)
    f.seek(size - half)
    tail = f.read(half)
    note = f"\n... [{size - MAX_OUTPUT} bytes truncated] ...\n"
    return head.decode("utf-8", errors="replace") + note + tail.decode("utf-8", errors="replace")


def _follow(rfd: int, deadline: float, conn_fd: int) -> tuple:
    """Read the zygote's report on a command until its bash exits, the deadline passes or the client hangs
    up: (how it ended: "X", "E", "timed out", "cancelled", or "" if the report ended without a word; the
    pid of its bash or 0; the words of the report: X's wait status, or E's errno and message)."""
    import os
    import select
    import time

    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    if conn_fd >= 0:  # the client hanging up cancels the command
        poller.register(conn_fd, select.POLLRDHUP)
    buf, pid, eof = b"", 0, False
    while True:
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            kind, _, rest = line.decode(errors="replace").partition(" ")
            if kind == "P":
                pid = int(rest)
            elif kind in ("X", "E"):
                return kind, pid, rest.split(" ", 1)
        if eof:
            return "", pid, []
        left = deadline - time.monotonic()
        events = poller.poll(max(0, int(left * 1000) + 1)) if left > 0 else []
        if not events:
            return "timed out", pid, []
        for fd, _ in events:
            if fd != rfd:
                return "cancelled", pid, []
            data = os.read(rfd, 4096)
            buf, eof = buf + data, not data


def run_command(req: dict, conn_fd: int = -1) -> dict:
    import os
    import time

    timeout = float(req.get("timeout", 30))
    if FAILURE[0]:
        return {"error": FAILURE[0], "failure": FAILURE[0]}
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    cwd = req.get("cwd") or WORKDIR[0]
    command = req["command"]
    if CPU_LIMIT[0]:  # a bash builtin: no extra process
        command = f"ulimit -t {CPU_LIMIT[0]} 2>/dev/null; {command}"
    bash = _which("bash", env)
    # Output goes to an anonymous memory file, not a pipe: a background child that keeps a pipe open
    # must not block the reply after the command itself finished, and a full /tmp must not eat it.
    with open(os.memfd_create("legorl-out"), "w+b") as out:
        t0 = time.monotonic()
        for wait in (*FORK_RETRY_S, None):  # a start refused for the process budget (EAGAIN) is retried
            try:
                rfd = _launch(bash, command, env, cwd, out.fileno())
            except BlockingIOError:
                how, pid, words, rfd = "E", 0, ["11"], -1
            else:
                how, pid, words = _follow(rfd, t0 + timeout, conn_fd)
                if how in ("timed out", "cancelled") and not pid:  # not even started yet: give it a moment
                    later, pid, words = _follow(rfd, time.monotonic() + 5, -1)
                    how = later if later in ("E", "") else how
            if how == "" and not pid and _zygote_gone():  # it died (killed from inside) before starting it
                os.close(rfd)
                rfd = -1  # closed: the agent is threaded, a second close could hit another connection's fd
                if wait is None:
                    return {"output": ZYGOTE_GONE, "returncode": -1, "timed_out": False}
                continue
            if how != "E":
                break
            if rfd >= 0:
                os.close(rfd)
            if words[0] != "11":
                return {"output": f"failed to start command: {words[-1]}", "returncode": 127, "timed_out": False}
            if wait is None:
                reason = _exhausted("no command can start")
                return {"error": reason, "failure": reason}
            time.sleep(wait)
        try:
            note, ended, returncode = "", [], -1
            if how in ("timed out", "cancelled"):
                ended, at_limit = _end_tree(pid) if pid else ([], False)
                note = f"[legorl] {how} after {timeout:g} s" if how == "timed out" else \
                    f"[legorl] {how} after {time.monotonic() - t0:.1f} s"
                note += f"; ended {len(ended)} process{'es' if len(ended) != 1 else ''}"
                note += f": {_names(ended)}" if ended else ""
                if at_limit:
                    note += f" (the sandbox's process limit of {NPROC_LIMIT[0]} was reached: fork bomb?)"
            elif how == "X":
                returncode = os.waitstatus_to_exitcode(int(words[0]))
            output = read_trimmed(out)
        finally:
            if rfd >= 0:
                os.close(rfd)
    if note:
        output += ("" if not output or output.endswith("\n") else "\n") + note + "\n"
    reply = {"output": output, "returncode": returncode, "timed_out": how == "timed out", "ended": ended}
    if how == "cancelled":
        reply["cancelled"] = True
    return reply


def write_file(req: dict) -> dict:
    import base64
    import os

    path = req["path"]
    data = base64.b64decode(req["content_b64"]) if "content_b64" in req else req["content"].encode()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return {"ok": True}


def read_file(req: dict) -> dict:
    import base64

    limit = int(req.get("max_bytes", MAX_READ))
    with open(req["path"], "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        return {"error": f"{req['path']} is larger than {limit} bytes"}
    return {"content_b64": base64.b64encode(data).decode()}


def ping(req: dict) -> dict:
    return {"ok": not FAILURE[0], "failure": FAILURE[0]}


OPS = {
    "exec": run_command,
    "write_file": write_file,
    "read_file": read_file,
    "ping": ping,
    "quiesce": quiesce,
}


def _reply(req_line: bytes, conn_fd: int) -> dict:
    import json

    try:
        req = json.loads(req_line)
        op = req.get("op", "exec")
        return run_command(req, conn_fd) if op == "exec" else OPS[op](req)
    except Exception as e:  # noqa: BLE001 - a bad request must not kill the agent
        return {"error": f"{type(e).__name__}: {e}"}


def serve_control(fd: int) -> None:
    import json
    import socket

    conn = socket.socket(fileno=fd)
    with conn, conn.makefile("rwb") as f:
        for line in f:
            reply = _reply(line, fd)
            if reply.get("cancelled"):
                break  # the client hung up: nobody to answer
            try:
                f.write(json.dumps(reply).encode() + b"\n")
                f.flush()
            except OSError:
                break


def serve_one_inline(fd: int) -> None:
    """No thread could be started for this connection (the process budget is full): answer one
    request from the accepting thread. An exec cannot start either, so it reports the sandbox exhausted."""
    import json
    import socket

    conn = socket.socket(fileno=fd)
    conn.settimeout(2.0)
    try:
        with conn, conn.makefile("rwb") as f:
            line = f.readline()
            if not line:
                return
            try:
                req = json.loads(line)
            except ValueError:
                req = {}
            if req.get("op", "exec") == "exec":
                reason = _exhausted("the agent could not start a thread for a command")
                reply = {"error": reason, "failure": reason}
            else:
                reply = _reply(line, -1)
            f.write(json.dumps(reply).encode() + b"\n")
            f.flush()
    except OSError:
        pass


def _pump(src, dst) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(_socket.SHUT_WR)  # half-close: let the other direction finish
        except OSError:
            pass


def relay(fd: int, proxy_path: str) -> None:
    import socket

    client = socket.socket(fileno=fd)
    try:  # small request/response frames: without this each answer can wait ~40 ms (Nagle)
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:
        pass
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(proxy_path)
    except OSError:
        client.close()
        upstream.close()
        return
    done = _thread.allocate_lock()
    done.acquire()

    def back() -> None:
        try:
            _pump(upstream, client)
        finally:
            done.release()

    _thread.start_new_thread(back, ())
    _pump(client, upstream)
    done.acquire()
    client.close()
    upstream.close()


def accept_loop(server, handler, *args) -> None:
    while True:
        try:
            fd, _ = server._accept()
        except InterruptedError:
            continue
        except OSError:  # EMFILE and the like: the connection waits in the backlog
            _sleep(0.05)
            continue
        _start_thread(fd, handler, args)


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def _start_thread(fd: int, handler, args: tuple) -> None:
    """A thread for the connection; while the process budget is full (a thread counts against it too)
    retried for a moment, then the control socket answers inline and a relay connection is refused."""
    for wait in (*FORK_RETRY_S, None):
        try:
            _thread.start_new_thread(handler, (fd, *args))
            return
        except RuntimeError:  # "can't start new thread": EAGAIN
            if wait is None:
                break
            _sleep(wait)
    if handler is serve_control:
        serve_one_inline(fd)
    else:
        _exhausted("the relay could not start a thread for a model call")
        posix.close(fd)


def watch_lifeline() -> None:
    """Exit once stdin reaches end-of-file: the host that holds its write end has gone."""
    while True:
        try:
            if not posix.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    posix._exit(0)


def _warm_up() -> None:
    try:  # not dumpable: code run in the sandbox (a test run in its own namespaces: grading/zygote.py) may not
        import ctypes  # ptrace the agent or write its memory through /proc (a command's exec makes it dumpable)

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (ImportError, OSError, AttributeError):
        pass
    import array  # noqa: F401 - socket.send_fds
    import base64  # noqa: F401 - imported now so the first request does not pay for it
    import json  # noqa: F401
    import os  # noqa: F401
    import select  # noqa: F401
    import signal  # noqa: F401
    import socket  # noqa: F401
    import time  # noqa: F401


def main(argv: list) -> None:
    opts = parse_args(argv)
    WORKDIR[0] = opts["workdir"]
    if opts["nice"]:  # no CPU share of its own (no cgroup): every process of the sandbox yields to the host's
        posix.nice(int(opts["nice"]))
    if opts["limits"]:
        apply_limits(opts["limits"])
    if opts["relay"] is not None:
        port, proxy_path = opts["relay"]
        tcp = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        tcp.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        tcp.bind(("127.0.0.1", port))
        tcp.listen(128)
        _thread.start_new_thread(accept_loop, (tcp, relay, proxy_path))
    control_path = opts["control"]
    try:
        posix.unlink(control_path)
    except FileNotFoundError:
        pass
    ctl = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    ctl.bind(control_path)
    ctl.listen(128)
    try:  # opened before the uid drop: nothing inside can write it, the host's watchdog reads it
        flags = posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC | posix.O_CLOEXEC
        STATUS_FD[0] = posix.open(control_path.rpartition("/")[0] + "/failure", flags, 0o644)
    except OSError:
        pass
    _signal.signal(_signal.SIGTERM, lambda *_: posix._exit(0))
    if opts["uid"]:
        uid, gid = int(opts["uid"]), int(opts["gid"] or opts["uid"])
        posix.setgroups([])
        posix.setresgid(gid, gid, gid)
        posix.setresuid(uid, uid, uid)  # from 0 to non-zero: permitted, effective and ambient caps cleared
    # Tell the host we accept connections, then let go of the pipe.
    # The zygote first, while this process is still small (nothing imported yet) and before the host,
    # told we are ready, moves the sandbox's processes into its cgroup: it must be one of them.
    start_zygote()
    posix.write(1, b"ready\n")
    devnull = posix.open("/dev/null", posix.O_WRONLY)
    posix.dup2(devnull, 1)
    posix.close(devnull)
    if opts["lifeline"]:
        _thread.start_new_thread(watch_lifeline, ())
    _thread.start_new_thread(_warm_up, ())
    accept_loop(ctl, serve_control)


if __name__ == "__main__":
    main(sys.argv[1:])
