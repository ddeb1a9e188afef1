"""OpenCode (the pinned npm package), unmodified, in a real bubblewrap sandbox, through the proxy.

The scripted engine plays a short episode (read a file, edit it, run a check, finish) with the tools
OpenCode declares in its own request, through each of the three provider packages it bundles (Chat
Completions, Responses, Messages); the test checks the captured calls token by token, the edit in
the workspace, that no title side call reaches the model, that the proxy's turn limit ends the
episode as max_turns, and that an OpenCode that never reaches its model is no_model_calls.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from harness_episode import (
    CALC,
    answering_side_call,
    check_read_edit_check_episode,
    check_side_session,
    run_episode,
    tool_names,
)

from legorl.harness.base import HarnessRun
from legorl.harness.in_sandbox import NPM_BIN
from legorl.harness.opencode import TOOLS, OpenCodeHarness, opencode_config
from legorl.models import render_tool_call_text
from legorl.records import GraderReport, Outcome
from legorl.rollout.outcomes import EpisodeFacts, decide

needs_cli = pytest.mark.skipif(not (NPM_BIN / "opencode").exists() or shutil.which("bwrap") is None,
                               reason="needs the pinned OpenCode CLI (make setup-test) and bubblewrap")
RUN = HarnessRun(rollout_id="r", task_text="t", api_base="", api_key="tok", model_name="legorl-policy",
                 control_socket="", relay_base="http://127.0.0.1:9/s/tok")


def make_script(tokenizer, seen: list[str]):
    def script(i: int, prompt_ids: list[int]) -> str:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen.append(prompt)
        names = tool_names(prompt)
        assert "bash" in names, f"OpenCode no longer declares bash: {names}"
        step = prompt.count("<tool_response>")
        if step == 0:
            return "I will read the file.\n" + render_tool_call_text("read", {"filePath": "/workspace/calc.py"})
        if step == 1:
            return render_tool_call_text("edit", {"filePath": "/workspace/calc.py", "oldString": "return a - b",
                                                  "newString": "return a + b"})
        if step == 2:
            return render_tool_call_text("bash", {"command": "python -c 'import calc; print(calc.add(2, 3))'",
                                                  "description": "check add"})
        return "Fixed: add now returns a + b (checked: prints 5)."
    return script


async def run_opencode(tokenizer, tmp_path: Path, script, **harness_kw):
    return await run_episode(OpenCodeHarness(timeout=240, **harness_kw), tokenizer, tmp_path, script)


@needs_cli
@pytest.mark.parametrize("wire_format", ["openai_chat", "openai_responses", "anthropic_messages"])
def test_opencode_plays_an_episode_through_each_provider_format(tokenizer, tmp_path, wire_format):
    seen: list[str] = []
    result, session, calls, calc = asyncio.run(run_opencode(
        tokenizer, tmp_path, make_script(tokenizer, seen), wire_format=wire_format, tools=["bash", "read", "edit"]))
    assert result.exit_status == "Submitted", (result, seen[-1][-3000:] if seen else None)
    assert calc == CALC.replace("a - b", "a + b")
    assert [t.name for c in calls for t in c.tool_calls] == ["read", "edit", "bash"]
    assert len(calls) == 4 and {c.wire_format for c in calls} == {wire_format}  # no title call
    assert tool_names(seen[0]) == {"bash", "read", "edit", "write"}  # edit and write come and go together
    check_read_edit_check_episode(tokenizer, result, session, calls, seen)


@needs_cli
def test_its_title_call_when_enabled_is_a_side_session_of_its_own(tokenizer, tmp_path):
    seen: list[str] = []
    script = answering_side_call(tokenizer, make_script(tokenizer, seen), "title generator", "Fix add")

    result, session, calls, calc = asyncio.run(run_opencode(
        tokenizer, tmp_path, script, tools=["bash", "read", "edit"], config={"agent": {"title": {"disable": False}}}))
    assert result.exit_status == "Submitted" and calc == CALC.replace("a - b", "a + b")
    check_side_session(tokenizer, calls, session, "title", n_main=4)
    assert len([c for c in calls if c.session == "title"]) == 1


@needs_cli
def test_the_proxys_turn_limit_ends_an_opencode_episode_as_max_turns(tokenizer, tmp_path):
    always_bash = lambda i, ids: render_tool_call_text("bash", {"command": f"echo {i}"})
    result, session, calls, _ = asyncio.run(run_opencode(tokenizer, tmp_path, always_bash, max_calls=2))
    assert len(calls) == 2 and session.n_calls == 2
    assert result.exit_status == "turn_failed" and "turn limit" in result.error, result
    facts = EpisodeFacts(harness=result, proxy_calls=session.n_calls, proxy_errors=("max_turns",))
    report = GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason="tests fail")
    assert decide(facts, calls, report)[0] == Outcome.MAX_TURNS


@needs_cli
def test_opencode_without_model_calls_is_no_model_calls(tokenizer, tmp_path):
    # The provider's base URL points nowhere: OpenCode exits without reaching its model.
    nowhere = {"provider": {"legorl": {"options": {"baseURL": "http://127.0.0.1:9/v1"}}}}
    result, session, calls, calc = asyncio.run(
        run_opencode(tokenizer, tmp_path, lambda i, ids: "unused", config=nowhere))
    assert result.exit_status != "Submitted" and result.error
    assert session.n_calls == 0 and calls == [] and calc == CALC
    outcome, reason = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.NO_MODEL_CALLS, reason


def test_the_config_points_the_provider_at_the_session_and_switches_tools_off() -> None:
    cfg = opencode_config(RUN, wire_format="anthropic_messages", system_prompt="Be brief.", tools=["bash"],
                          extra={"agent": {"build": {"temperature": 0.5}}, "share": "manual"})
    provider = cfg["provider"]["legorl"]
    assert provider["npm"] == "@ai-sdk/anthropic"
    assert provider["options"] == {"baseURL": "http://127.0.0.1:9/s/tok/v1", "apiKey": "tok"}
    assert cfg["model"] == "legorl/legorl-policy" and cfg["agent"]["title"] == {"disable": True}
    assert cfg["agent"]["build"] == {"prompt": "Be brief.", "temperature": 0.5}  # merged, not replaced
    assert cfg["tools"] == {t: False for t in TOOLS if t != "bash"} and cfg["share"] == "manual"
    assert opencode_config(RUN, tools=["bash", "edit"])["tools"] == {  # edit keeps write: one switch for both
        t: False for t in ("glob", "grep", "read", "skill", "task", "todowrite", "webfetch")}
    env = OpenCodeHarness(extra_env={"NO_COLOR": None}).env(RUN)
    assert json.loads(env["OPENCODE_CONFIG_CONTENT"])["provider"]["legorl"]["npm"] == "@ai-sdk/openai-compatible"
    assert "NO_COLOR" not in env and env["OPENCODE_DISABLE_PROJECT_CONFIG"] == "1"


@pytest.mark.parametrize(("kw", "message"), [
    ({"tools": ["bash", "Bash"]}, "OpenCode has no tool Bash"),
    ({"tools": ["read"]}, "must keep bash"),
    ({"wire_format": "gemini"}, "not 'gemini'"),
    ({"append_system_prompt": "x"}, "no such switch"),
])
def test_a_switch_opencode_cannot_honour_is_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        OpenCodeHarness(**kw)
