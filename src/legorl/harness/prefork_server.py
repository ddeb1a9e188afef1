"""Forks a harness's Python, its modules imported once, into each rollout's sandbox.

An OpenHands episode spends ~85 % of its CPU importing the SDK (LiteLLM alone is 1,269 modules). This
server, run by the harness's own Python (3.12+: ``os.setns``) as root, imports the runner once, then
for each request forks a child that joins the sandbox's namespaces (cgroup, ipc, uts, net, pid, mount),
its cgroup, its resource limits, its niceness, its environment, and its uid (which clears every
capability), with no_new_privs set; that child forks the runner itself, which is then a process of the
sandbox's own pid namespace, as a command the sandbox agent starts is. The harness's code is the same;
only where its imports were done differs. The server reads no request itself (the child does): no
episode's data, such as its session token, is in the memory every later fork inherits. Nothing of
legorl is imported: stdlib only.

Usage: python -P prefork_server.py SOCKET RUNNER_FILE

The runner file defines ``preload()`` (the imports, run once here) and ``main() -> int`` (one episode,
run in the sandbox). The server prints ``ready`` when its socket listens, and exits when its stdin
reaches end-of-file (the host keeps the pipe and never writes: the server ends with its host).

A request is one connection: a JSON line {"pid": a process of the sandbox, "uid", "gid", "cgroups": [dirs
to join], "limits": {name: [soft, hard]}, "nice", "env": {...}, "cwd", "cpu": seconds or 0, "argv": [...]} with the file descriptor the runner writes its output to
(SCM_RIGHTS). The reply is one line, ``exit N`` or ``error MESSAGE``. A line ``kill`` from the host (or
its hanging up) ends the runner's session.
"""

import ctypes
import importlib.util
import json
import os
import resource
import select
import signal
import socket
import sys
import traceback

NAMESPACES = ("cgroup", "ipc", "uts", "net", "pid", "mnt")  # mnt last: it changes the root /proc is found in
PR_SET_NO_NEW_PRIVS = 38
PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # resolved on the host: the sandbox may not show ctypes' files


def load_runner(path: str):
    spec = importlib.util.spec_from_file_location("legorl_prefork_runner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.preload()
    return module


def enter_sandbox(req: dict) -> None:
    """Become a process of the sandbox whose member is req["pid"]: everything but its pid namespace, which
    only this process's children join."""
    pid = req["pid"]
    fds = [os.open(f"/proc/{pid}/ns/{name}", os.O_RDONLY) for name in NAMESPACES]  # before any is entered
    for cgroup in req["cgroups"]:  # its CPU share, through the host's cgroup tree (before the mounts change)
        try:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as e:
            raise OSError(e.errno, f"joining its cgroup {cgroup}: {e.strerror}") from None
    for name, fd in zip(NAMESPACES, fds):
        try:
            os.setns(fd, 0)
        except OSError as e:
            raise OSError(e.errno, f"joining its {name} namespace: {e.strerror}") from None
        os.close(fd)
    for name, (soft, hard) in req["limits"].items():
        infinity = resource.RLIM_INFINITY
        resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (infinity if soft < 0 else soft,
                                                                          infinity if hard < 0 else hard))
    os.setpriority(os.PRIO_PROCESS, 0, req["nice"])
    os.setgroups([])
    os.setresgid(req["gid"], req["gid"], req["gid"])
    os.setresuid(req["uid"], req["uid"], req["uid"])  # from root to another uid: every capability is cleared
    if PRCTL(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    os.chdir(req["cwd"])


def run_runner(runner, req: dict, out_fd: int) -> None:
    """In the sandbox's pid namespace: the runner's episode, its output to out_fd. Never returns."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.closerange(3, 1 << 16)  # nothing of the host's stays open in the sandbox
        if req.get("cpu"):
            resource.setrlimit(resource.RLIMIT_CPU, (req["cpu"], req["cpu"]))
        os.environ.clear()
        os.environ.update(req["env"])
        sys.argv = ["runner", *req.get("argv", [])]
        code = int(runner.main() or 0)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the runner's output, as an uncaught exception would be
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - its output is gone; the exit code still goes back
                pass
        os._exit(code)


def read_request(conn: socket.socket) -> tuple[dict, int]:
    """The request's JSON line and the descriptor that came with it."""
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 1)
    while not msg.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        msg += more
    if len(fds) != 1:
        raise ValueError("a request carries exactly one file descriptor (the runner's output)")
    return json.loads(msg), fds[0]


def serve_one(runner, conn: socket.socket) -> None:
    """In a child of the server: read the request, enter the sandbox, start the runner in it, report its exit.
    Never returns."""
    try:
        req, out_fd = read_request(conn)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server ignores it (auto-reap); this child waits
        enter_sandbox(req)
        child = os.fork()
        if child == 0:
            conn.close()
            run_runner(runner, req, out_fd)
        os.close(out_fd)
        pidfd = os.pidfd_open(child)
        while True:
            ready, _, _ = select.select([conn, pidfd], [], [])
            if pidfd in ready:
                break
            if conn.recv(64) in (b"", b"kill\n"):  # the host gave up on it (timeout) or went away
                os.killpg(child, signal.SIGKILL)
                break
        _, status = os.waitpid(child, 0)
        conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except BaseException as e:  # noqa: BLE001 - the host gets the reason
        try:
            conn.sendall(f"error {type(e).__name__}: {e}\n".replace("\n", " ").strip().encode() + b"\n")
        except OSError:
            pass
    os._exit(0)


def main(argv: list) -> int:
    sock_path, runner_path = argv
    runner = load_runner(runner_path)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # request children are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    os.chmod(sock_path, 0o600)
    server.listen(64)
    print("ready", flush=True)
    os.dup2(2, 1)  # the host reads no more of stdout: anything printed later goes to the log
    while True:
        ready, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return 0  # the host is gone
        if server not in ready:
            continue
        conn, _ = server.accept()
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:  # the request is read in the child: no episode's data (its token) stays in the
            server.close()  # server's memory, which every later episode's fork would inherit
            serve_one(runner, conn)
        conn.close()

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
