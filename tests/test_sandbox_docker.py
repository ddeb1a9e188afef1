"""The docker backend against a real engine (podman serving the Docker API under `make test`; see
tests/backends.py): the protocol, reaping by run label, and failures that must be typed and quick.
The isolation and limit checks it shares with bubblewrap are the parametrized tests of test_sandbox.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from legorl.config import SandboxConfig
from legorl.sandbox import SandboxError, SandboxLimits, create_sandbox, sandbox_unavailable
from legorl.sandbox.docker import DockerSandbox, reap_docker


def test_docker_sandbox_protocol_isolation_and_reaping(tmp_path: Path, docker_box_cfg: SandboxConfig) -> None:
    async def main() -> None:
        (tmp_path / "ws").mkdir()
        box = await DockerSandbox.create(
            workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb", label="legorl-test-docker",
            limits=SandboxLimits(processes=64, memory_mb=256), docker_host=docker_box_cfg.docker_host,
        )  # fmt: skip
        try:
            r = await box.exec("pwd; echo hi > f; id -u")
            assert r.output.split()[:1] == ["/workspace"] and r.output.split()[-1] != "0"
            assert (tmp_path / "ws" / "f").read_text() == "hi\n"
            r = await box.exec("touch /usr/x 2>&1; echo rc=$?")
            assert "rc=1" in r.output
            r = await box.exec("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\" 2>&1")
            assert r.returncode != 0
            r = await box.exec("sleep 30", timeout=1)
            assert r.timed_out
        finally:
            await box.close()
        with pytest.raises(SandboxError):
            await box.exec("echo closed")
        leftover = await create_sandbox(docker_box_cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb2",
                                        label="legorl-test-docker")  # fmt: skip
        ids = await reap_docker("legorl-test-docker", docker_host=docker_box_cfg.docker_host)
        assert leftover.container[:12] in " ".join(ids) or leftover.container in ids
        await leftover.close()

    asyncio.run(main())


def test_missing_image_and_dead_container_are_typed_errors(tmp_path: Path, docker_box_cfg: SandboxConfig) -> None:
    """An image the engine lacks is refused before anything starts (never pulled); a container that dies
    says so on the next request."""
    missing = docker_box_cfg.model_copy(update={"image": "legorl/no-such-image:0"})
    assert "no image legorl/no-such-image:0" in (sandbox_unavailable(missing) or "")
    assert sandbox_unavailable(docker_box_cfg) is None

    async def main() -> None:
        (tmp_path / "ws").mkdir()
        t0 = time.monotonic()
        with pytest.raises(SandboxError, match="no image legorl/no-such-image:0"):
            await create_sandbox(missing, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb0", label="t-missing")
        assert time.monotonic() - t0 < 30
        box = await create_sandbox(docker_box_cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb1",
                                   label="t-dead")  # fmt: skip
        try:
            await box.exec("kill -9 1 2>/dev/null; echo tried")  # its own agent is not its to kill (another uid)
            assert (await box.exec("echo alive")).output == "alive\n"
            from backends import kill_agent

            kill_agent(box)
            with pytest.raises(SandboxError, match="container exited|killed"):
                await box.exec("echo hi", timeout=5)
        finally:
            await box.close()

    asyncio.run(main())


def test_the_image_carries_the_whole_standard_library(tmp_path: Path, docker_box_cfg: SandboxConfig) -> None:
    """Debian splits modules out of python3; tasks' tests import them (six's moved-module tests: tkinter),
    as they can on the host's Python. scripts/sandbox-image.sh installs them."""

    async def main() -> None:
        (tmp_path / "ws").mkdir()
        box = await create_sandbox(docker_box_cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb",
                                   label="legorl-test-stdlib")  # fmt: skip
        try:
            r = await box.exec("python3 -S -c 'import tkinter, dbm.gnu, lib2to3, distutils.core, ensurepip, venv' 2>&1")
            assert r.returncode == 0, r.output
        finally:
            await box.close()

    asyncio.run(main())
