"""Claude Code and Codex configured through their own switches, and what legorl does around them.

The keys (harness.system_prompt, append_system_prompt, tools, extra_args, codex_config) are
validated per harness; the real CLIs, given the shortened configuration, send prompts a small
model's context holds; the scripted teacher plays each harness's own shell tool; a reply cut at
max_tokens, which ends a CLI's run with an error, counts as the policy's failure; Codex's turn
limit is enforced by the proxy.
"""

from __future__ import annotations

import asyncio
import json
import tomllib

import anthropic
import openai
import pytest
from harness_episode import CALC, tool_names
from test_harness_claude_code import run_claude
from test_harness_codex import run_codex
from test_proxy import Harness as ProxyOnLoopback

from legorl.config import ConfigError, load_config
from legorl.engine import ScriptedEngine
from legorl.harness.base import HarnessResult, HarnessRun
from legorl.harness.claude_code import NPM_BIN, ClaudeCodeHarness
from legorl.harness.codex import INSTRUCTIONS_FILE, CodexHarness, codex_config, codex_tool_switches
from legorl.models import render_tool_call_text
from legorl.monitor.alarms import AlarmMonitor
from legorl.pipeline import StepResult, step_line
from legorl.records import GraderReport, LLMCall, Outcome
from legorl.rollout.builders import make_harness
from legorl.rollout.outcomes import EpisodeFacts, decide
from legorl.rollout.teacher import DONE, SUBMIT, teacher_script
from legorl.tasks import builtin_splits

SHORT = "You are a coding agent. Fix the bug with the shell tool, then reply Done."
CODEX_QUIET = {"skills.include_instructions": False, "include_environment_context": False,
               "include_permissions_instructions": False, "include_apps_instructions": False,
               "include_collaboration_mode_instructions": False}


# ---- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize(("overrides", "needle"), [
    (["harness.system_prompt=hi"], "harness.system_prompt is not honoured by mini-swe-agent"),
    (["harness.tools=[bash]"], "harness.tools is not honoured by mini-swe-agent"),
    (["harness.name=claude-code", "harness.system_template=x"], "Claude Code and Codex take harness.system_prompt"),
    (["harness.name=claude-code", "harness.codex_config={a: 1}"], "harness.codex_config is not honoured by claude-code"),
    (["harness.name=codex", "harness.workers=2"], "harness.workers is not honoured by codex"),
])
def test_a_key_the_harness_cannot_honour_is_a_config_error(overrides, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, overrides)


def test_unknown_codex_tool_fails_at_construction_naming_the_known_ones(tmp_path):
    cfg = load_config(None, ["harness.name=codex", "harness.tools=[exec_command, teleport]"])
    with pytest.raises(ConfigError, match="Codex has no tool teleport .known: .*view_image"):
        make_harness(cfg, tmp_path)
    with pytest.raises(ConfigError, match="must keep exec_command"):
        make_harness(load_config(None, ["harness.name=codex", "harness.tools=[view_image]"]), tmp_path)


def test_switches_reach_each_cli_as_its_own_flags_and_config(tmp_path):
    cfg = load_config(None, ["harness.name=claude-code", f"harness.system_prompt={SHORT}", "harness.tools=[Bash, Edit]",
                             "harness.append_system_prompt=Be brief.", "harness.extra_args=[--verbose]"])
    claude = make_harness(cfg, tmp_path)
    assert isinstance(claude, ClaudeCodeHarness)
    run = HarnessRun("r", "task", "http://x/v1", "key", "m", "/sock", relay_base="http://127.0.0.1:1/s/t")
    cmd = claude.command(run)
    assert f"--system-prompt '{SHORT}'" in cmd and "--tools Bash,Edit" in cmd
    assert "--append-system-prompt 'Be brief.'" in cmd and cmd.endswith("--verbose")

    cfg = load_config(None, ["harness.name=codex", f"harness.system_prompt={SHORT}", "harness.tools=[exec_command]",
                             "harness.append_system_prompt=Be brief.", "harness.codex_config={web_search: live}"])
    codex = make_harness(cfg, tmp_path)
    assert isinstance(codex, CodexHarness) and codex.max_calls == cfg.harness.step_limit
    toml = tomllib.loads(codex_config(run, extra=codex.config_keys()))
    assert toml["model_instructions_file"] == INSTRUCTIONS_FILE and toml["developer_instructions"] == "Be brief."
    assert toml["features"] == {"multi_agent": False, "goals": False, "view_image": False, "image_generation": False}
    assert toml["tools"]["update_plan"]["enabled"] is False
    assert toml["web_search"] == "live"  # the config's own key wins over the switch's "disabled"
    assert toml["model_providers"]["legorl"]["base_url"] == "http://127.0.0.1:1/s/t/v1"
    assert codex_tool_switches(["exec_command", "view_image", "update_plan"]).get("features.view_image") is None


# ---- the real CLIs with the shortened configuration -----------------------------------------------
needs_clis = pytest.mark.skipif(not (NPM_BIN / "claude").exists() or not (NPM_BIN / "codex").exists(),
                                reason="needs the pinned Claude Code and Codex CLIs (make setup-test)")


def shell_script(tokenizer, tool: str, arg: str, seen: list[str]):
    def script(i: int, prompt_ids: list[int]) -> str:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen.append(prompt)
        step = prompt.count("<tool_response>")
        if step == 0:
            return "Let me read the file.\n" + render_tool_call_text(tool, {arg: "cat calc.py"})
        if step == 1:
            return render_tool_call_text(tool, {arg: "sed -i 's/a - b/a + b/' calc.py"})
        return DONE
    return script


@needs_clis
def test_claude_code_shortened_by_its_own_flags(tokenizer, tmp_path):
    seen: list[str] = []
    result, _, calls, calc = asyncio.run(run_claude(tokenizer, tmp_path, shell_script(tokenizer, "Bash", "command", seen),
                                                    system_prompt=SHORT, tools=["Bash"]))
    assert result.exit_status == "Submitted" and calc == CALC.replace("a - b", "a + b")
    assert tool_names(seen[0]) == {"Bash"} and SHORT in seen[0]
    assert "You are Claude Code" not in seen[0]
    first = len(calls[0].prompt_ids)
    assert 1000 < first < 4000, first  # its default first prompt is ~21k tokens (BENCHMARKS.md)
    assert [c.parent_index for c in calls[1:]] == [c.index for c in calls[:-1]]
    assert "Today's date is" in seen[0]  # its environment block: the date a small policy can learn as context
    # --bare (its minimal mode, through harness.extra_args): no environment block, so no date, and a
    # short Bash description; the episode plays out the same.
    bare_seen: list[str] = []
    (tmp_path / "bare").mkdir()
    result, _, bare_calls, calc = asyncio.run(run_claude(
        tokenizer, tmp_path / "bare", shell_script(tokenizer, "Bash", "command", bare_seen),
        system_prompt=SHORT, tools=["Bash"], extra_args=["--bare"]))
    assert result.exit_status == "Submitted" and calc == CALC.replace("a - b", "a + b")
    assert tool_names(bare_seen[0]) == {"Bash"} and SHORT in bare_seen[0]
    assert "Today's date is" not in bare_seen[0] and "# Environment" not in bare_seen[0]
    assert len(bare_calls[0].prompt_ids) < first / 2, (len(bare_calls[0].prompt_ids), first)


@needs_clis
def test_codex_shortened_by_its_own_config(tokenizer, tmp_path):
    seen: list[str] = []
    result, _, calls, calc = asyncio.run(run_codex(tokenizer, tmp_path, shell_script(tokenizer, "exec_command", "cmd",
                                                                                      seen),
                                                   system_prompt=SHORT, tools=["exec_command"], config=CODEX_QUIET))
    assert result.exit_status == "Submitted" and calc == CALC.replace("a - b", "a + b")
    assert tool_names(seen[0]) == {"exec_command", "write_stdin"} and SHORT in seen[0]
    assert "<skills_instructions>" not in seen[0] and "Codex CLI" not in seen[0]
    first = len(calls[0].prompt_ids)
    assert 500 < first < 2000, first  # its default first prompt is ~16k tokens (BENCHMARKS.md)


# ---- the teacher plays each harness's own tool ------------------------------------------------------
@pytest.mark.parametrize(("harness", "tool", "arg"), [("mini-swe-agent", "bash", "command"),
                                                      ("claude-code", "Bash", "command"),
                                                      ("codex", "exec_command", "cmd"),
                                                      ("gemini-cli", "run_shell_command", "command")])
def test_teacher_calls_each_harness_shell_tool(harness, tool, arg):
    task = builtin_splits(4, 0, 0)[0][0]
    turns = teacher_script(task, harness=harness)
    calls = [json.loads(t.split("<tool_call>\n", 1)[1].split("\n</tool_call>")[0]) for t in turns if "<tool_call>" in t]
    assert {c["name"] for c in calls} == {tool} and all(set(c["arguments"]) == {arg} for c in calls)
    assert "sed -i" in calls[1]["arguments"][arg]
    if harness == "mini-swe-agent":
        assert calls[-1]["arguments"][arg] == SUBMIT
    else:  # a reply without a tool call ends a CLI's run
        assert turns[-1] == DONE and len(calls) == len(turns) - 1


# ---- outcomes, the proxy's turn limit, the step line and the alarm -----------------------------------
def call(index: int, finish: str) -> LLMCall:
    return LLMCall(rollout_id="r", index=index, wire_format="anthropic_messages", request={}, prompt_ids=[1, 2],
                   completion_ids=[3, 4], completion_logprobs=[-0.1, -0.2], finish_reason=finish, weight_version=0,
                   completion_text="xx", parent_index=None)


def test_a_reply_cut_at_max_tokens_that_ends_the_cli_is_the_policys_failure():
    crashed = HarnessResult(exit_status="turn_failed", n_calls=2, error="Incomplete response returned")
    facts = EpisodeFacts(harness=crashed, proxy_calls=2)
    outcome, reason = decide(facts, [call(0, "stop"), call(1, "length")], None)
    assert outcome == Outcome.UNRESOLVED and "sampling.max_tokens" in reason
    outcome, _ = decide(facts, [call(0, "length"), call(1, "stop")], None)  # the last reply was complete
    assert outcome == Outcome.AGENT_CRASH


def test_proxy_ends_a_codex_episode_at_its_turn_limit(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["one", "two", "three"])
        async with ProxyOnLoopback(engine, tokenizer) as h:
            s = h.proxy.open_session("r", max_calls=2)
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x", max_retries=0)
            for text in ("a", "b"):
                await client.responses.create(model="m", input=text)
            with pytest.raises(openai.BadRequestError, match="turn limit"):
                await client.responses.create(model="m", input="c")
            claude = anthropic.AsyncAnthropic(base_url=h.proxy.anthropic_base_url(s.token), api_key="x", max_retries=0)
            with pytest.raises(anthropic.BadRequestError, match="turn limit"):
                await claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "d"}])
        return s

    session = asyncio.run(main())
    assert session.n_calls == 2 and "max_turns" in session.errors
    done = HarnessResult(exit_status="turn_failed", n_calls=2, error="turn limit")
    outcome, _ = decide(EpisodeFacts(harness=done, proxy_calls=2, proxy_errors=tuple(session.errors)),
                        [call(0, "stop"), call(1, "stop")], None)
    assert outcome == Outcome.GRADER_ERROR  # i.e. a valid episode that ended on its limit, to be graded
    report = GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason="hidden tests failed")
    outcome, _ = decide(EpisodeFacts(harness=done, proxy_calls=2, proxy_errors=("max_turns",)),
                        [call(0, "stop"), call(1, "stop")], report)
    assert outcome == Outcome.MAX_TURNS


def test_a_step_with_nothing_to_train_says_so_and_raises_an_alarm(tmp_path):
    metrics = {"outcomes/context_overflow": 4.0, "outcomes/resolved": 0.0, "train/skipped": 1.0, "time/step_s": 3.0}
    line = step_line(StepResult(0, [], metrics))
    assert "nothing to train" in line and "nan" not in line.lower() and "context_overflow=4" in line
    alarms = AlarmMonitor(run_dir=tmp_path).update(0, metrics)
    (alarm,) = alarms
    assert alarm.name == "nothing_trained" and alarm.severity == "critical"
    assert "context_overflow=4" in alarm.message and "harness.system_prompt" in alarm.message
    assert "nothing_trained" in (tmp_path / "alarms.jsonl").read_text()
    assert AlarmMonitor().update(1, {**metrics, "train/skipped": 0.0}) == []


def test_a_list_of_harnesses_takes_each_key_where_it_is_honoured():
    cfg = load_config(None, ["harness.name=[mini-swe-agent, codex]", "harness.system_prompt=Short.",
                             "harness.system_template=T", "harness.overrides={codex: {tools: [exec_command]}}"])
    mini, codex = (cfg.harness.for_harness(n) for n in cfg.harness.names)
    assert (mini.system_template, mini.system_prompt, mini.tools) == ("T", None, None)
    assert (codex.system_template, codex.system_prompt, codex.tools) == (None, "Short.", ["exec_command"])
    with pytest.raises(ConfigError, match="not honoured by mini-swe-agent"):
        load_config(None, ["harness.name=[mini-swe-agent, codex]", "harness.overrides={mini-swe-agent: {tools: [x]}}"])
    with pytest.raises(ConfigError, match="claude-code is not in harness.name"):
        load_config(None, ["harness.name=[mini-swe-agent, codex]", "harness.overrides={claude-code: {tools: [x]}}"])
    with pytest.raises(ConfigError, match="harness.system_prompt is not honoured by mini-swe-agent"):
        load_config(None, ["harness.name=[mini-swe-agent]", "harness.system_prompt=x"])
    with pytest.raises(ConfigError, match="distinct"):
        load_config(None, ["harness.name=[codex, codex]"])


def test_dashboard_behaviour_splits_by_harness():
    from legorl.monitor.analytics import behaviour
    from legorl.pipeline import per_harness_metrics
    from legorl.records import Rollout

    def rollout(harness: str, text: str, resolved: bool) -> Rollout:
        c = call(0, "stop")
        c.completion_text = text
        return Rollout(id=harness + text, step=0, task_id="t", group_id="g", sample_index=0, harness=harness,
                       split="train", outcome=Outcome.RESOLVED if resolved else Outcome.UNRESOLVED, calls=[c])

    rollouts = [rollout("codex", "prose only", False), rollout("claude-code", "prose", True)]
    step = per_harness_metrics(rollouts, ["claude-code", "codex"])
    assert step["pass_rate/claude-code"] == 1.0 and step["pass_rate/codex"] == 0.0
    assert step["behaviour/by_harness/codex/turns_per_rollout"] == 1.0
    assert per_harness_metrics(rollouts, None) == {}  # one harness: nothing more to log

    class Cache:
        def per_step(self):
            return {0: {"behaviour/turns_per_rollout": 1.0, **step}}

    out = behaviour(Cache())
    assert out["harnesses"] == ["claude-code", "codex"]
    turns = next(c for c in out["charts"] if c["id"] == "b_turns")
    assert [s["name"] for s in turns["series"]] == ["turns", "turns · claude-code", "turns · codex"]


def test_a_saved_config_with_every_key_spelled_out_loads_again(tmp_path):
    # `legorl train --resume` reloads config.json, which holds every key at its value, defaults included
    for overrides in (["harness.name=mini-swe-agent"], ["harness.name=codex", "harness.tools=[exec_command]"],
                      ["harness.name=[mini-swe-agent, claude-code]", "harness.system_prompt=x"]):
        saved = tmp_path / "config.json"
        saved.write_text(json.dumps(load_config(None, overrides).model_dump()))
        assert load_config(saved).harness == load_config(None, overrides).harness


def test_the_loop_runs_as_many_blocking_episode_calls_as_rollout_concurrency() -> None:
    """An in-sandbox harness holds a default-executor thread for its whole episode. Python's own default
    (min(32, cores + 4): 6 on 2 cores) ran 6 episodes at a time whatever rollout.concurrency asked for."""
    import asyncio
    import threading

    from legorl.rollout.builders import episode_threads

    concurrency = 40  # above any machine's default of min(32, cores + 4)
    barrier = threading.Barrier(concurrency, timeout=20)

    async def main() -> None:
        episode_threads(concurrency)
        await asyncio.gather(*(asyncio.to_thread(barrier.wait) for _ in range(concurrency)))

    asyncio.run(main())  # a BrokenBarrierError when fewer calls can run at once
