"""A whole rollout on the docker backend: mini-swe-agent through the proxy (its Unix socket bind-mounted into
the container, reached through the relay), commands in the container, graded in a fresh container."""

from __future__ import annotations

import asyncio
from pathlib import Path

from legorl.config import HarnessConfig, SandboxConfig
from legorl.engine import ScriptedEngine
from legorl.harness.mini_swe_agent import MiniSweAgentHarness
from legorl.proxy.server import Proxy
from legorl.records import Outcome
from legorl.rollout.episode import EpisodeContext, run_episode
from legorl.rollout.teacher import teacher_script
from legorl.store import Store
from legorl.tasks import builtin_splits


def test_rollout_on_containers_resolves_with_the_teacher_script(tokenizer, tmp_path: Path,
                                                                docker_box_cfg: SandboxConfig) -> None:
    async def main():
        store = Store(tmp_path / "store.sqlite")
        proxy = Proxy(ScriptedEngine(tokenizer), tokenizer, on_call=store.add_call)
        await proxy.start(unix_socket=tmp_path / "s" / "proxy.sock")
        harness = MiniSweAgentHarness(HarnessConfig(step_limit=8), command_timeout=20, log_dir=tmp_path / "logs")
        await harness.start()
        task = builtin_splits(1, 0, seed=5)[0][0]
        try:
            ctx = EpisodeContext(proxy=proxy, harnesses={harness.name: harness}, store=store, run_dir=tmp_path,
                                 label="test-docker-episode", agent_timeout=120, grading_timeout=60,
                                 hide_paths=[tmp_path], sandbox=docker_box_cfg,
                                 script_for=lambda t, h: teacher_script(t, run_tests=True, harness=h))  # fmt: skip
            return task, await run_episode(ctx, task, step=0, group_id="g0", sample_index=0)
        finally:
            await harness.close()
            await proxy.stop()

    task, rollout = asyncio.run(main())
    assert rollout.outcome == Outcome.RESOLVED and rollout.reward == 1.0, (rollout.outcome_reason, rollout.report)
    assert rollout.report.tests and set(rollout.report.tests.values()) == {"passed"}
    assert len(rollout.calls) == 4  # read, sed, pytest, submit: every command ran in the container
    assert "-" + task.patch.split("\n-")[1].split("\n")[0].lstrip("-") in rollout.diff
