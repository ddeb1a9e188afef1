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

Each command runs as ``bash -c`` below a shim of its own: a forked child of the agent that is a
child subreaper (PR_SET_CHILD_SUBREAPER), so everything the command starts (background jobs,
double forks, ``setsid`` daemons) stays below it and is reaped by it. When the command times out
or its client hangs up, that whole tree is killed, and only that tree: concurrent commands each
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
PRCTL = [None]  # libc prctl (ctypes), resolved once; False where unavailable
LINGERING = set()  # shims of finished commands whose background processes still run (reaped once they exit)
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
    """libc's prctl, resolved once in the agent (a forked shim must not load anything)."""
    if PRCTL[0] is None:
        with LOCK:
            if PRCTL[0] is None:
                try:
                    import ctypes

                    PRCTL[0] = ctypes.CDLL(None, use_errno=True).prctl
                except (ImportError, OSError, AttributeError):
                    PRCTL[0] = False
    return PRCTL[0]


def _scan() -> dict:
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


def _end_tree(shim: int, budget: float = 10.0) -> tuple:
    """SIGKILL everything below the command's shim until nothing is left; (names ended, limit reached).

    The shim is a child subreaper: whatever the command started (background jobs, double forks,
    ``setsid`` daemons) stays below it, and what a kill orphans is reparented to it. Rounds repeat
    while a fork bomb still has children in flight.
    """
    import os
    import signal
    import time

    ended, at_limit = {}, False
    deadline = time.monotonic() + budget
    first = True
    while time.monotonic() < deadline:
        procs = _scan()
        if first:
            at_limit, first = _at_limit(procs), False
        live = [p for p in _below(shim, procs) if procs[p][1] != b"Z"]
        if not live:
            break
        for pid in live:
            ended.setdefault(pid, procs[pid][3])
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.002)  # let the killed die before looking again
    return list(ended.values()), at_limit


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
    procs = _scan()
    names = [procs[p][3] for p in procs if p != 1]
    limit = f" of {NPROC_LIMIT[0]}" if NPROC_LIMIT[0] else ""
    return _declare(f"process limit exhausted: fork bomb? {_tasks(procs)}{limit} processes and threads of the "
                    f"sandbox in use ({_names(names)}); {what}")


def _reap_lingering() -> None:
    """Reap the shims of finished commands that have exited since. Under the lock, and only pids still in
    the set: a pid there is an unreaped child, so it cannot have been reused."""
    import os

    with LOCK:
        for pid in list(LINGERING):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    LINGERING.discard(pid)
            except ChildProcessError:
                LINGERING.discard(pid)


def _which(name: str, env: dict) -> str:
    import os

    for d in (env.get("PATH") or "/usr/bin:/bin").split(":"):
        path = os.path.join(d or ".", name)
        if os.access(path, os.X_OK):
            return path
    return "/bin/" + name


def _children_left() -> bool:
    """Whether this process still has children (reaping those that already exited)."""
    import os

    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return True
        except ChildProcessError:
            return False


def _shim(bash: str, argv: list, env: dict, cwd: str, out_fd: int, wfd: int) -> None:
    """The forked child between the agent and ``bash -c``: a child subreaper that reaps everything the
    command leaves behind. It reports on ``wfd``: ``S`` once bash runs (``E <errno> <message>`` if it
    cannot start), ``X <wait status> <1 if processes remain>`` when bash exits, and end-of-file once
    it has no child left. Never returns."""
    import os
    import signal

    code = 0
    try:
        try:
            if PRCTL[0]:
                PRCTL[0](36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of the command reparent here
                PRCTL[0](15, b"legorl-shim", 0, 0, 0)  # PR_SET_NAME: what `ps` shows for it
            null = os.open("/dev/null", os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out_fd, 1)
            os.dup2(out_fd, 2)
            os.closerange(3, wfd)  # nothing of the agent (sockets, other commands' pipes) stays open here
            os.closerange(wfd + 1, 1 << 16)
            os.chdir(cwd)
            bash_pid = os.posix_spawn(bash, argv, env, setsid=True, setsigmask=(),
                                      setsigdef=(signal.SIGPIPE, signal.SIGXFSZ))
        except OSError as e:
            os.write(wfd, f"E {e.errno or 0} {e}\n".encode())
            code = 127
            return
        os.write(wfd, b"S\n")
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if pid == bash_pid:
                left = _children_left()
                try:
                    os.write(wfd, f"X {status} {int(left)}\n".encode())
                except OSError:
                    pass
                if not left:
                    break
    finally:
        os._exit(code)


def _start(command: str, env: dict, cwd: str, out_fd: int) -> tuple:
    """Start the command below its shim: (shim pid, read end of its report pipe). A fork or spawn refused
    for the process budget (EAGAIN) is retried for a moment, then the sandbox is declared exhausted."""
    import os
    import time

    _prctl()
    bash = _which("bash", env)
    argv = ["bash", "-c", command]
    for wait in (*FORK_RETRY_S, None):
        _reap_lingering()  # a finished shim counts against the budget until it is reaped
        r, w = os.pipe()
        try:
            pid = os.fork()
        except BlockingIOError:  # EAGAIN: RLIMIT_NPROC
            os.close(r)
            os.close(w)
        except BaseException:
            os.close(r)
            os.close(w)
            raise
        else:
            if pid == 0:
                _shim(bash, argv, env, cwd, out_fd, w)
            os.close(w)
            line = b""
            while not line.endswith(b"\n"):
                chunk = os.read(r, 1)
                if not chunk:
                    break
                line += chunk
            if line == b"S\n":
                return pid, r
            os.close(r)
            os.waitpid(pid, 0)
            errno, _, message = line.decode(errors="replace")[2:].strip().partition(" ")
            if errno != "11":
                raise StartFailed(message or "the command's supervisor died")
        if wait is None:
            raise SandboxExhausted(_exhausted("no command can start"))
        time.sleep(wait)
    raise AssertionError("unreachable")


class SandboxExhausted(Exception):
    """No command can start: the sandbox's process budget is full."""


class StartFailed(Exception):
    """bash could not be started (a bad cwd, ...)."""


def _read_report(rfd: int, buf: bytes) -> tuple:
    """(buffer, eof) after one read of the shim's report pipe."""
    import os

    data = os.read(rfd, 4096)
    return buf + data, not data


def _wait_gone(shim: int, rfd: int, buf: bytes, eof: bool, budget: float) -> bytes:
    """Wait until the shim has reaped everything and exited (its pipe at end-of-file), then reap it."""
    import os
    import select
    import signal

    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    while not eof and poller.poll(int(budget * 1000)):
        buf, eof = _read_report(rfd, buf)
    if not eof:  # stuck (stopped by the command?): it goes too
        try:
            os.kill(shim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.waitpid(shim, 0)
    except ChildProcessError:
        pass
    return buf


def _read_trimmed(f) -> str:
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


def run_command(req: dict, conn_fd: int = -1) -> dict:
    import os
    import select
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
    # Output goes to an anonymous memory file, not a pipe: a background child that keeps a pipe open
    # must not block the reply after the command itself finished, and a full /tmp must not eat it.
    with open(os.memfd_create("legorl-out"), "w+b") as out:
        t0 = time.monotonic()
        try:
            shim, rfd = _start(command, env, cwd, out.fileno())
        except SandboxExhausted as e:
            return {"error": str(e), "failure": str(e)}
        except (OSError, StartFailed) as e:
            return {"output": f"failed to start command: {e}", "returncode": 127, "timed_out": False}
        try:
            poller = select.poll()
            poller.register(rfd, select.POLLIN)
            if conn_fd >= 0:  # the client hanging up cancels the command
                poller.register(conn_fd, select.POLLRDHUP)
            buf, eof, ended_by = b"", False, ""
            while b"\n" not in buf and not eof:
                left = t0 + timeout - time.monotonic()
                events = poller.poll(max(0, int(left * 1000) + 1)) if left > 0 else []
                if not events:
                    ended_by = "timed out"
                    break
                for fd, _ in events:
                    if fd == rfd:
                        buf, eof = _read_report(rfd, buf)
                    else:
                        ended_by = "cancelled"
                if ended_by:
                    break
            note, ended, returncode = "", [], -1
            if ended_by:
                ended, at_limit = _end_tree(shim)
                buf = _wait_gone(shim, rfd, buf, eof, 5.0)
                note = f"[legorl] {ended_by} after {timeout:g} s" if ended_by == "timed out" else \
                    f"[legorl] {ended_by} after {time.monotonic() - t0:.1f} s"
                note += f"; ended {len(ended)} process{'es' if len(ended) != 1 else ''}"
                note += f": {_names(ended)}" if ended else ""
                if at_limit:
                    note += f" (the sandbox's process limit of {NPROC_LIMIT[0]} was reached: fork bomb?)"
            else:
                kind, *rest = buf.split(b"\n", 1)[0].decode().split(" ", 2)
                if kind == "X":
                    returncode = os.waitstatus_to_exitcode(int(rest[0]))
                    if rest[1] == "1":
                        with LOCK:  # it reaps what the command left running; reaped itself once it exits
                            LINGERING.add(shim)
                    else:
                        _wait_gone(shim, rfd, buf, eof, 5.0)
                else:  # the shim died without a report (killed from inside)
                    _wait_gone(shim, rfd, buf, eof, 5.0)
            output = _read_trimmed(out)
        finally:
            os.close(rfd)
    if note:
        output += ("" if not output or output.endswith("\n") else "\n") + note + "\n"
    reply = {"output": output, "returncode": returncode, "timed_out": ended_by == "timed out", "ended": ended}
    if ended_by == "cancelled":
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
    import base64  # noqa: F401 - imported now so the first request does not pay for it
    import json  # noqa: F401
    import os  # noqa: F401
    import select  # noqa: F401
    import signal  # noqa: F401
    import socket  # noqa: F401
    import time  # noqa: F401

    _prctl()


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
