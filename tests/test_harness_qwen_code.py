"""Qwen Code (the pinned npm package), unmodified, in a real bubblewrap sandbox, through the proxy.

The scripted engine plays a short episode (read a file, edit it, run a check, finish) with the tools
Qwen Code declares in its own request; the test checks the captured calls token by token, the edit
in the workspace, that no side call (memory agent, next-speaker check, summaries) reaches the model,
that its own turn limit (and its loop guard) ends the episode as max_turns, that its shell timeout
setting ends a command waiting on stdin, that a prompt past the context is context_overflow with Qwen's
compression request in a side session, and that a Qwen Code that never reaches its model is
no_model_calls.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from harness_episode import CALC, check_read_edit_check_episode, run_episode, tool_names

from legorl.config import ConfigError, load_config
from legorl.engine.base import ContextOverflowError
from legorl.harness.base import HarnessRun
from legorl.harness.in_sandbox import NPM_BIN
from legorl.harness.qwen_code import PROMPT_FILE, SETTINGS_FILE, TOOLS, QwenCodeHarness, qwen_settings
from legorl.models import render_tool_call_text
from legorl.records import MAIN_SESSION, GraderReport, Outcome
from legorl.rollout.builders import make_harness
from legorl.rollout.outcomes import EpisodeFacts, decide

needs_cli = pytest.mark.skipif(not (NPM_BIN / "qwen").exists() or shutil.which("bwrap") is None,
                               reason="needs the pinned Qwen Code CLI (make setup-test) and bubblewrap")
RUN = HarnessRun(rollout_id="r", task_text="t", api_base="", api_key="tok", model_name="legorl-policy",
                 control_socket="", relay_base="http://127.0.0.1:9/s/tok")
DEFAULT_DECLARED = {"agent", "edit", "get_goal", "glob", "grep_search", "list_agents", "notebook_edit", "read_file",
                    "run_shell_command", "skill", "tool_call", "tool_search", "update_goal", "write_file"}


def make_script(tokenizer, seen: list[str]):
    def script(i: int, prompt_ids: list[int]) -> str:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen.append(prompt)
        names = tool_names(prompt)
        assert "run_shell_command" in names, f"Qwen Code no longer declares run_shell_command: {names}"
        step = prompt.count("<tool_response>")
        if step == 0:
            return "I will read the file.\n" + render_tool_call_text("read_file", {"file_path": "/workspace/calc.py"})
        if step == 1:
            return render_tool_call_text("edit", {"file_path": "/workspace/calc.py", "old_string": "return a - b",
                                                  "new_string": "return a + b"})
        if step == 2:
            return render_tool_call_text("run_shell_command",
                                         {"command": "python3 -c 'import calc; print(calc.add(2, 3))'"})
        return "Fixed: add now returns a + b (checked: prints 5)."
    return script


async def run_qwen(tokenizer, tmp_path: Path, script, **harness_kw):
    return await run_episode(QwenCodeHarness(timeout=240, **harness_kw), tokenizer, tmp_path, script)


@needs_cli
def test_qwen_code_plays_an_episode_through_the_proxy(tokenizer, tmp_path):
    seen: list[str] = []
    result, session, calls, calc = asyncio.run(run_qwen(tokenizer, tmp_path, make_script(tokenizer, seen)))
    assert result.exit_status == "Submitted", (result, seen[-1][-3000:] if seen else None)
    assert calc == CALC.replace("a - b", "a + b")
    assert [t.name for c in calls for t in c.tool_calls] == ["read_file", "edit", "run_shell_command"]
    assert len(calls) == 4 and {c.wire_format for c in calls} == {"openai_chat"}  # no side call reached it
    assert tool_names(seen[0]) == DEFAULT_DECLARED  # its defaults: 14 declared, the rest behind tool_search
    assert result.n_calls == 4
    check_read_edit_check_episode(tokenizer, result, session, calls, seen)


@needs_cli
def test_qwen_code_shortened_by_its_own_switches(tokenizer, tmp_path):
    seen: list[str] = []
    short = "You are a coding agent. Fix the bug with the shell tool, then reply Done."
    result, _, calls, calc = asyncio.run(run_qwen(tokenizer, tmp_path, make_script(tokenizer, seen),
                                                  system_prompt=short, tools=["run_shell_command", "read_file", "edit"]))
    assert result.exit_status == "Submitted" and calc == CALC.replace("a - b", "a + b")
    assert tool_names(seen[0]) == {"run_shell_command", "read_file", "edit"}
    assert short in seen[0] and "You are Qwen Code" not in seen[0]
    assert "<available_skills>" not in seen[0] and "tool_search" not in seen[0]
    assert len(calls[0].prompt_ids) < 7000, len(calls[0].prompt_ids)  # its default first prompt: ~30k tokens


@needs_cli
def test_its_shell_timeout_setting_ends_a_command_that_waits_on_stdin(tokenizer, tmp_path):
    # `cat $(grep ...)` with nothing found is a bare `cat` waiting on stdin: with Qwen's default 120 s shell
    # timeout it held RL steps for two minutes. Its own setting (configs/demo-qwen-code.yaml) bounds it; the
    # harness timeout here (60 s) is shorter than the default, so the default would fail the episode.
    seen: list[str] = []

    def script(i: int, ids: list[int]) -> str:
        seen.append(tokenizer.decode(ids, skip_special_tokens=False))
        return render_tool_call_text("run_shell_command", {"command": "cat"}) if i == 0 else "Done."
    result, _, calls, _ = asyncio.run(run_episode(
        QwenCodeHarness(timeout=60, tools=["run_shell_command"], settings={"tools": {"shell": {"defaultTimeoutMs": 2000}}}),
        tokenizer, tmp_path, script))
    assert result.exit_status == "Submitted" and len(calls) == 2, result
    assert "Command timed out after 2000ms" in seen[1].rsplit("<tool_response>", 1)[-1]


@needs_cli
def test_its_own_turn_limit_ends_a_qwen_code_episode_as_max_turns(tokenizer, tmp_path):
    always_shell = lambda i, ids: render_tool_call_text("run_shell_command", {"command": f"echo {i}"})
    result, session, calls, _ = asyncio.run(run_qwen(tokenizer, tmp_path, always_shell, max_calls=2,
                                                     tools=["run_shell_command"]))
    assert len(calls) == 2 and session.n_calls == 2 and not session.errors  # Qwen stopped before the proxy had to
    assert result.exit_status == "LimitsExceeded", result
    report = GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason="tests fail")
    facts = EpisodeFacts(harness=result, proxy_calls=session.n_calls, proxy_errors=tuple(session.errors))
    assert decide(facts, calls, report)[0] == Outcome.MAX_TURNS


@needs_cli
def test_its_loop_guard_ends_an_episode_like_a_limit_not_a_crash(tokenizer, tmp_path):
    # The same tool call five times running: Qwen's always-on guard halts the run (no switch turns it off).
    same_call = lambda i, ids: render_tool_call_text("run_shell_command", {"command": "echo again"})
    result, session, calls, _ = asyncio.run(run_qwen(tokenizer, tmp_path, same_call, tools=["run_shell_command"]))
    assert len(calls) == 5 and result.exit_status == "LimitsExceeded", result
    assert "consecutive_identical_tool_calls" in result.error
    report = GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason="tests fail")
    assert decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, report)[0] == Outcome.MAX_TURNS


@needs_cli
def test_a_prompt_past_the_context_is_context_overflow_and_its_compression_a_side_session(tokenizer, tmp_path):
    # A refused prompt makes Qwen compress the conversation (no switch turns that off) and go on: the
    # summary request is a side session, the rollout is masked as context_overflow, its turn limit ends it.
    def script(i: int, ids: list[int]) -> str:
        if len(ids) + 1 > 5000:
            raise ContextOverflowError(f"prompt of {len(ids)} tokens")
        return render_tool_call_text("run_shell_command", {"command": f"seq {i} 300"})
    result, session, calls, _ = asyncio.run(run_qwen(tokenizer, tmp_path, script, max_calls=6,
                                                     system_prompt="Fix it.", tools=["run_shell_command"]))
    assert "context_overflow" in session.errors and result.exit_status == "LimitsExceeded", result
    assert {c.session for c in calls} == {MAIN_SESSION, "compression"}
    main = [c for c in calls if c.session == MAIN_SESSION]
    assert len(main) == session.n_calls == 6
    facts = EpisodeFacts(harness=result, proxy_calls=session.n_calls, proxy_errors=tuple(session.errors))
    assert decide(facts, main, None)[0] == Outcome.CONTEXT_OVERFLOW


@needs_cli
def test_qwen_code_without_model_calls_is_no_model_calls(tokenizer, tmp_path):
    # Its base URL points nowhere and it does not retry: Qwen Code exits without reaching its model.
    result, session, calls, calc = asyncio.run(run_qwen(
        tokenizer, tmp_path, lambda i, ids: "unused", extra_env={"OPENAI_BASE_URL": "http://127.0.0.1:9/v1"},
        settings={"model": {"generationConfig": {"maxRetries": 0}}}))
    assert result.exit_status != "Submitted" and result.error
    assert session.n_calls == 0 and calls == [] and calc == CALC
    outcome, reason = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.NO_MODEL_CALLS, reason


def test_the_settings_switch_side_calls_and_tools_off_and_the_env_points_at_the_session() -> None:
    s = qwen_settings(max_calls=7, tools=["run_shell_command", "edit"],
                      extra={"model": {"maxSessionTurns": 9}, "general": {"chatRecording": True}})
    assert s["memory"]["enableManagedAutoMemory"] is False and s["model"]["skipNextSpeakerCheck"] is True
    assert s["model"]["maxSessionTurns"] == 9 and s["general"] == {"enableAutoUpdate": False, "chatRecording": True}
    assert s["tools"]["core"] == ["run_shell_command", "edit"]
    assert set(s["tools"]["disabled"]) == set(TOOLS) - {"run_shell_command", "edit"}
    assert s["skills"]["disabledLevels"]  # no skill tool: no skills listed either
    assert "tools" not in qwen_settings() and qwen_settings()["model"].get("maxSessionTurns") is None
    h = QwenCodeHarness(system_prompt="Be brief.", append_system_prompt="Really.", extra_args=["--bare"],
                        extra_env={"NO_COLOR": None})
    env = h.env(RUN)
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/s/tok/v1" and env["OPENAI_API_KEY"] == "tok"
    assert env["QWEN_CODE_SYSTEM_SETTINGS_PATH"] == SETTINGS_FILE and "NO_COLOR" not in env
    cmd = h.command(RUN)
    assert "--system-prompt 'Be brief.' --append-system-prompt Really. --bare" in cmd
    assert cmd.endswith(f"< {PROMPT_FILE}") and "--approval-mode yolo" in cmd
    assert json.loads(QwenCodeHarness(max_calls=3).settings_json())["model"]["maxSessionTurns"] == 3
    summary = {"messages": [{"role": "system", "content": "You are the component that summarizes a conversation ..."}]}
    assert h.call_kind(summary) == "compression" and h.call_kind({"messages": []}) == "side"
    assert h.call_kind({"messages": [], "tools": [{"type": "function"}]}) == MAIN_SESSION


def test_the_config_builds_it_with_its_switches(tmp_path) -> None:
    cfg = load_config(None, ["harness.name=qwen-code", "harness.tools=[run_shell_command]",
                             "harness.settings={model: {skipStartupContext: true}}", "harness.system_prompt=hi",
                             "harness.append_system_prompt=Be brief."])
    h = make_harness(cfg, tmp_path)
    assert isinstance(h, QwenCodeHarness) and h.max_calls == cfg.harness.step_limit and h.system_prompt == "hi"
    assert h.append_system_prompt == "Be brief." and h.tools == ["run_shell_command"]
    assert json.loads(h.settings_json())["model"]["skipStartupContext"] is True
    with pytest.raises(ConfigError, match="Qwen Code has no tool bash"):
        make_harness(load_config(None, ["harness.name=qwen-code", "harness.tools=[run_shell_command, bash]"]), tmp_path)


@pytest.mark.parametrize(("kw", "message"), [
    ({"tools": ["run_shell_command", "Bash"]}, "Qwen Code has no tool Bash .known: agent"),
    ({"tools": ["read_file"]}, "must keep run_shell_command"),
])
def test_a_switch_qwen_code_cannot_honour_is_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        QwenCodeHarness(**kw)
