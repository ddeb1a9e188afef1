"""A whole rollout on the docker backend: mini-swe-agent through the proxy (its Unix socket bind-mounted into
the container, reached through the relay), commands in the container, graded in a fresh container."""

from __future__ import annotations

from pathlib import Path

from helpers import run_mini_episode

from legorl.config import HarnessConfig, SandboxConfig
from legorl.records import Outcome
from legorl.rollout.teacher import teacher_script
from legorl.tasks import builtin_splits


def test_rollout_on_containers_resolves_with_the_teacher_script(tokenizer, tmp_path: Path,
                                                                docker_box_cfg: SandboxConfig) -> None:
    task = builtin_splits(1, 0, seed=5)[0][0]
    rollout = run_mini_episode(tokenizer, tmp_path, task, HarnessConfig(step_limit=8), label="test-docker-episode",
                               agent_timeout=120, grading_timeout=60, sandbox=docker_box_cfg,
                               script_for=lambda t, h: teacher_script(t, run_tests=True, harness=h))
    assert rollout.outcome == Outcome.RESOLVED and rollout.reward == 1.0, (rollout.outcome_reason, rollout.report)
    assert rollout.report.tests and set(rollout.report.tests.values()) == {"passed"}
    assert len(rollout.calls) == 4  # read, sed, pytest, submit: every command ran in the container
    assert "-" + task.patch.split("\n-")[1].split("\n")[0].lstrip("-") in rollout.diff
