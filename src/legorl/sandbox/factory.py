"""One way to make a sandbox, whatever the backend: rollouts, grading and ``tasks validate`` all call
``create_sandbox(cfg, ...)`` with the run's ``sandbox`` section (``kind: bwrap|docker``).

The arguments are the protocol's; each backend takes what applies to it. bwrap shows the host's
system dirs and runtimes read-only and covers ``hide_paths``; a container shows its image only,
so ``hide_paths`` have nothing to cover there, and ``visible_paths`` become read-only binds at the
same place. ``image`` (a task's own) overrides ``cfg.image`` on docker and is ignored by bwrap.
``environment`` (a task's, ``legorl.tasks.envs``) is mounted read-only at ``ENV_INSIDE`` on either
backend and put on ``PYTHONPATH``; a missing one is a SandboxError before anything starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from legorl.config import SandboxConfig
from legorl.sandbox.base import Sandbox
from legorl.sandbox.client import SandboxError
from legorl.sandbox.limits import SandboxLimits

__all__ = ["ENV_INSIDE", "create_sandbox", "reap_sandboxes", "sandbox_unavailable"]

ENV_INSIDE = "/opt/legorl-env"  # where a task's environment appears, read-only, in each of its sandboxes
ENV_STAMP = ".legorl-env.json"  # what a finished build leaves (legorl.tasks.envs)


def environment_binds(environment: Path | str | None) -> tuple[dict[str, Path], dict[str, str]]:
    """(read-only binds, environment variables) that show a task environment inside a sandbox."""
    if environment is None:
        return {}, {}
    env_dir = Path(environment).resolve()
    if not (env_dir / ENV_STAMP).is_file():
        why = "does not exist" if not env_dir.exists() else "is not a finished build (no .legorl-env.json)"
        raise SandboxError(f"task environment {environment} {why}: build it first (legorl.tasks.envs.build_environment)")
    return {ENV_INSIDE: env_dir}, {"PYTHONPATH": ENV_INSIDE, "LEGORL_TASK_ENV": ENV_INSIDE}


async def create_sandbox(
    cfg: SandboxConfig | None = None,
    *,
    workspace: Path,
    sandbox_dir: Path,
    label: str,
    proxy_socket: Path | None = None,
    relay_port: int | None = None,
    hide_paths: Sequence[Path] = (),
    limits: SandboxLimits | None = None,
    inside_workspace: str = "/workspace",
    env: dict[str, str] | None = None,
    ro_binds: dict[str, Path] | None = None,
    visible_paths: Sequence[Path | str] = (),
    sandbox_uid: int | None = None,
    cpus: float | None = None,
    image: str | None = None,
    environment: Path | str | None = None,
    start_timeout: float | None = None,
) -> Sandbox:
    """A started sandbox of ``cfg.kind`` (default: bwrap); raises SandboxError when it cannot start.
    ``relay_port`` defaults to ``cfg.relay_port``."""
    cfg = cfg or SandboxConfig()
    env_binds, env_vars = environment_binds(environment)
    if env_binds:
        ro_binds = {**(ro_binds or {}), **env_binds}
        env = {**env_vars, **(env or {})}
    common: dict[str, Any] = {
        "workspace": workspace, "sandbox_dir": sandbox_dir, "label": label, "proxy_socket": proxy_socket,
        "relay_port": cfg.relay_port if relay_port is None else relay_port, "hide_paths": hide_paths,
        "limits": limits, "inside_workspace": inside_workspace, "env": env, "ro_binds": ro_binds,
        "visible_paths": visible_paths, "sandbox_uid": sandbox_uid, "cpus": cpus,
    }  # fmt: skip
    if start_timeout is not None:
        common["start_timeout"] = start_timeout
    if cfg.kind == "docker":
        from legorl.sandbox.docker import DockerSandbox

        return await DockerSandbox.create(**common, image=image or cfg.image, docker_host=cfg.docker_host)
    if cfg.pool_size > 0:  # a pre-started one when one of these settings waits (pool.py), else a fresh start
        from legorl.sandbox.pool import pool_for

        return await pool_for(cfg.pool_size).create(common)
    from legorl.sandbox.bwrap import BwrapSandbox

    return await BwrapSandbox.create(**common)


def sandbox_unavailable(cfg: SandboxConfig | None = None, image: str | None = None) -> str | None:
    """None when sandboxes of ``cfg.kind`` can start here, else why not (for `legorl doctor` and skips)."""
    cfg = cfg or SandboxConfig()
    if cfg.kind == "docker":
        from legorl.sandbox.docker import docker_unavailable

        return docker_unavailable(docker_host=cfg.docker_host, image=image or cfg.image)
    import shutil

    return None if shutil.which("bwrap") else "bubblewrap is not installed (apt-get install -y bubblewrap)"


async def reap_sandboxes(cfg: SandboxConfig | None, sandboxes_root: Path, label: str | None = None) -> list:
    """Leftovers of a killed earlier run, or of this one at its end: the pooled sandboxes waiting under
    ``sandboxes_root`` (closed), the bwraps there and, on docker, every container labelled with the run's
    ``label`` (any state). Returns what was killed (pids, container ids)."""
    from legorl.sandbox.bwrap import reap_orphans
    from legorl.sandbox.pool import close_pools

    await close_pools(Path(sandboxes_root))  # this loop's pooled sandboxes there, closed in order first
    killed: list = list(await reap_orphans(sandboxes_root))
    if cfg is not None and cfg.kind == "docker" and label is not None:
        from legorl.sandbox.docker import reap_docker

        killed += await reap_docker(label, docker_host=cfg.docker_host)
    return killed
