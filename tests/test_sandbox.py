"""Real sandboxes: isolation, visible root, relay, timeouts, limits, watchdog, cleanup, reaping.

Tests taking ``box_cfg`` run on both backends (bubblewrap, and docker against podman's Docker API:
tests/backends.py); the others test what one backend does its own way (bwrap's process tree and
lifeline, a container's engine-side clean-up and reaping)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from helpers import run_processes, wait_until_async

from legorl.config import SandboxConfig
from legorl.sandbox import SandboxError, SandboxLimits, create_sandbox, reap_sandboxes
from legorl.sandbox.bwrap import BwrapSandbox, process_tree, reap_orphans
from legorl.sandbox.client import SandboxClient
from legorl.sandbox.procs import alive
from legorl.sandbox.rootfs import visible_paths

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
ROOT = os.geteuid() == 0


def run(coro):
    return asyncio.run(coro)


async def make(tmp: Path, cfg: SandboxConfig | None = None, **kw):
    """A sandbox of the backend `cfg` names (default bwrap) on `tmp`/ws."""
    ws = kw.pop("workspace", tmp / "ws")
    ws.mkdir(parents=True, exist_ok=True)
    return await create_sandbox(cfg, workspace=ws, sandbox_dir=tmp / "sb", label=kw.pop("label", "test-run"), **kw)


async def containers(cfg: SandboxConfig, label: str) -> list[str]:
    """Ids of the engine's containers (any state) carrying this run label."""
    from legorl.sandbox.docker import LABEL_KEY, _docker

    rc, out = await _docker("docker", "ps", "-aq", "--filter", f"label={LABEL_KEY}={label}", docker_host=cfg.docker_host)
    assert rc == 0, out
    return out.split()


async def wait_dead(pids: list[int], timeout: float = 5) -> list[int]:
    """Those of `pids` still alive once they all died or `timeout` seconds passed."""
    await wait_until_async(lambda: not any(alive(p) for p in pids), timeout, interval=0.05)
    return [p for p in pids if alive(p)]


def test_exec_cwd_writes_readonly_root_and_identity(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    async def main() -> None:
        box = await make(tmp_path, box_cfg)
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
            r = await box.exec("id -u; grep -E '^Cap(Prm|Eff|Amb)' /proc/self/status; grep NoNewPrivs /proc/self/status")
            lines = r.output.split("\n")
            if ROOT:  # a root driver's sandbox runs under a uid of its own, with no capability at all
                assert int(lines[0]) >= 200_000, r.output
            assert all(x.split()[1] == "0000000000000000" for x in lines[1:4]), r.output
            assert lines[4].split()[1] == "1"
            r = await box.exec("python -c 'import os; os.setuid(0)' 2>&1 | tail -n 1")
            assert "PermissionError" in r.output
            if box_cfg.kind == "bwrap":
                label = json.loads((tmp_path / "sb" / "label.json").read_text())
                assert label == {**label, "label": "test-run", "bwrap_pid": box.pid}
        finally:
            await box.close()

    run(main())


@needs_bwrap
def test_visible_root_is_system_dirs_and_runtimes_only(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path)
        try:
            r = await box.exec("ls /")
            # System dirs, the sandbox's own mounts, and the top dir of each runtime (the interpreter, the venv:
            # /root/.pyenv and /work/main/.venv here, /check/<repo>/.venv on CI) -- and nothing else.
            runtimes = {Path(p).parts[1] for p in visible_paths()}
            system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "run", "sbin", "tmp", "usr", "var",
                      "workspace"}
            assert set(r.output.split()) <= system | runtimes, (set(r.output.split()) - system - runtimes, runtimes)
            src = Path(__file__).resolve().parents[1] / "src" / "legorl"
            checks = {
                "host tmp": f"ls {tmp_path}",  # the host's /tmp (where this test's dirs are)
                "legorl sources": f"ls {src}",
                "home": "ls /root/.bashrc /home/*",
                "shadow": "cat /etc/shadow",
                "sys": "ls /sys/kernel",
            }
            for name, cmd in checks.items():
                r = await box.exec(f"{{ {cmd}; }} 2>/dev/null")
                assert r.output.strip() == "", (name, r.output)
            py = os.path.realpath(sys.executable)
            r = await box.exec(f"test -x {py} && node -e 'console.log(6*7)' && git --version >/dev/null && echo ok")
            assert r.output.split() == ["42", "ok"], r.output
        finally:
            await box.close()

    run(main())


@needs_bwrap
def test_a_venv_reached_through_a_symlink_is_on_path_by_the_name_the_sandbox_mounts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout reached through a symlink (~/proj -> /data/proj) puts its venv at a name the sandbox does not
    have: it mounts paths resolved. PATH must name the venv the same way, or `python` is the system one."""
    venv_bin = Path(sys.executable).parent
    (tmp_path / "link").symlink_to(venv_bin.parent)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "link" / venv_bin.name / Path(sys.executable).name))

    async def main() -> None:
        box = await make(tmp_path)
        try:
            r = await box.exec("echo $PATH; command -v python; python -c 'import pytest; print(\"pytest-ok\")'")
            first, python, ok = r.output.split()
            assert first.split(":")[0] == os.path.realpath(venv_bin), r.output
            assert (python, ok) == (f"{os.path.realpath(venv_bin)}/python", "pytest-ok"), r.output
        finally:
            await box.close()

    run(main())


def test_hidden_path_is_empty_but_workspace_below_it_works(box_cfg: SandboxConfig) -> None:
    # Outside /tmp on purpose: the sandbox's /tmp is a fresh tmpfs anyway.
    root = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="legorl-test-"))
    os.chmod(root, 0o755)
    try:
        run_dir = root / "run"
        (run_dir / "hidden").mkdir(parents=True)
        (run_dir / "hidden" / "test_hidden.py").write_text("SECRET = 1\n")
        (root / "visible.txt").write_text("v\n")

        async def main() -> None:
            box = await make(root / "box", box_cfg, workspace=run_dir / "ws", hide_paths=[run_dir], visible_paths=[root])
            try:
                r = await box.exec(f"ls -A {run_dir} 2>/dev/null | wc -l; cat {root}/visible.txt; echo x > f; cat f")
                assert r.output.split() == ["0", "v", "x"], r.output
                assert (run_dir / "ws" / "f").read_text() == "x\n"
                r = await box.exec(f"touch {root}/new 2>&1; echo rc=$?")
                assert "rc=1" in r.output and not (root / "new").exists()
            finally:
                await box.close()

        run(main())
    finally:
        shutil.rmtree(root)


def test_no_network_but_relay_reaches_proxy_socket(tmp_path: Path, box_cfg: SandboxConfig) -> None:
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
        box = await make(tmp_path, box_cfg, proxy_socket=proxy_sock, relay_port=18123)
        try:
            probe = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=3); print('CONNECTED')"
            r = await box.exec(f'python3 -c "{probe}" 2>&1 | tail -n 1')
            assert "CONNECTED" not in r.output and "Error" in r.output
            # A name lookup fails at once (Codex's musl resolver otherwise waits 5 s a lookup at its exit)
            r = await box.exec("grep -c '^options timeout:0 attempts:1' /etc/resolv.conf; python3 -c \"import socket\n"
                               "try: socket.getaddrinfo('example.com', 443)\nexcept socket.gaierror: print('no name')\"")
            assert r.output.split() == ["1", "no", "name"], r.output
            fetch = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:18123/v1/models').read().decode())"
            r = await box.exec(f'python3 -c "{fetch}"', timeout=20)
            assert r.output.strip() == "hello from proxy /v1/models", r.output
        finally:
            await box.close()
            server.close()
            host_tcp.close()

    run(main())


def test_timeout_kills_process_group_and_sandbox_survives(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    async def main() -> None:
        box = await make(tmp_path, box_cfg)
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


@needs_bwrap
def test_close_leaves_no_process_and_is_idempotent(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path)
        await box.exec("setsid sleep 1000 >/dev/null 2>&1 & sleep 1000 >/dev/null 2>&1 &")
        pids = process_tree(box.pid)
        assert len(pids) >= 4  # bwrap, its pid-1, the agent, the sleeps
        await box.close()
        await box.close()
        assert not await wait_dead(pids)

    run(main())


@needs_bwrap
def test_cancelled_creation_never_hangs_or_leaks_a_sandbox(tmp_path: Path) -> None:
    """A straggler cancelled while its sandbox starts (any moment) returns promptly and leaves no bwrap."""
    async def main() -> None:
        for i, delay in enumerate([0, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3]):
            ws = tmp_path / f"ws{i}"
            ws.mkdir()
            task = asyncio.ensure_future(BwrapSandbox.create(workspace=ws, sandbox_dir=tmp_path / f"sb{i}",
                                                             label="test-cancel"))
            await asyncio.sleep(delay)
            task.cancel()
            try:
                box = await asyncio.wait_for(task, 20)  # a hang fails the test instead of wedging it
            except asyncio.CancelledError:
                continue
            await box.close()  # it was ready before the cancellation landed
        await wait_until_async(lambda: not run_processes(tmp_path, kinds=("bwrap",)), timeout=10, interval=0.1)
        assert run_processes(tmp_path, kinds=("bwrap",)) == []

    run(main())


@needs_bwrap
def test_sandbox_ends_when_its_host_lets_go_of_the_lifeline(tmp_path: Path) -> None:
    """The agent exits when the host's end of its stdin closes: a host SIGKILLed before bwrap armed
    --die-with-parent (the moment just after fork) closes that pipe too, so no sandbox outlives it."""
    async def main() -> None:
        box = await make(tmp_path)
        await box.exec("setsid sleep 1000 >/dev/null 2>&1 &")
        pids = process_tree(box.pid)
        assert len(pids) >= 4 and box.proc.stdin is not None
        box.proc.stdin.close()  # what the kernel does to the pipe when the host process dies
        assert not await wait_dead(pids, timeout=20)
        await box.close()

    run(main())


@needs_bwrap
def test_reap_orphans_kills_leftover_sandboxes(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path / "sandboxes" / "r1")
        pids = process_tree(box.pid)
        killed = await reap_orphans(tmp_path / "sandboxes")
        assert killed == [box.pid]
        assert not await wait_dead(pids)
        await box.close()
        assert await reap_orphans(tmp_path / "sandboxes") == []

    run(main())


DRIVER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from legorl.sandbox.bwrap import BwrapSandbox, process_tree

    async def main():
        root = Path(sys.argv[1])
        (root / "ws").mkdir(parents=True)
        box = await BwrapSandbox.create(workspace=root / "ws", sandbox_dir=root / "sb", label=sys.argv[2])
        await box.exec("setsid sleep 3000 >/dev/null 2>&1 &")
        print(" ".join(map(str, process_tree(box.pid))), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


@needs_bwrap
def test_sandboxes_of_a_sigkilled_driver_are_gone_after_the_next_start(tmp_path: Path) -> None:
    """A driver killed with SIGKILL: --die-with-parent takes its sandboxes down, and the next start's
    reap_orphans (by dir and by run label) catches anything that survived."""
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "sandboxes" / "r1"), "run-xyz"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) >= 4 and all(alive(p) for p in pids)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        run(reap_orphans(tmp_path / "sandboxes", label="run-xyz"))  # what the next driver does first
        assert not run(wait_dead(pids)), "sandbox processes outlived their killed driver"
    finally:
        proc.kill()
        proc.wait()


def test_sandbox_client_from_another_process(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    # A long host path: the client must get around the 108-byte sockaddr_un limit.
    deep = tmp_path / ("d" * 60) / ("e" * 40)

    async def main() -> None:
        box = await make(deep, box_cfg)
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
            client = SandboxClient(box.control_socket)
            assert client.exec("echo same", timeout=5).output == "same\n"
            client.write_file("/workspace/x.bin", b"\x00\x01")
            assert client.read_file("/workspace/x.bin") == b"\x00\x01"
        finally:
            await box.close()
        assert not SandboxClient(box.control_socket).ping(timeout=1)

    run(main())


def test_custom_inside_workspace(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    async def main() -> None:
        box = await make(tmp_path, box_cfg, inside_workspace="/app")
        try:
            assert (await box.exec("pwd; touch made")).output.strip() == "/app"
            assert (tmp_path / "ws" / "made").exists()
            assert box.inside_workspace == "/app"
        finally:
            await box.close()

    run(main())


def test_failed_start_reports_the_error(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    with pytest.raises(SandboxError, match="proxy socket"):
        run(make(tmp_path, box_cfg, proxy_socket=tmp_path / "missing.sock"))
    assert not os.path.exists(tmp_path / "sb" / "label.json")


# ---- the docker backend's own view and clean-up ---------------------------------------------------


def test_container_shows_its_image_and_nothing_of_the_host(tmp_path: Path, docker_box_cfg: SandboxConfig) -> None:
    marker = tmp_path / "host-only.txt"
    marker.write_text("host\n")

    async def main() -> None:
        box = await make(tmp_path, docker_box_cfg)
        try:
            src = Path(__file__).resolve().parents[1] / "src" / "legorl"
            for name, cmd in {"host tmp": f"cat {marker}", "legorl sources": f"ls {src}", "host venv": f"ls {sys.prefix}",
                              "home": "ls -A /root/ /home/ | grep -v :", "shadow": "cat /etc/shadow", "docker socket":
                              "ls /run/podman /var/run/docker.sock"}.items():  # fmt: skip
                r = await box.exec(f"{{ {cmd}; }} 2>/dev/null")
                assert r.output.strip() == "", (name, r.output)
            r = await box.exec("python3 -c 'import pytest; print(pytest.__name__)'; git --version >/dev/null && echo ok")
            assert r.output.split() == ["pytest", "ok"], r.output
        finally:
            await box.close()

    run(main())


def test_container_close_removes_it_and_is_idempotent(tmp_path: Path, docker_box_cfg: SandboxConfig) -> None:
    async def main() -> None:
        box = await make(tmp_path, docker_box_cfg, label="test-close")
        await box.exec("setsid sleep 1000 >/dev/null 2>&1 & sleep 1000 >/dev/null 2>&1 &")
        assert await containers(docker_box_cfg, "test-close") != []
        await box.close()
        await box.close()
        assert await containers(docker_box_cfg, "test-close") == []

    run(main())


def test_cancelled_container_creation_never_hangs_or_leaks(tmp_path: Path, docker_box_cfg: SandboxConfig) -> None:
    async def main() -> None:
        for i, delay in enumerate([0, 0.01, 0.1, 0.3, 1.0]):
            ws = tmp_path / f"ws{i}"
            ws.mkdir()
            task = asyncio.ensure_future(create_sandbox(docker_box_cfg, workspace=ws, sandbox_dir=tmp_path / f"sb{i}",
                                                        label="test-cancel-docker"))  # fmt: skip
            await asyncio.sleep(delay)
            task.cancel()
            try:
                box = await asyncio.wait_for(task, 60)
            except asyncio.CancelledError:
                continue
            await box.close()
        for _ in range(300):
            if not await containers(docker_box_cfg, "test-cancel-docker"):
                break
            await asyncio.sleep(0.2)
        assert await containers(docker_box_cfg, "test-cancel-docker") == []

    run(main())


DOCKER_DRIVER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from legorl.config import SandboxConfig
    from legorl.sandbox import create_sandbox

    async def main():
        root = Path(sys.argv[1])
        (root / "ws").mkdir(parents=True)
        cfg = SandboxConfig(kind="docker", docker_host=sys.argv[3])
        box = await create_sandbox(cfg, workspace=root / "ws", sandbox_dir=root / "sb", label=sys.argv[2])
        await box.exec("setsid sleep 3000 >/dev/null 2>&1 &")
        print(box.container, flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


def test_containers_of_a_sigkilled_driver_are_reaped_at_the_next_start(tmp_path: Path,
                                                                        docker_box_cfg: SandboxConfig) -> None:
    """No --die-with-parent for a container: a SIGKILLed driver leaves it running, and the next start's
    reap_sandboxes (the run's label) removes it."""
    proc = subprocess.Popen([sys.executable, "-c", DOCKER_DRIVER, str(tmp_path / "sandboxes" / "r1"), "run-dk-xyz",
                             str(docker_box_cfg.docker_host)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        container = proc.stdout.readline().strip()  # type: ignore[union-attr]
        assert container, "the driver did not start its sandbox"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert run(containers(docker_box_cfg, "run-dk-xyz")) != []
        reaped = run(reap_sandboxes(docker_box_cfg, tmp_path / "sandboxes", "run-dk-xyz"))
        assert any(container.startswith(c) or c.startswith(container) for c in reaped), (container, reaped)
        assert run(containers(docker_box_cfg, "run-dk-xyz")) == []
    finally:
        proc.kill()
        proc.wait()


# ---- resource limits ----------------------------------------------------------------------------


def test_rlimits_are_applied_and_cannot_be_raised(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    limits = SandboxLimits(processes=200, memory_mb=512, cpu_seconds=2, file_size_mb=5, open_files=256, tmp_mb=8)

    async def main() -> None:
        box = await make(tmp_path, box_cfg, limits=limits)
        try:
            r = await box.exec("ulimit -u; ulimit -d; ulimit -t; ulimit -f; ulimit -n; ulimit -c")
            assert r.output.split() == ["200", str(512 * 1024), "2", str(5 * 1024), "256", "0"], r.output
            r = await box.exec("ulimit -n 100000 2>&1; echo rc=$?")
            assert "rc=1" in r.output
            r = await box.exec("python3 -c 'b = bytearray(900 * 1024 * 1024)' 2>&1 | tail -n 1")
            assert "MemoryError" in r.output
            r = await box.exec("head -c 8M /dev/zero > big 2>&1; echo rc=$?; stat -c %s big")
            assert "rc=153" in r.output or "File size limit" in r.output, r.output  # SIGXFSZ
            assert int(r.output.split()[-1]) <= 5 * 1024 * 1024
            r = await box.exec("python3 -c \"[open(f'/tmp/f{i}', 'wb').write(bytes(4 << 20)) for i in range(3)]\" 2>&1")
            assert "No space left" in r.output, r.output
            r = await box.exec("timeout 120 sh -c 'while :; do :; done'; echo rc=$?", timeout=150)
            assert "rc=137" in r.output or "rc=152" in r.output, r.output  # SIGXCPU/SIGKILL at 2 cpu-seconds
            assert (await box.exec("echo ok")).output == "ok\n"
        finally:
            await box.close()

    run(main())


def test_memory_limit_applies(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    async def main() -> None:
        box = await make(tmp_path, box_cfg, limits=SandboxLimits(memory_mb=512))
        try:
            r = await box.exec("python3 -c 'b = bytearray(900 * 1024 * 1024)' 2>&1 | tail -n 1")
            assert "MemoryError" in r.output
            assert (await box.exec("echo ok")).output == "ok\n"
        finally:
            await box.close()

    run(main())


def test_watchdog_kills_on_total_memory_workspace_size_and_lifetime(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    async def main() -> None:
        mem = await make(tmp_path / "mem", box_cfg, limits=SandboxLimits(memory_mb=300))
        disk = await make(tmp_path / "disk", box_cfg, limits=SandboxLimits(workspace_mb=30, file_size_mb=20))
        life = await make(tmp_path / "life", box_cfg, limits=SandboxLimits(lifetime_s=1.5))
        try:
            # Four processes of 150 MiB each: every one is under RLIMIT_DATA, the sum is not.
            hog = "python3 -c 'import time; b = bytearray(150 << 20); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(60)'"
            with pytest.raises(SandboxError, match="memory limit exceeded"):
                await mem.exec(" & ".join([hog] * 4) + " & wait", timeout=60)
            # Many files of 10 MiB: each under RLIMIT_FSIZE, the workspace is not.
            with pytest.raises(SandboxError, match="workspace size limit exceeded"):
                await disk.exec("for i in $(seq 100); do head -c 10M /dev/urandom > f$i; done; sleep 30", timeout=60)
            with pytest.raises(SandboxError, match="lifetime exceeded"):
                await life.exec("sleep 30", timeout=60)
            for box in (mem, disk, life):
                with pytest.raises(SandboxError, match="killed"):
                    await box.exec("echo still-there")
                if box_cfg.kind == "bwrap":
                    assert not await wait_dead([box.pid])
                else:
                    state = await box._inspect("{{.State.Running}}")
                    assert state[1].strip() == "false", state
        finally:
            for box in (mem, disk, life):
                await box.close()

    run(main())
