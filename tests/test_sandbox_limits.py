"""Pure units: sandbox limits, nested deadlines, the docker backend's command line (no sandbox started)."""

from __future__ import annotations

import pytest

from legorl.sandbox import DeadlineExceeded, Deadlines, SandboxLimits
from legorl.sandbox.docker import docker_run_argv
from legorl.sandbox.watchdog import disk_usage


def test_limits_validation_and_agent_arg() -> None:
    lim = SandboxLimits(processes=10, memory_mb=100, cpu_seconds=5, file_size_mb=1, open_files=64)
    assert lim.agent_arg() == "nproc=10,data=104857600,cpu=5,fsize=1048576,nofile=64"
    assert SandboxLimits.from_dict({"processes": 3}).processes == 3
    with pytest.raises(ValueError, match="unknown sandbox limit.*known"):
        SandboxLimits.from_dict({"procs": 3})
    with pytest.raises(ValueError, match="must be > 0"):
        SandboxLimits(memory_mb=0)
    assert SandboxLimits(processes=None, memory_mb=None, cpu_seconds=None, file_size_mb=None,
                         open_files=None).agent_arg() == ""  # fmt: skip


def test_deadlines_nest_and_clamp() -> None:
    d = Deadlines(command=10, agent=100, setup=20, grading=50, slack=5)
    assert d.rollout == 20 + 100 + 5 + 50 and d.sandbox_lifetime == d.rollout + 5
    assert d.command < d.agent < d.rollout < d.sandbox_lifetime
    now = [0.0]
    clock = d.start(now=0.0)
    clock._now = lambda: now[0]
    now[0] = 15.0  # set-up took 15 s
    clock.start_agent()
    assert clock.command_timeout() == 10 and clock.command_timeout(3) == 3 and clock.command_timeout(99) == 10
    now[0] = 15.0 + 96
    assert clock.agent_left() == pytest.approx(4) and clock.command_timeout() == pytest.approx(4)
    now[0] = 15.0 + 100
    with pytest.raises(DeadlineExceeded):
        clock.command_timeout()
    assert 0 < clock.grading_timeout() <= 50
    # A slow set-up eats into the agent's time, never into grading's.
    slow = d.start(now=0.0)
    slow._now = lambda: now[0]
    now[0] = 80.0
    slow.start_agent()
    assert slow.agent_left() == pytest.approx(d.rollout - 80 - d.slack - d.grading)
    for bad in ({"command": 0}, {"agent": float("inf")}, {"command": 100, "agent": 50}):
        with pytest.raises(ValueError):
            Deadlines(**bad)


def test_docker_argv_carries_isolation_limits_and_label(tmp_path) -> None:
    argv = docker_run_argv(
        name="legorl-x", image="legorl/debian-python:bookworm", workspace=tmp_path / "ws", ctl_dir=tmp_path / "ctl",
        label="run-1", sandbox_dir=tmp_path, proxy_socket=tmp_path / "p.sock", relay_port=18000,
        limits=SandboxLimits(processes=64, memory_mb=512, tmp_mb=16), inside_workspace="/app", drop_to=(200123, 200123),
    )  # fmt: skip
    joined = " ".join(argv)
    for flag in ("--network none", "--read-only", "--cap-drop ALL", "--security-opt no-new-privileges", "--pull never",
                 "--pids-limit 128", "--ulimit nproc=64:64", "--memory 512m", "--label legorl.run=run-1",
                 "/tmp:rw,nosuid,nodev,mode=1777,size=16m", f"{tmp_path / 'ws'}:/app:rw",
                 "--relay 18000 /run/legorl/proxy.sock", "--workdir /app",
                 # a root driver: the agent starts as root with SETUID/SETGID only and drops to its own uid
                 "--user 0:0 --cap-add SETUID --cap-add SETGID", "--uid 200123 --gid 200123"):  # fmt: skip
        assert flag in joined, flag
    assert "--limits nproc=64,data=536870912" in joined  # per-process rlimits, as under bwrap
    plain = " ".join(docker_run_argv(
        name="x", image="i", workspace=tmp_path, ctl_dir=tmp_path, label="l", sandbox_dir=tmp_path, proxy_socket=None,
        relay_port=1, limits=SandboxLimits(), user=(1000, 1000)))  # fmt: skip
    assert "--user 1000:1000" in plain and "--cap-add" not in plain and "--uid" not in plain  # a non-root driver


def test_disk_usage_counts_hard_links_once(tmp_path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").hardlink_to(tmp_path / "a")
    used = disk_usage(tmp_path)
    assert 100_000 <= used < 200_000
