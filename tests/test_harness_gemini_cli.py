"""Gemini CLI (the pinned npm package), unmodified, in a real bubblewrap sandbox, through the proxy's Gemini API.

The scripted engine plays a short episode (read a file, edit it, run a check, finish) with the tools
Gemini CLI declares in its own request; the test checks the captured calls token by token, the edit
in the workspace, that its system prompt was replaced through its own switch, that its own turn limit
ends the episode as max_turns, that its next-speaker check (a side call) is recorded in a side session
of its own without touching the agent's chain, and that a Gemini CLI that never reaches its model is
no_model_calls.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from harness_episode import CALC, check_read_edit_check_episode, check_side_session, run_episode, tool_names

from legorl.harness.base import HarnessRun
from legorl.harness.gemini_cli import GeminiCliHarness, gemini_settings, result_object
from legorl.harness.in_sandbox import NPM_BIN
from legorl.models import render_tool_call_text
from legorl.records import MAIN_SESSION, GraderReport, Outcome
from legorl.rollout.outcomes import EpisodeFacts, decide
from legorl.train.sequences import build_sequences

needs_cli = pytest.mark.skipif(not (NPM_BIN / "gemini").exists() or shutil.which("bwrap") is None,
                               reason="needs the pinned Gemini CLI (make setup-test) and bubblewrap")
SYSTEM = "You are a coding agent. Fix the bug with your tools, then reply Done."
RUN = HarnessRun(rollout_id="r", task_text="t", api_base="", api_key="tok", model_name="legorl-policy",
                 control_socket="", relay_base="http://127.0.0.1:9/s/tok")
NEXT_SPEAKER = "Analyze *only* the content and structure of your immediately preceding response"


def make_script(tokenizer, seen: list[str]):
    def script(i: int, prompt_ids: list[int]) -> str:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if NEXT_SPEAKER in prompt:  # its next-speaker check: a JSON answer, no tools
            return json.dumps({"reasoning": "The task is done.", "next_speaker": "user"})
        seen.append(prompt)
        assert "run_shell_command" in tool_names(prompt), "Gemini CLI no longer declares run_shell_command"
        step = prompt.count("<tool_response>")
        if step == 0:
            return "I will read the file.\n" + render_tool_call_text("read_file", {"file_path": "/workspace/calc.py"})
        if step == 1:
            return render_tool_call_text("replace", {
                "file_path": "/workspace/calc.py", "instruction": "add must add", "old_string": "return a - b",
                "new_string": "return a + b"})
        if step == 2:
            return render_tool_call_text("run_shell_command", {
                "command": "python -c 'import calc; print(calc.add(2, 3))'", "description": "check add"})
        return "Fixed: add now returns a + b (checked: prints 5)."
    return script


async def run_gemini(tokenizer, tmp_path: Path, script, **harness_kw):
    return await run_episode(GeminiCliHarness(timeout=240, **harness_kw), tokenizer, tmp_path, script)


@needs_cli
def test_gemini_cli_plays_an_episode_through_the_gemini_api(tokenizer, tmp_path):
    seen: list[str] = []
    result, session, calls, calc = asyncio.run(run_gemini(
        tokenizer, tmp_path, make_script(tokenizer, seen), system_prompt=SYSTEM,
        tools=["run_shell_command", "read_file", "replace"]))
    assert result.exit_status == "Submitted", (result, seen[-1][-3000:] if seen else None)
    assert calc == CALC.replace("a - b", "a + b")
    assert [t.name for c in calls for t in c.tool_calls] == ["read_file", "replace", "run_shell_command"]
    assert len(calls) == 4 and {c.wire_format for c in calls} == {"gemini"}
    assert {c.session for c in calls} == {MAIN_SESSION} and result.n_calls == 4  # no side call by default
    assert tool_names(seen[0]) == {"run_shell_command", "read_file", "replace"}  # its tools.core allowlist
    system_text = seen[0].split("<|im_start|>system\n", 1)[1].split("\n\n# Tools", 1)[0]  # before the tool section
    assert SYSTEM in system_text and "Gemini CLI" not in system_text  # its prompt, replaced
    check_read_edit_check_episode(tokenizer, result, session, calls, seen)


@needs_cli
def test_its_next_speaker_check_is_a_side_session_of_its_own(tokenizer, tmp_path):
    seen: list[str] = []
    result, session, calls, calc = asyncio.run(run_gemini(
        tokenizer, tmp_path, make_script(tokenizer, seen), tools=["run_shell_command", "read_file", "replace"],
        settings={"model": {"skipNextSpeakerCheck": False}}, max_calls=8))
    assert result.exit_status == "Submitted", (result, seen[-1][-3000:] if seen else None)
    main = check_side_session(tokenizer, calls, session, "next_speaker", n_main=4)
    # What trains by default: the agent's one sequence; with rollout.train_side_calls, the check is one more.
    assert len(build_sequences("r1", main, 1.0, include_unsampled=True)) == 1
    assert len(build_sequences("r1", calls, 1.0, include_unsampled=True)) == 2
    assert calc == CALC.replace("a - b", "a + b")


@needs_cli
def test_its_own_turn_limit_ends_an_episode_as_max_turns(tokenizer, tmp_path):
    always_shell = lambda i, ids: render_tool_call_text("run_shell_command", {"command": f"echo {i}"})
    result, session, calls, _ = asyncio.run(run_gemini(tokenizer, tmp_path, always_shell, max_calls=2))
    assert len(calls) == 2 and session.n_calls == 2
    assert result.exit_status == "LimitsExceeded" and "max session turns" in result.error, result
    facts = EpisodeFacts(harness=result, proxy_calls=session.n_calls)
    report = GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason="tests fail")
    assert decide(facts, calls, report)[0] == Outcome.MAX_TURNS


@needs_cli
def test_gemini_cli_without_model_calls_is_no_model_calls(tokenizer, tmp_path):
    # Its base URL points nowhere (and one attempt, not ten): it exits without reaching its model.
    result, session, calls, calc = asyncio.run(run_gemini(
        tokenizer, tmp_path, lambda i, ids: "unused", extra_env={"GOOGLE_GEMINI_BASE_URL": "http://127.0.0.1:9"},
        settings={"general": {"maxAttempts": 1}}))
    assert result.exit_status != "Submitted" and result.error
    assert session.n_calls == 0 and calls == [] and calc == CALC
    outcome, reason = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.NO_MODEL_CALLS, reason


def test_the_settings_env_and_command_line_point_it_at_the_session() -> None:
    s = gemini_settings(max_calls=5, tools=["run_shell_command"], extra={"model": {"skipNextSpeakerCheck": False}})
    assert s["security"] == {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}}
    assert s["model"] == {"maxSessionTurns": 5, "skipNextSpeakerCheck": False}  # merged, not replaced
    assert s["tools"] == {"core": ["run_shell_command"]} and s["privacy"] == {"usageStatisticsEnabled": False}
    h = GeminiCliHarness(system_prompt="Be brief.", extra_env={"NO_COLOR": None}, binary="gemini")
    env = h.env(RUN)
    assert env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:9/s/tok" and env["GEMINI_API_KEY"] == "tok"
    assert env["GEMINI_SYSTEM_MD"].endswith(".md") and "NO_COLOR" not in env
    assert "GEMINI_SYSTEM_MD" not in GeminiCliHarness().env(RUN)  # its own prompt unless one is given
    assert h.command(RUN).startswith("gemini -m legorl-policy --approval-mode yolo --output-format json")


def test_side_calls_are_named_from_what_they_ask_for() -> None:
    h = GeminiCliHarness()
    assert h.call_kind({"contents": [], "tools": [{"functionDeclarations": [{"name": "x"}]}]}) == MAIN_SESSION
    schema = {"properties": {"next_speaker": {"enum": ["user", "model"]}}}
    assert h.call_kind({"generationConfig": {"responseJsonSchema": schema}}) == "next_speaker"
    assert h.call_kind({"generationConfig": {"responseSchema": {"properties": {"unproductive_state_confidence": {}}}}}
                       ) == "loop_check"
    assert h.call_kind({"contents": []}) == "side"


def test_its_result_and_error_objects_are_read_from_the_output() -> None:
    ok = 'YOLO mode is enabled.\n{\n  "session_id": "a",\n  "response": "Done.",\n  "stats": {}\n}\n'
    assert result_object(ok) == {"session_id": "a", "response": "Done.", "stats": {}}
    err = '{\n  "session_id": "b",\n  "error": {"type": "FatalTurnLimitedError", "code": 53}\n}'
    assert result_object("noise\n" + err + "\n[ERROR] " + err)["error"]["code"] == 53
    assert result_object("Ripgrep is not available.\n") is None


@pytest.mark.parametrize(("kw", "message"), [
    ({"tools": ["run_shell_command", "Bash"]}, "Gemini CLI has no tool Bash"),
    ({"tools": ["read_file"]}, "must keep run_shell_command"),
    ({"append_system_prompt": "x"}, "no such switch"),
])
def test_a_switch_gemini_cli_cannot_honour_is_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        GeminiCliHarness(**kw)
