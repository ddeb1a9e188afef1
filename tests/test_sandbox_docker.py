"""The docker backend against a real engine (skipped, with the reason, where none answers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from legorl.sandbox import SandboxError, SandboxLimits
from legorl.sandbox.docker import DEFAULT_IMAGE, DockerSandbox, docker_unavailable, reap_docker

REASON = docker_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"docker backend: {REASON}")


def test_docker_sandbox_protocol_isolation_and_reaping(tmp_path: Path) -> None:
    async def main() -> None:
        (tmp_path / "ws").mkdir()
        box = await DockerSandbox.create(
            workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb", label="legorl-test-docker",
            image=DEFAULT_IMAGE, limits=SandboxLimits(processes=64, memory_mb=256),
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
        leftover = await DockerSandbox.create(
            workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb2", label="legorl-test-docker"
        )
        ids = await reap_docker("legorl-test-docker")
        assert leftover.container[:12] in " ".join(ids) or leftover.container in ids
        await leftover.close()

    asyncio.run(main())
