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
           [--uid UID --gid GID] [--lifeline]

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
WORKDIR = ["/workspace"]


def parse_args(argv: list) -> dict:
    opts = {"control": argv[0], "relay": None, "limits": "", "workdir": "/workspace", "uid": "", "gid": "",
            "lifeline": False}
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--relay":
            opts["relay"] = (int(argv[i + 1]), argv[i + 2])
            i += 3
        elif arg == "--lifeline":
            opts["lifeline"] = True
            i += 1
        elif arg in ("--limits", "--workdir", "--uid", "--gid"):
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
        which = names[key]
        _, hard = resource.getrlimit(which)
        v = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
        resource.setrlimit(which, (v, v))  # hard too: nothing inside can raise it back


def _wait_ready(pid: int, timeout: float) -> bool:
    """True once pid has exited (not reaped), False after timeout."""
    import os
    import select

    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): poll the way Popen.wait(timeout) does
        import time

        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
            time.sleep(0.002)
        return False
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(max(0, int(timeout * 1000))))
    finally:
        os.close(fd)


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


def run_command(req: dict) -> dict:
    import os
    import signal
    import subprocess

    timeout = float(req.get("timeout", 30))
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    cwd = req.get("cwd") or WORKDIR[0]
    command = req["command"]
    if CPU_LIMIT[0]:  # a bash builtin: no extra process, and no preexec_fn (which would rule out vfork)
        command = f"ulimit -t {CPU_LIMIT[0]} 2>/dev/null; {command}"
    # Output goes to an anonymous memory file, not a pipe: a background child that keeps a pipe open
    # must not block the reply after the command itself finished, and a full /tmp must not eat it.
    with open(os.memfd_create("legorl-out"), "w+b") as out:
        try:
            proc = subprocess.Popen(
                ["bash", "-c", command],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            return {"output": f"failed to start command: {e}", "returncode": 127, "timed_out": False}
        # Block on a pidfd with the timeout (Popen.wait(timeout) would poll with growing sleeps).
        timed_out = not _wait_ready(proc.pid, timeout)
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            returncode = -1
        else:
            returncode = proc.wait()
        output = _read_trimmed(out)
    return {"output": output, "returncode": returncode, "timed_out": timed_out}


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


OPS = {
    "exec": run_command,
    "write_file": write_file,
    "read_file": read_file,
    "ping": lambda req: {"ok": True},
}


def serve_control(fd: int) -> None:
    import json
    import socket

    conn = socket.socket(fileno=fd)
    with conn, conn.makefile("rwb") as f:
        for line in f:
            try:
                req = json.loads(line)
                reply = OPS[req.get("op", "exec")](req)
            except Exception as e:  # noqa: BLE001 - a bad request must not kill the agent
                reply = {"error": f"{type(e).__name__}: {e}"}
            f.write(json.dumps(reply).encode() + b"\n")
            f.flush()


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
        _thread.start_new_thread(handler, (fd, *args))


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
    import socket  # noqa: F401
    import subprocess  # noqa: F401


def main(argv: list) -> None:
    opts = parse_args(argv)
    WORKDIR[0] = opts["workdir"]
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
