"""`harness.name: command`: an agent legorl has no adapter for, run by its own command line in a real bubblewrap
sandbox, through the proxy.

The agent is examples/bash_agent.py, a user's own agent on the official `openai` SDK that knows nothing of
legorl. The scripted engine plays a short episode (read, edit, check, reply) through its `bash` tool, streamed
and not; the test checks the captured calls token by token, the edit in the workspace, that a request without
tools is a side session (unless `side_calls: none`), that the proxy's turn limit ends the episode as max_turns,
that a failing command is an agent_crash with its output as the error, and that the config refuses what the
harness cannot honour.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from harness_episode import (
    BASH_AGENT,
    CALC,
    answering_side_call,
    check_read_edit_check_episode,
    check_side_session,
    run_episode,
    tool_names,
)

from legorl.config import ConfigError, load_config
from legorl.harness.base import HarnessRun, ToolStyle
from legorl.harness.command import PROMPT_FILE, CommandHarness
from legorl.models import render_tool_call_text
from legorl.records import MAIN_SESSION, GraderReport, Outcome, Rollout
from legorl.rollout.builders import make_harness
from legorl.rollout.demo_report import demo_report
from legorl.rollout.outcomes import EpisodeFacts, decide
from legorl.rollout.teacher import teacher_script
from legorl.tasks import builtin_splits

COMMAND = f"{shlex.quote(sys.executable)} {shlex.quote(str(BASH_AGENT))}"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def make_script(tokenizer, seen: list[str]):
    def script(i: int, prompt_ids: list[int]) -> str:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen.append(prompt)
        assert tool_names(prompt) == {"bash"}
        step = prompt.count("<tool_response>")
        if step == 0:
            return "I will read the file.\n" + render_tool_call_text("bash", {"command": "cat calc.py"})
        if step == 1:
            return render_tool_call_text("bash", {"command": "sed -i 's/a - b/a + b/' calc.py"})
        if step == 2:
            return render_tool_call_text("bash", {"command": "python3 -c 'import calc; print(calc.add(2, 3))'"})
        return "Fixed: add now returns a + b (checked: prints 5)."
    return script


async def run_agent(tokenizer, tmp_path: Path, script, **harness_kw):
    harness_kw.setdefault("command", COMMAND)
    harness_kw.setdefault("visible_paths", (str(BASH_AGENT.parent),))
    return await run_episode(CommandHarness(timeout=120, **harness_kw), tokenizer, tmp_path, script)


@needs_bwrap
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_users_agent_plays_an_episode_through_its_own_command_line(tokenizer, tmp_path, stream):
    seen: list[str] = []
    env = {"AGENT_STREAM": "1"} if stream else {}
    result, session, calls, calc = asyncio.run(run_agent(tokenizer, tmp_path, make_script(tokenizer, seen), env=env))
    assert result.exit_status == "Submitted", result
    assert calc == CALC.replace("a - b", "a + b")
    assert [t.name for c in calls for t in c.tool_calls] == ["bash", "bash", "bash"]
    assert len(calls) == 4 and {c.wire_format for c in calls} == {"openai_chat"}
    assert {c.request.get("stream", False) for c in calls} == {stream}
    assert "add(2, 3) returns -1" in seen[0]  # the task reached it through $LEGORL_PROMPT_FILE
    check_read_edit_check_episode(tokenizer, result, session, calls, seen)


@needs_bwrap
def test_a_request_without_tools_is_a_side_session_unless_side_calls_none(tokenizer, tmp_path):
    seen: list[str] = []
    script = answering_side_call(tokenizer, make_script(tokenizer, seen), "five-word title", "Fix add in calc")

    result, session, calls, calc = asyncio.run(run_agent(tokenizer, tmp_path / "side", script,
                                                         env={"AGENT_TITLE": "1"}))
    assert result.exit_status == "Submitted" and calc == CALC.replace("a - b", "a + b")
    check_side_session(tokenizer, calls, session, "side", n_main=4)

    seen.clear()
    result, session, calls, _ = asyncio.run(run_agent(tokenizer, tmp_path / "none", script,
                                                      env={"AGENT_TITLE": "1"}, side_calls="none"))
    assert result.exit_status == "Submitted"
    assert {c.session for c in calls} == {MAIN_SESSION} and session.n_calls == 5  # the title is a turn too


@needs_bwrap
def test_the_proxys_turn_limit_ends_the_episode_as_max_turns(tokenizer, tmp_path):
    always_bash = lambda i, ids: render_tool_call_text("bash", {"command": f"echo {i}"})
    result, session, calls, _ = asyncio.run(run_agent(tokenizer, tmp_path, always_bash, max_calls=2))
    assert len(calls) == 2 and session.n_calls == 2
    assert result.exit_status == "exited" and "exited with 1" in result.error, result  # the SDK raised
    facts = EpisodeFacts(harness=result, proxy_calls=session.n_calls, proxy_errors=("max_turns",))
    report = GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason="tests fail")
    assert decide(facts, calls, report)[0] == Outcome.MAX_TURNS


@needs_bwrap
def test_a_failing_command_is_an_agent_crash_with_its_output(tokenizer, tmp_path):
    always_bash = lambda i, ids: render_tool_call_text("bash", {"command": "true"})
    result, session, calls, _ = asyncio.run(run_agent(tokenizer, tmp_path / "crash", always_bash,
                                                      env={"AGENT_MAX_STEPS": "1"}))  # its own limit: exit 1
    assert result.exit_status == "exited" and "exited with 1" in result.error and "step limit reached" in result.error
    assert decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)[0] == Outcome.AGENT_CRASH

    result, session, calls, calc = asyncio.run(run_agent(
        tokenizer, tmp_path / "none", always_bash, command="echo 'no such agent here' >&2; exit 3"))
    assert result.exit_status == "exited" and "exited with 3" in result.error and "no such agent here" in result.error
    assert calls == [] and calc == CALC
    assert decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)[0] == Outcome.NO_MODEL_CALLS


@needs_bwrap
def test_an_exit_status_of_its_own_turn_limit_is_max_turns(tokenizer, tmp_path):
    always_bash = lambda i, ids: render_tool_call_text("bash", {"command": "true"})
    # examples/bash_agent.py exits 1 at its own step limit (AGENT_MAX_STEPS)
    result, session, calls, _ = asyncio.run(run_agent(tokenizer, tmp_path, always_bash, limit_exit_codes=(1,),
                                                      env={"AGENT_MAX_STEPS": "2"}))
    assert result.exit_status == "LimitsExceeded" and "exit 1" in result.error and session.n_calls == 2
    passing = GraderReport(resolved=True, outcome=Outcome.RESOLVED, reason="")
    outcome, reason = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, passing)
    assert outcome == Outcome.MAX_TURNS and "not submitted" in reason  # a passing diff is not credited


@needs_bwrap
def test_the_environment_names_the_session_for_every_wire_format_and_the_task_file(tokenizer, tmp_path):
    names = ["OPENAI_BASE_URL", "OPENAI_API_BASE", "OPENAI_API_KEY", "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY",
             "GOOGLE_GEMINI_BASE_URL", "GEMINI_API_KEY", "GOOGLE_API_KEY", "LEGORL_BASE_URL", "LEGORL_API_KEY",
             "LEGORL_MODEL", "LEGORL_PROMPT_FILE", "LEGORL_LAUNCH_DIR", "HOME", "EXTRA"]
    command = " && ".join(f'echo "{n}=${n}"' for n in names) + ' && cat "$LEGORL_PROMPT_FILE"'
    result, session, _, _ = asyncio.run(run_agent(tokenizer, tmp_path, lambda i, ids: "unused", command=command,
                                                  env={"EXTRA": "mine"}, instance_template="Task: {task}"))
    out = dict(line.split("=", 1) for line in result.messages[0]["content"].splitlines() if "=" in line)
    relay = out["ANTHROPIC_BASE_URL"]
    assert relay.startswith("http://127.0.0.1:") and relay.endswith(f"/s/{session.token}")
    assert out["OPENAI_BASE_URL"] == out["OPENAI_API_BASE"] == relay + "/v1"
    assert out["GOOGLE_GEMINI_BASE_URL"] == out["LEGORL_BASE_URL"] == relay
    keys = ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "GEMINI_API_KEY", "GOOGLE_API_KEY", "LEGORL_API_KEY")
    assert {out[k] for k in keys} == {session.token} and out["LEGORL_MODEL"] == "legorl-policy"
    assert out["LEGORL_PROMPT_FILE"] == PROMPT_FILE and out["HOME"] == "/tmp" and out["EXTRA"] == "mine"
    assert out["LEGORL_LAUNCH_DIR"] == os.getcwd()
    assert "Task: add(2, 3) returns -1" in result.messages[0]["content"]


def test_the_teacher_plays_through_the_named_shell_tool_and_submit_command(cache_dir) -> None:
    harness = make_harness(load_config(None, ["harness.name=command", "harness.command=my-agent --yes",
                                              "harness.shell_tool=run", "harness.shell_arg=cmd"]), cache_dir)
    assert isinstance(harness, CommandHarness) and harness.teacher_style == ToolStyle("run", "cmd", None)
    task = builtin_splits(n_train=1, n_heldout=1, seed=0)[0][0]
    turns = teacher_script(task, harness=harness.teacher_style)
    assert all('"name": "run"' in t and '"cmd"' in t for t in turns[:-1]) and "<tool_call>" not in turns[-1]

    submitting = make_harness(load_config(None, ["harness.name=command", "harness.command=mini",
                                                 "harness.shell_submit=echo SUBMIT"]), cache_dir)
    last = teacher_script(task, harness=submitting.teacher_style)[-1]
    assert '"name": "bash"' in last and "echo SUBMIT" in last  # the episode ends with the agent's submit command


@needs_bwrap
def test_a_teacher_playing_a_tool_the_agent_lacks_is_named_in_the_demo_report(tokenizer, tmp_path):
    # harness.shell_tool named wrong: the agent (whose one tool is `bash`) answers with an error, the script goes
    # on, and the episode ends with nothing changed; its own requests say what the teacher should have called
    turns = [render_tool_call_text("shell", {"cmd": "sed -i 's/a - b/a + b/' calc.py"}), "Done."]
    result, _, calls, calc = asyncio.run(run_agent(tokenizer, tmp_path, turns))
    assert result.exit_status == "Submitted" and calc == CALC
    assert "bad tool call" in json.dumps(calls[1].request["messages"][-1])  # what the agent answered
    demo = Rollout(id="r1", step=-1, task_id="t", group_id="g", sample_index=0, harness="command",
                   outcome=Outcome.UNRESOLVED, outcome_reason="empty patch", calls=calls, split="demo")
    text = demo_report([demo])
    assert "0 of 1 resolved" in text and "harness.shell_tool" in text
    assert "the teacher called the tool `shell`, which the agent does not declare (its tools: bash)" in text


@pytest.mark.parametrize(("overrides", "message"), [
    (["harness.name=command"], "needs harness.command"),
    (["harness.name=command", "harness.command=a", "harness.visible_paths=[/no/such/agent]"],
     "harness.visible_paths: /no/such/agent does not exist"),
    (["harness.command=my-agent"], "harness.command is not honoured by mini-swe-agent"),
    (["harness.name=codex", "harness.shell_tool=run"], "harness.shell_tool is not honoured by codex"),
    (["harness.name=command", "harness.command=a", "harness.side_calls=some"], "side_calls"),
])
def test_the_config_refuses_what_the_harness_cannot_honour(overrides, message, cache_dir) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        make_harness(load_config(None, overrides), cache_dir)


def test_without_the_sandbox_relay_it_says_so_and_runs_nothing() -> None:
    run = HarnessRun(rollout_id="r", task_text="t", api_base="", api_key="tok", model_name="legorl-policy",
                     control_socket="/nonexistent/control.sock", relay_base="")
    result = asyncio.run(CommandHarness(command="my-agent").run(run))
    assert result.exit_status == "exited" and "relay_base is empty" in result.error


def test_an_empty_command_is_refused() -> None:
    with pytest.raises(ValueError, match="harness.command is empty"):
        CommandHarness(command="  ")


def test_a_harness_list_takes_a_command_through_its_overrides() -> None:
    cfg = load_config(None, ["harness.name=[mini-swe-agent, command]", "harness.overrides={command: {command: agent}}"])
    assert cfg.harness.for_harness("command").command == "agent"
    with pytest.raises(ConfigError, match="needs harness.command"):
        load_config(None, ["harness.name=[mini-swe-agent, command]"])
