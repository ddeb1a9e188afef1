"""Real bubblewrap sandboxes: isolation, relay, timeouts, cleanup."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from legorl.sandbox.bwrap import BwrapSandbox, process_tree, reap_orphans
from legorl.sandbox.client import SandboxClient

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def run(coro):
    return asyncio.run(coro)


async def make(tmp: Path, **kw) -> BwrapSandbox:
    ws = kw.pop("workspace", tmp / "ws")
    ws.mkdir(parents=True, exist_ok=True)
    return await BwrapSandbox.create(workspace=ws, sandbox_dir=tmp / "sb", label="test-run", **kw)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_exec_cwd_writes_and_readonly_root(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path)
        try:
            r = await box.exec("pwd; echo $LEGORL_SANDBOX; echo data > out.txt")
            assert r.returncode == 0 and r.output.split() == ["/workspace", "test-run"]
            assert (tmp_path / "ws" / "out.txt").read_text() == "data\n"
            r = await box.exec("touch /usr/legorl_escape 2>&1; echo rc=$?")
            assert "rc=1" in r.output and not Path("/usr/legorl_escape").exists()
            r = await box.exec("exit 3")
            assert (r.returncode, r.timed_out) == (3, False)
            r = await box.exec("python -c 'import pytest; print(\"pytest-ok\")'")  # venv python first on PATH
            assert "pytest-ok" in r.output
            label = json.loads((tmp_path / "sb" / "label.json").read_text())
            assert label == {**label, "label": "test-run", "bwrap_pid": box.pid}
        finally:
            await box.close()

    run(main())


def test_hidden_path_is_empty_but_workspace_below_it_works() -> None:
    # Outside /tmp on purpose: the sandbox's /tmp is a fresh tmpfs anyway.
    root = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="legorl-test-"))
    try:
        run_dir = root / "run"
        (run_dir / "hidden").mkdir(parents=True)
        (run_dir / "hidden" / "test_hidden.py").write_text("SECRET = 1\n")
        (root / "visible.txt").write_text("v\n")

        async def main() -> None:
            box = await make(root / "box", workspace=run_dir / "ws", hide_paths=[run_dir])
            try:
                r = await box.exec(f"ls -A {run_dir} | wc -l; cat {root}/visible.txt; echo x > f; cat f")
                assert r.output.split() == ["0", "v", "x"], r.output
                assert (run_dir / "ws" / "f").read_text() == "x\n"
            finally:
                await box.close()

        run(main())
    finally:
        shutil.rmtree(root)


def test_no_network_but_relay_reaches_proxy_socket(tmp_path: Path) -> None:
    host_tcp = socket.create_server(("127.0.0.1", 0))
    port = host_tcp.getsockname()[1]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        body = b"hello from proxy " + request.split(b" ")[1]
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    async def main() -> None:
        proxy_sock = tmp_path / "proxy.sock"
        server = await asyncio.start_unix_server(handle, path=str(proxy_sock))
        box = await make(tmp_path, proxy_socket=proxy_sock, relay_port=18123)
        try:
            probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('CONNECTED')"
            r = await box.exec(f'python3 -c "{probe}" 2>&1 | tail -n 1')
            assert "CONNECTED" not in r.output and "Error" in r.output
            fetch = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:18123/v1/models').read().decode())"
            r = await box.exec(f'python3 -c "{fetch}"', timeout=20)
            assert r.output.strip() == "hello from proxy /v1/models", r.output
        finally:
            await box.close()
            server.close()
            host_tcp.close()

    run(main())


def test_timeout_kills_process_group_and_sandbox_survives(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path)
        try:
            r = await box.exec("echo started; sleep 100", timeout=1)
            assert r.timed_out and r.returncode == -1 and "started" in r.output
            r = await box.exec("pgrep -x sleep || echo no-sleep")
            assert r.output.strip() == "no-sleep"
            results = await asyncio.gather(*(box.exec(f"echo {i}") for i in range(8)))  # concurrent
            assert [x.output.strip() for x in results] == [str(i) for i in range(8)]
        finally:
            await box.close()

    run(main())


def test_close_leaves_no_process_and_is_idempotent(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path)
        await box.exec("setsid sleep 1000 >/dev/null 2>&1 & sleep 1000 >/dev/null 2>&1 &")
        pids = process_tree(box.pid)
        assert len(pids) >= 4  # bwrap, its pid-1, the agent, the sleeps
        await box.close()
        await box.close()
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not [p for p in pids if alive(p)]

    run(main())


def test_reap_orphans_kills_leftover_sandboxes(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path / "sandboxes" / "r1")
        pids = process_tree(box.pid)
        killed = await reap_orphans(tmp_path / "sandboxes")
        assert killed == [box.pid]
        deadline = time.monotonic() + 5
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not [p for p in pids if alive(p)]
        await box.close()
        assert await reap_orphans(tmp_path / "sandboxes") == []

    run(main())


def test_sandbox_client_from_another_process(tmp_path: Path) -> None:
    # A long host path: the client must get around the 108-byte sockaddr_un limit.
    deep = tmp_path / ("d" * 60) / ("e" * 40)

    async def main() -> None:
        box = await make(deep)
        assert len(str(box.control_socket)) > 108
        try:
            code = (
                "import sys; from legorl.sandbox.client import SandboxClient; "
                "r = SandboxClient(sys.argv[1]).exec('echo from-worker $PWD; exit 4', timeout=10); "
                "print(r.output.strip(), r.returncode)"
            )
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", code, str(box.control_socket), stdout=subprocess.PIPE
            )
            out, _ = await proc.communicate()
            assert out.decode().strip() == "from-worker /workspace 4"
            assert SandboxClient(box.control_socket).exec("echo same", timeout=5).output == "same\n"
        finally:
            await box.close()
        assert not SandboxClient(box.control_socket).ping(timeout=1)

    run(main())


def test_memory_limit_applies(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path, memory_mb=512)
        try:
            r = await box.exec("python3 -c 'b = bytearray(900 * 1024 * 1024)' 2>&1 | tail -n 1")
            assert "MemoryError" in r.output
            assert (await box.exec("echo ok")).output == "ok\n"
        finally:
            await box.close()

    run(main())


def test_failed_start_reports_bwrap_error(tmp_path: Path) -> None:
    from legorl.sandbox.client import SandboxError

    with pytest.raises(SandboxError, match="proxy socket"):
        run(make(tmp_path, proxy_socket=tmp_path / "missing.sock"))
    assert not os.path.exists(tmp_path / "sb" / "label.json")
