"""The whole job at toy size through Claude Code, Codex, OpenCode, OpenHands, Gemini CLI and Qwen Code: teacher demos through each CLI's
own shell tool -> SFT -> eval -> RL step -> eval, every stage recorded and every call token-exact."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from harness_episode import BASH_AGENT

from legorl.config import load_config
from legorl.harness.claude_code import NPM_BIN
from legorl.harness.openhands import OPENHANDS_PYTHON
from legorl.models import load_tokenizer
from legorl.pipeline import run_job
from legorl.store import Store

WIRE = {"claude-code": ("anthropic_messages", "Bash"), "codex": ("openai_responses", "exec_command"),
        "opencode": ("openai_chat", "bash"), "openhands": ("openai_chat", "terminal"),
        "gemini-cli": ("gemini", "run_shell_command"), "qwen-code": ("openai_chat", "run_shell_command")}
CLI = {"claude-code": NPM_BIN / "claude", "codex": NPM_BIN / "codex", "opencode": NPM_BIN / "opencode",
       "openhands": OPENHANDS_PYTHON, "gemini-cli": NPM_BIN / "gemini", "qwen-code": NPM_BIN / "qwen"}


@pytest.mark.parametrize("harness", ["claude-code", "codex", "opencode", "openhands", "gemini-cli", "qwen-code"])
def test_toy_pipeline_through_the_cli(harness, tmp_path, cache_dir):
    cli = CLI[harness]
    if not cli.exists():
        pytest.skip(f"needs the pinned {harness} CLI (make setup-test)")
    wire, tool = WIRE[harness]
    switches = [f"harness.system_prompt=You are a coding agent. Fix the bug with the {tool} tool, then reply Done.",
                f"harness.tools=[{tool}]"]
    if harness == "codex":
        switches.append("harness.codex_config={skills.include_instructions: false, include_environment_context: false}")
    cfg = load_config(None, [
        f"run.cache_dir={cache_dir}", "run.steps=1", "model.hidden_size=64", "model.num_layers=2",
        "model.intermediate_size=128", "sampling.max_tokens=48", f"harness.name={harness}", "harness.step_limit=4",
        *switches, "tasks.n_train=2", "tasks.n_heldout=1", "rollout.tasks_per_step=1", "rollout.group_size=2",
        "sft.enabled=true", "sft.demos=2", "sft.epochs=1", "sft.batch_sequences=1", "eval.before_training=true",
        "eval.after_training=true", "monitor.dashboard=false",
    ])
    summary = asyncio.run(run_job(cfg, tmp_path))
    assert summary["sft"]["sft/demos_resolved"] == 2, summary  # the teacher solved both through the CLI
    assert summary["steps"] == 1
    assert summary["heldout_pass_at_1_before_rl"] is not None and summary["heldout_pass_at_1_after_rl"] is not None

    store = Store(tmp_path / "store.sqlite")
    assert {"demo", "train", "eval-heldout"} <= {r.split for r in store.rollouts()}
    for demo in store.rollouts(split="demo"):
        calls = store.calls_for(demo.id)
        assert {c.wire_format for c in calls} == {wire}
        assert [t.name for c in calls for t in c.tool_calls] == [tool, tool]  # read, fix; then a reply ends it
        assert [c.parent_index for c in calls[1:]] == [c.index for c in calls[:-1]]  # one token-exact chain
    train = store.rollouts(split="train")
    # two samples: a retried sandbox_error (a process that outlived quiescing, now and then on Codex) is a second rollout
    assert len({(r.group_id, r.sample_index) for r in train}) == 2
    assert all(r.outcome is not None and r.harness == harness for r in train)
    tok = load_tokenizer(tmp_path / "tokenizer")
    report = store.report(decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert report["fidelity"]["violations"] == 0 and report["llm_calls"] > 0


@pytest.mark.parametrize(("names", "overrides"), [
    (["mini-swe-agent", "claude-code", "codex"], "{claude-code: {tools: [Bash]}, codex: {tools: [exec_command]}}"),
    # the published mixed run (configs/demo-published.yaml)
    (["openhands", "opencode", "claude-code"], ("{openhands: {tools: [terminal]}, opencode: {tools: [bash]}, "
                                                "claude-code: {tools: [Bash]}}")),
], ids=["mini-claude-codex", "published"])
def test_one_policy_learns_through_three_harnesses(tmp_path, cache_dir, names, overrides):
    missing = [n for n in names if n in CLI and not CLI[n].exists()]
    if missing:
        pytest.skip(f"needs the pinned {', '.join(missing)} (make setup-test)")
    cfg = load_config(None, [
        f"run.cache_dir={cache_dir}", "run.steps=1", "model.hidden_size=64", "model.num_layers=2",
        "model.intermediate_size=128", "sampling.max_tokens=48", f"harness.name=[{', '.join(names)}]",
        "harness.step_limit=4", "harness.system_prompt=You are a coding agent. Fix the bug, then reply Done.",
        f"harness.overrides={overrides}",
        "tasks.n_train=6", "tasks.n_heldout=1", "rollout.tasks_per_step=3", "rollout.group_size=2",
        "sft.enabled=true", "sft.demos=3", "sft.epochs=1", "sft.batch_sequences=1", "eval.before_training=true",
        "eval.after_training=true", "monitor.dashboard=false",
    ])
    summary = asyncio.run(run_job(cfg, tmp_path))
    assert summary["sft"]["sft/demos_resolved"] == 3
    store = Store(tmp_path / "store.sqlite")
    for split, per_harness in (("demo", 1), ("train", 2), ("eval-heldout", 2)):  # eval: before and after
        # distinct samples: an infrastructure failure (a grading timeout on a loaded machine) is retried as a new rollout
        counts = {n: len({(r.step, r.group_id, r.sample_index) for r in store.rollouts(split=split) if r.harness == n})
                  for n in names}
        assert counts == dict.fromkeys(names, per_harness), (split, counts)
    assert set(summary["per_harness"]) == set(names)
    for row in summary["per_harness"].values():
        assert row["pass_at_1_before_rl"] is not None and row["pass_at_1_after_rl"] is not None
        for when in ("before_rl", "after_rl"):  # what RL is known to shift, per harness
            assert {"turns_per_rollout", "text_only_turn_rate", "tool_calls_per_turn"} <= set(row[f"behaviour_{when}"])
    before = [summary["per_harness"][n]["pass_at_1_before_rl"] for n in names]
    assert summary["heldout_pass_at_1_before_rl"] == pytest.approx(sum(before) / 3)


MINI_CLI = Path(sys.executable).parent / "mini"
USER_AGENTS = {
    # a user's own agent on the official openai SDK, streamed (examples/bash_agent.py)
    "bash_agent": [f"harness.command={sys.executable} {BASH_AGENT}", f"harness.visible_paths=[{BASH_AGENT.parent}]",
                   "harness.env={AGENT_STREAM: '1'}"],
    # mini-swe-agent's own `mini` CLI, as its users type it: LiteLLM reads OPENAI_API_BASE; its turn limit is off
    # so that the proxy's (harness.step_limit) decides; the teacher ends with its submit command
    "mini_cli": [(f"harness.command={MINI_CLI} -y --exit-immediately -m openai/$LEGORL_MODEL -t \"$(cat "
                  "$LEGORL_PROMPT_FILE)\" -c mini.yaml -c model.cost_tracking=ignore_errors -c agent.step_limit=0"),
                 "harness.env={MSWEA_CONFIGURED: 'true', LITELLM_LOCAL_MODEL_COST_MAP: 'True'}",
                 "harness.shell_submit=echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"],
}


@pytest.mark.parametrize("agent", list(USER_AGENTS))
def test_toy_pipeline_through_a_users_own_agent(agent, tmp_path, cache_dir):
    """`harness.name: command`: an agent legorl has no adapter for, given by its command line, learns like the
    adapted CLIs: the teacher plays through its `bash` tool, then SFT, eval, an RL step, every call token-exact."""
    cfg = load_config(None, [
        f"run.cache_dir={cache_dir}", "run.steps=1", "model.hidden_size=64", "model.num_layers=2",
        "model.intermediate_size=128", "sampling.max_tokens=48", "harness.name=command", *USER_AGENTS[agent],
        "harness.step_limit=4", "tasks.n_train=2", "tasks.n_heldout=1", "rollout.tasks_per_step=1",
        "rollout.group_size=2", "sft.enabled=true", "sft.demos=2", "sft.epochs=1", "sft.batch_sequences=1",
        "eval.before_training=true", "eval.after_training=true", "monitor.dashboard=false",
    ])
    summary = asyncio.run(run_job(cfg, tmp_path))
    assert summary["sft"]["sft/demos_resolved"] == 2, summary  # the teacher solved both through the agent's tool
    assert summary["steps"] == 1 and summary["heldout_pass_at_1_after_rl"] is not None
    store = Store(tmp_path / "store.sqlite")
    for demo in store.rollouts(split="demo"):
        calls = store.calls_for(demo.id)
        assert {c.wire_format for c in calls} == {"openai_chat"}
        assert [t.name for c in calls for t in c.tool_calls][:2] == ["bash", "bash"]  # read, fix (mini: submit)
        assert [c.parent_index for c in calls[1:]] == [c.index for c in calls[:-1]]
    assert all(r.outcome is not None and r.harness == "command" for r in store.rollouts(split="train"))
    tok = load_tokenizer(tmp_path / "tokenizer")
    report = store.report(decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert report["fidelity"]["violations"] == 0 and report["llm_calls"] > 0
