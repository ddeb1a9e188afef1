"""mini-swe-agent, unmodified, through the proxy, in a real bubblewrap sandbox, graded for real."""

from __future__ import annotations

import asyncio
from pathlib import Path

from helpers import run_mini_episode

from legorl.config import HarnessConfig
from legorl.engine import ScriptedEngine
from legorl.grading.grader import EMPTY_PATCH_REASON
from legorl.harness.mini_swe_agent import MiniSweAgentHarness
from legorl.monitor.failures import failure_kind
from legorl.proxy.server import Proxy
from legorl.records import Outcome
from legorl.rollout.episode import EpisodeContext, run_episode, scripted
from legorl.rollout.teacher import scripted_teacher, teacher_script
from legorl.store import Store
from legorl.tasks import builtin_splits


async def _episodes(tokenizer, run_dir: Path, scripts):
    store = Store(run_dir / "store.sqlite")
    engine = ScriptedEngine(tokenizer)
    proxy = Proxy(engine, tokenizer, on_call=store.add_call)
    await proxy.start(unix_socket=run_dir / "s" / "proxy.sock")
    harness = MiniSweAgentHarness(HarnessConfig(step_limit=8), command_timeout=20, log_dir=run_dir / "logs")
    await harness.start()
    train, _ = builtin_splits(3, 0, seed=5)
    try:
        out = []
        for i, (task, script) in enumerate(zip(train, scripts)):
            ctx = EpisodeContext(proxy=proxy, harnesses={harness.name: harness}, store=store, run_dir=run_dir,
                                 label="test",
                                 agent_timeout=120, grading_timeout=60, hide_paths=[run_dir],
                                 engine_for=scripted(engine, script))
            out.append((task, await run_episode(ctx, task, step=0, group_id=f"g{i}", sample_index=0)))
        return out, store
    finally:
        await harness.close()
        await proxy.stop()


def test_mini_swe_agent_solves_with_correct_script_and_fails_with_wrong(tokenizer, tmp_path):
    def broken(task, harness):  # an "agent" that says it is done without calling any tool
        return ["I think it is fine."] * 3

    scripts = [lambda t, h: teacher_script(t, run_tests=True, harness=h),
               lambda t, h: teacher_script(t, solve=False, harness=h), broken]
    results, store = asyncio.run(_episodes(tokenizer, tmp_path, scripts))
    (t_ok, good), (_, wrong), (_, no_tool) = results

    assert good.outcome == Outcome.RESOLVED, (good.outcome_reason, good.report)
    assert good.reward == 1.0
    assert good.report.tests and all(v == "passed" for v in good.report.tests.values())
    assert "-" + t_ok.patch.split("\n-")[1].split("\n")[0].lstrip("-") in good.diff  # the sed edit is the diff
    assert len(good.calls) == 4  # read, sed, pytest, submit
    assert [c.parent_index for c in good.calls] == [None, 0, 1, 2]  # one token-exact chain

    assert wrong.outcome == Outcome.UNRESOLVED and wrong.reward == 0.0
    assert wrong.diff.strip() == ""
    # An empty patch needs no grading sandbox: validation already showed the pristine repo fails.
    assert wrong.report.reason == EMPTY_PATCH_REASON
    assert wrong.report.exit_code is None and wrong.report.collected == 0  # no pytest ran

    # no tool call twice in a row: mini stops with RepeatedFormatError; graded, reward 0
    assert no_tool.outcome == Outcome.UNRESOLVED and no_tool.reward == 0.0

    rep = store.report(decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    assert rep["fidelity"]["violations"] == 0 and rep["fidelity"]["checked"] == rep["llm_calls"] > 0


def test_harness_without_model_calls_is_not_a_success(tokenizer, tmp_path):
    """mini exits before its first call (its template fails to render): no_model_calls, masked, no reward."""
    r = run_mini_episode(tokenizer, tmp_path, builtin_splits(1, 0, seed=9)[0][0],
                         HarnessConfig(instance_template="{{ no_such_variable }}"), label="t", agent_timeout=60,
                         grading_timeout=60)
    assert r.outcome == Outcome.NO_MODEL_CALLS, r.outcome_reason
    assert r.reward is None and r.report is None


def test_text_mode_takes_the_command_from_a_bash_block(tokenizer, tmp_path):
    """`harness.action_format: text`: no tool is declared; mini's text-based model runs the ```bash block of
    each answer, and the scripted teacher writes its turns so; a reply with no block is mini's format error."""
    task = builtin_splits(1, 0, seed=5)[0][0]
    cfg = HarnessConfig(action_format="text", step_limit=8)
    good = run_mini_episode(tokenizer, tmp_path / "good", task, cfg, label="t", agent_timeout=120,
                            grading_timeout=60, script_for=scripted_teacher(check_edits=True))
    assert good.outcome == Outcome.RESOLVED, (good.outcome_reason, good.report)
    assert [c.parent_index for c in good.calls] == [None, 0, 1]  # read, sed, submit: one token-exact chain
    for c in good.calls:
        assert "tools" not in c.request and not c.tool_calls  # the command travels as text
        assert "```bash\n" in c.completion_text
    assert "```bash" in good.calls[0].request["messages"][0]["content"]  # the text-mode system prompt

    prose = run_mini_episode(tokenizer, tmp_path / "prose", task, cfg, label="t", agent_timeout=120,
                             grading_timeout=60, script_for=lambda t, h: ["```python\nprint(1)\n```"] * 3)
    assert prose.outcome == Outcome.UNRESOLVED and prose.reward == 0.0
    said = prose.calls[1].request["messages"][-1]["content"]
    assert said.startswith("Format error: reply with exactly one bash command")
    assert failure_kind(prose, task) == "format"
