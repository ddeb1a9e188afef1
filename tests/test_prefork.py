"""The prefork server (harness/prefork.py): a runner imported once on the host, forked into a real bubblewrap
sandbox, is a process of that sandbox like any command its agent starts: its pid namespace, mounts, hostname,
uid without capabilities, no_new_privs, limits, cgroup and environment, none of the host's files or open
descriptors, and it is ended when it runs out of time."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from legorl.harness.openhands import OPENHANDS_PYTHON
from legorl.harness.prefork import PreforkServer, sandbox_target
from legorl.sandbox import BwrapSandbox
from legorl.sandbox.client import SandboxClient

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("bwrap") is None or not OPENHANDS_PYTHON.exists(),
    reason="a fork enters a sandbox's namespaces as root (privileged bwrap), with a Python of 3.12+ (os.setns): "
           "the OpenHands environment from make setup-test")

RUNNER = '''
import json, os, resource, sys, time

def preload():
    global PRELOADED
    PRELOADED = os.getpid()

def main():
    if os.environ.get("ALLOC_MB"):  # it and a child each hold ALLOC_MB, then wait
        held = b"x" * (int(os.environ["ALLOC_MB"]) << 20)
        os.fork()
        time.sleep(30)
        return len(held) and 4
    if os.environ.get("SLEEP"):
        open("/workspace/started", "w").close()
        time.sleep(float(os.environ["SLEEP"]))
        open("/workspace/finished", "w").close()
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    fds = sorted(os.listdir("/proc/self/fd"))
    print(json.dumps({
        "pid_in_proc": str(os.getpid()) in os.listdir("/proc"), "preloaded": PRELOADED != os.getpid(),
        "uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups(), "cwd": os.getcwd(),
        "files": sorted(os.listdir(".")), "cap_eff": status["CapEff"].strip(), "cap_prm": status["CapPrm"].strip(),
        "no_new_privs": status["NoNewPrivs"].strip(), "fds": fds, "env": dict(os.environ),
        "host_file": os.path.exists(sys.argv[1]), "nproc": resource.getrlimit(resource.RLIMIT_NPROC),
        "cpu": resource.getrlimit(resource.RLIMIT_CPU), "hostname": os.uname().nodename,
        "cgroup": open("/proc/self/cgroup").read().strip(), "sid_is_pid": os.getsid(0) == os.getpid(),
    }))
    return 3
'''


async def _in_sandbox(tmp_path: Path, body, **box_kw):
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text("x = 1\n")
    prefixes = subprocess.run(  # noqa: ASYNC221 - before anything runs
        [str(OPENHANDS_PYTHON), "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
        capture_output=True, text=True, check=True).stdout.split()
    box = await BwrapSandbox.create(workspace=ws, sandbox_dir=tmp_path / "box", label="prefork-test",
                                    visible_paths=[os.path.realpath(p) for p in prefixes], **box_kw)
    server = PreforkServer(str(OPENHANDS_PYTHON), runner, {"PATH": os.environ["PATH"], "HOME": "/tmp"})
    os.environ["LEGORL_TEST_DRIVER_SECRET"] = "not for the sandbox"
    try:
        await server.start()
        target = sandbox_target(str(box.control_socket))
        assert target is not None, "a root driver's bwrap sandbox can be entered"
        return await body(box, server, target, ws)
    finally:
        os.environ.pop("LEGORL_TEST_DRIVER_SECRET", None)
        await server.close()
        await box.close()


def test_a_forked_runner_is_a_process_of_the_sandbox(tmp_path: Path) -> None:
    host_only = tmp_path / "host-only"
    host_only.write_text("secret")

    async def body(box, server, target, ws):
        output, code = await asyncio.to_thread(server.run, target, {"HARNESS_VAR": "1"}, 60, [str(host_only)])
        return box, target, output, code, server.forked

    box, target, output, code, forked = asyncio.run(_in_sandbox(tmp_path, body))
    assert code == 3, output
    facts = json.loads(output.strip().splitlines()[-1])
    assert facts["pid_in_proc"], "its pid is one of the sandbox's pid namespace"
    assert facts["preloaded"], "preload() ran once, in the server"
    assert (facts["uid"], facts["gid"], facts["groups"]) == (box.ids[0], box.ids[1], [])
    assert facts["cap_eff"] == facts["cap_prm"] == "0000000000000000"
    assert facts["no_new_privs"] == "1"
    assert facts["cwd"] == "/workspace" and facts["files"] == ["calc.py"]
    assert facts["hostname"] == "sandbox" and facts["sid_is_pid"]
    assert not facts["host_file"], "the host's files are not there"
    assert set(facts["fds"]) <= {"0", "1", "2", "3"}, facts["fds"]  # 3: listdir's own
    env = facts["env"]
    assert env["HARNESS_VAR"] == "1" and env["LEGORL_SANDBOX"] == "prefork-test"
    assert "LEGORL_TEST_DRIVER_SECRET" not in env and env["HOME"] == "/tmp"
    inf = resource.RLIM_INFINITY
    assert tuple(facts["nproc"]) == tuple(inf if v < 0 else v for v in target.limits["nproc"])
    assert target.limits["nproc"][0] > 0  # the sandbox's process budget, which the fork now counts against
    if target.cpu:
        assert tuple(facts["cpu"]) == (target.cpu, target.cpu)
    assert forked == 1


def test_a_runner_out_of_time_is_ended(tmp_path: Path) -> None:
    async def body(box, server, target, ws):
        output, code = await asyncio.to_thread(server.run, target, {"SLEEP": "30"}, 2, ["/nonexistent"])
        left = SandboxClient(box.control_socket).exec(
            "for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline; echo; done | grep -c '[p]refork_server' || true", 10)
        return output, code, left.output, (ws / "started").exists(), (ws / "finished").exists()

    output, code, left, started, finished = asyncio.run(_in_sandbox(tmp_path, body))
    assert code is None, output
    assert started and not finished
    assert left.strip() == "0", left


def test_the_watchdog_counts_a_forked_runners_memory(tmp_path: Path) -> None:
    """The runner's parent is outside bwrap's process tree; the watchdog counts the processes of the
    sandbox's pid namespace too, so two processes of 120 MiB each end a sandbox of 200 MiB."""
    async def body(box, server, target, ws):
        output, code = await asyncio.to_thread(server.run, target, {"ALLOC_MB": "120"}, 25, ["/nonexistent"])
        return output, code, box.watch.violation

    output, code, violation = asyncio.run(_in_sandbox(tmp_path, body, memory_mb=200))
    assert violation.startswith("memory limit exceeded"), (violation, output)
    assert code != 4, "the runner was ended, not left to finish"


def test_an_episode_cancelled_while_the_server_starts_leaves_one_server(tmp_path: Path, monkeypatch) -> None:
    """A busy machine imports the SDK slowly: an episode that runs out of time meanwhile must neither kill
    the start the next episodes wait on nor leave a server nobody owns (a mixed run once started 98)."""
    from legorl.harness import openhands
    from legorl.harness.openhands import OpenHandsHarness

    slow = tmp_path / "slow_runner.py"
    slow.write_text("import time\n\ndef preload():\n    time.sleep(2)\n\ndef main():\n    return 0\n")
    monkeypatch.setattr(openhands, "RUNNER", slow)
    starts = []
    real_start = PreforkServer.start

    async def counted(self, timeout: float = 120.0) -> None:
        starts.append(self)
        await real_start(self, timeout)

    monkeypatch.setattr(PreforkServer, "start", counted)

    async def scenario():
        harness = OpenHandsHarness()
        await harness.start()  # begins the server's start: imports before the episodes make the machine busy
        await asyncio.sleep(0)
        assert len(starts) == 1
        first = asyncio.ensure_future(harness.prefork_server())
        waiting = asyncio.ensure_future(harness.prefork_server())
        await asyncio.sleep(0.5)
        first.cancel()  # its episode ran out of time while the server imported
        with pytest.raises(asyncio.CancelledError):
            await first
        server = await waiting
        again = await harness.prefork_server()
        alive = server.alive
        await harness.close()
        return server, again, alive

    server, again, alive = asyncio.run(scenario())
    assert alive and again is server and starts == [server]
    assert not server.alive, "closing the harness ends its server"


def test_a_server_cancelled_while_it_starts_is_ended(tmp_path: Path) -> None:
    slow = tmp_path / "slow_runner.py"
    slow.write_text("import time\n\ndef preload():\n    time.sleep(30)\n\ndef main():\n    return 0\n")

    async def scenario():
        server = PreforkServer(str(OPENHANDS_PYTHON), slow, {"PATH": os.environ["PATH"]})
        start = asyncio.ensure_future(server.start())
        await asyncio.sleep(1)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        return server

    server = asyncio.run(scenario())
    assert server.proc is not None and server.proc.returncode is not None and server.dir is None


def test_no_target_where_a_fork_cannot_enter(tmp_path: Path) -> None:
    assert sandbox_target(str(tmp_path / "nowhere" / "ctl" / "control.sock")) is None

    async def run_as_root() -> object:
        ws = tmp_path / "ws0"
        ws.mkdir()
        box = await BwrapSandbox.create(workspace=ws, sandbox_dir=tmp_path / "box0", label="uid0", sandbox_uid=0)
        try:
            return sandbox_target(str(box.control_socket))
        finally:
            await box.close()

    assert asyncio.run(run_as_root()) is None  # a sandbox run as uid 0 keeps starting its harness afresh


def test_a_dead_server_fails_the_episode_with_its_reason_and_is_replaced(tmp_path: Path) -> None:
    from legorl.harness.base import HarnessCrashed
    from legorl.harness.openhands import OpenHandsHarness

    async def body(box, server, target, ws):
        server.proc.kill()
        await server.proc.wait()
        with pytest.raises(HarnessCrashed, match="the prefork server is gone"):
            await asyncio.to_thread(server.run, target, {}, 10)
        harness = OpenHandsHarness()
        harness.server = server  # as if it had started this one
        await harness.start()
        fresh = await harness.prefork_server()
        try:
            return fresh is not server and fresh.alive
        finally:
            await harness.close()

    assert asyncio.run(_in_sandbox(tmp_path, body))
