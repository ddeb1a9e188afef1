"""The sandbox backends a backend-agnostic test runs on: bubblewrap, and docker against a real engine.

``box_cfg`` is a fixture parametrized over ``bwrap`` and ``docker``: a test taking it runs once per
backend with the ``SandboxConfig`` to hand to ``create_sandbox`` / ``grade``. The docker engine is
``DOCKER_HOST`` when set, else podman's Docker API socket, whose service is started here when podman is
installed and nothing answers yet (``scripts/sandbox-image.sh service``). The image is never built here
(minutes): ``scripts/sandbox-image.sh`` does that, and ``make test`` runs it first. Where no engine or
no image is there, the docker cases skip with the reason, except under ``LEGORL_REQUIRE_DOCKER=1``
(``make test``), where they fail: the container backend must be tested there, not skipped.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from legorl.config import SandboxConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sandbox-image.sh"
REQUIRED = os.environ.get("LEGORL_REQUIRE_DOCKER") == "1"


def podman_socket() -> str:
    if os.geteuid() == 0:
        return "unix:///run/podman/podman.sock"
    return f"unix://{os.environ.get('XDG_RUNTIME_DIR', f'/run/user/{os.getuid()}')}/podman/podman.sock"


@functools.cache
def docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or podman_socket()


@functools.cache
def docker_reason() -> str | None:
    """None when docker sandboxes can start here (engine answers, image present), else why not."""
    from legorl.sandbox.docker import docker_unavailable

    host = docker_host()
    reason = docker_unavailable(docker_host=host)
    if reason and not os.environ.get("DOCKER_HOST") and shutil.which("podman"):
        # a podman service starts in seconds alone, but took over 120 s beside a training run and the suite
        p = subprocess.run(["bash", str(SCRIPT), "service"], capture_output=True, text=True, timeout=300,
                           check=False, env={k: v for k, v in os.environ.items() if k != "DOCKER_HOST"})  # fmt: skip
        reason = docker_unavailable(docker_host=host) if p.returncode == 0 else f"{reason}; {p.stderr[-300:]}"
    return reason or docker_unavailable(docker_host=host, image=SandboxConfig().image)


def docker_cfg() -> SandboxConfig:
    """The docker backend's config for a test, or a skip (a failure under LEGORL_REQUIRE_DOCKER=1)."""
    if reason := docker_reason():
        message = f"docker backend: {reason}"
        if REQUIRED:
            pytest.fail(f"{message} (LEGORL_REQUIRE_DOCKER=1: `make test` must test the container backend)")
        pytest.skip(message)
    return SandboxConfig(kind="docker", docker_host=docker_host())


def bwrap_cfg() -> SandboxConfig:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    return SandboxConfig()


@pytest.fixture(params=["bwrap", "docker"])
def box_cfg(request: pytest.FixtureRequest) -> SandboxConfig:
    """The sandbox section of each backend in turn."""
    return docker_cfg() if request.param == "docker" else bwrap_cfg()


@pytest.fixture
def docker_box_cfg() -> SandboxConfig:
    """The docker backend only (tests of what only containers do)."""
    return docker_cfg()


def kill_agent(box) -> None:
    """Kill the sandbox's in-sandbox agent from the host, as if it crashed (any backend)."""
    import signal

    from legorl.sandbox.docker import DockerSandbox
    from legorl.sandbox.procs import process_tree

    if isinstance(box, DockerSandbox):
        subprocess.run(["docker", "kill", box.container], capture_output=True, timeout=60, check=False,
                       env={**os.environ, "DOCKER_HOST": box.docker_host or docker_host()})  # fmt: skip
        return
    argvs = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in process_tree(box.pid)}
    agent = next(p for p, argv in argvs.items() if Path(argv[0].decode()).name.startswith("python"))
    os.kill(agent, signal.SIGKILL)
