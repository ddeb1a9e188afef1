"""In-sandbox agent: runs as the sandbox's main process (stdlib only, no legorl imports).

It serves two things inside the sandbox:

* a control socket (JSON lines over a Unix socket, one thread per connection) that
  runs commands for the host or for a harness worker process;
* an optional TCP relay on 127.0.0.1:<port> (inside the sandbox's own network
  namespace) forwarding every connection byte-for-byte to the LLM proxy's Unix
  socket, so the harness reaches its model and nothing else.

Usage: python3 -I -S sandbox_agent.py CONTROL_SOCKET [--relay PORT PROXY_SOCKET]
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

MAX_OUTPUT = 2_000_000  # characters kept per command (head + tail) so one reply stays bounded


def _trim(text: str) -> str:
    if len(text) <= MAX_OUTPUT:
        return text
    half = MAX_OUTPUT // 2
    return text[:half] + f"\n... [{len(text) - MAX_OUTPUT} characters truncated] ...\n" + text[-half:]


def run_command(req: dict) -> dict:
    timeout = float(req.get("timeout", 30))
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in (req.get("env") or {}).items()})
    cwd = req.get("cwd") or "/workspace"
    # Output goes to a file, not a pipe: a background child that keeps the pipe open
    # must not block the reply after the command itself finished.
    with tempfile.TemporaryFile(dir="/tmp") as out:
        try:
            proc = subprocess.Popen(
                ["bash", "-c", req["command"]],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            return {"output": f"failed to start command: {e}", "returncode": 127, "timed_out": False}
        timed_out = False
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            returncode = -1
        out.seek(0)
        output = out.read().decode("utf-8", errors="replace")
    return {"output": _trim(output), "returncode": returncode, "timed_out": timed_out}


def write_file(req: dict) -> dict:
    path = req["path"]
    data = base64.b64decode(req["content_b64"]) if "content_b64" in req else req["content"].encode()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return {"ok": True}


def read_file(req: dict) -> dict:
    with open(req["path"], "rb") as f:
        return {"content_b64": base64.b64encode(f.read()).decode()}


OPS = {
    "exec": run_command,
    "write_file": write_file,
    "read_file": read_file,
    "ping": lambda req: {"ok": True},
}


def serve_control(conn: socket.socket) -> None:
    with conn, conn.makefile("rwb") as f:
        for line in f:
            try:
                req = json.loads(line)
                reply = OPS[req.get("op", "exec")](req)
            except Exception as e:  # noqa: BLE001 - a bad request must not kill the agent
                reply = {"error": f"{type(e).__name__}: {e}"}
            f.write(json.dumps(reply).encode() + b"\n")
            f.flush()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)  # half-close: let the other direction finish
        except OSError:
            pass


def relay(client: socket.socket, proxy_path: str) -> None:
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(proxy_path)
    except OSError:
        client.close()
        upstream.close()
        return
    t = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
    t.start()
    _pump(client, upstream)
    t.join()
    client.close()
    upstream.close()


def accept_loop(server: socket.socket, handler, *args) -> None:
    while True:
        conn, _ = server.accept()
        threading.Thread(target=handler, args=(conn, *args), daemon=True).start()


def main(argv: list[str]) -> None:
    control_path = argv[0]
    if len(argv) >= 4 and argv[1] == "--relay":
        port, proxy_path = int(argv[2]), argv[3]
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind(("127.0.0.1", port))
        tcp.listen(128)
        threading.Thread(target=accept_loop, args=(tcp, relay, proxy_path), daemon=True).start()
    if os.path.exists(control_path):
        os.unlink(control_path)
    tmp_path = control_path + ".tmp"
    if os.path.exists(tmp_path):
        os.unlink(tmp_path)
    ctl = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ctl.bind(tmp_path)
    ctl.listen(128)
    os.rename(tmp_path, control_path)  # appears only once it accepts: the host polls for it
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    accept_loop(ctl, serve_control)


if __name__ == "__main__":
    main(sys.argv[1:])
