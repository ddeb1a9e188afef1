"""OpenHands (the pinned SDK and tools in .venv/openhands), unmodified, in a real bubblewrap sandbox,
through the proxy.

The scripted engine plays a short episode (read a file with the terminal, edit it with the
file_editor, run a check, finish) with the tools the SDK declares in its own Chat Completions
request; the test checks the captured calls token by token, the edit in the workspace, that its
iteration budget ends an episode as LimitsExceeded, and that an unknown tool is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

import pytest
from harness_episode import CALC, run_episode, tool_names
from test_proxy import check_fidelity

from legorl.harness.openhands import OPENHANDS_PYTHON, OpenHandsHarness
from legorl.models import render_tool_call_text
from legorl.records import Outcome
from legorl.rollout.outcomes import EpisodeFacts, decide

needs_openhands = pytest.mark.skipif(not OPENHANDS_PYTHON.exists() or shutil.which("bwrap") is None,
                                     reason="needs the OpenHands environment (make setup-test) and bubblewrap")


def make_script(tokenizer, seen: list[str]):
    def script(i: int, prompt_ids: list[int]) -> str:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen.append(prompt)
        step = prompt.count("<tool_response>")
        if step == 0:
            return "I will read the file.\n" + render_tool_call_text("terminal", {"command": "cat calc.py"})
        if step == 1:
            return render_tool_call_text("file_editor", {"command": "str_replace", "path": "/workspace/calc.py",
                                                         "old_str": "return a - b", "new_str": "return a + b"})
        if step == 2:
            return render_tool_call_text("terminal", {"command": "python -c 'import calc; print(calc.add(2, 3))'"})
        return "Fixed: add now returns a + b (checked: prints 5)."
    return script


async def run_openhands(tokenizer, tmp_path: Path, script, box_kw=None, **harness_kw):
    return await run_episode(OpenHandsHarness(timeout=300, **harness_kw), tokenizer, tmp_path, script, box_kw)


@needs_openhands
def test_openhands_plays_an_episode_through_the_proxy(tokenizer, tmp_path):
    seen: list[str] = []
    result, session, calls, calc = asyncio.run(run_openhands(
        tokenizer, tmp_path, make_script(tokenizer, seen), tools=["terminal", "file_editor"]))
    assert result.exit_status == "Submitted", (result, seen[-1][-3000:] if seen else None)
    assert calc == CALC.replace("a - b", "a + b")
    assert [t.name for c in calls for t in c.tool_calls] == ["terminal", "file_editor", "terminal"]
    assert len(calls) == 4 and {c.wire_format for c in calls} == {"openai_chat"}  # no side call
    assert tool_names(seen[0]) == {"terminal", "file_editor", "finish", "think"}  # the SDK adds finish, think
    check_fidelity(tokenizer, calls)
    assert [c.parent_index for c in calls[1:]] == [c.index for c in calls[:-1]]  # one token-exact chain
    assert "return a - b" in seen[1] and "5" in seen[3].split("<tool_response>")[-1]  # tool output reached it
    outcome, _ = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.GRADER_ERROR  # i.e. everything up to grading was a valid episode


@needs_openhands
def test_its_iteration_budget_ends_an_openhands_episode_as_limits_exceeded(tokenizer, tmp_path):
    def always_terminal(i, ids):
        return render_tool_call_text("terminal", {"command": f"echo {i}"})
    result, session, calls, _ = asyncio.run(run_openhands(tokenizer, tmp_path, always_terminal, max_calls=2,
                                                          system_prompt="Fix the bug."))
    assert result.exit_status == "LimitsExceeded" and "MaxIterationsReached" in result.error, result
    assert len(calls) == 2 == session.n_calls
    assert "Fix the bug." in calls[0].request["messages"][0]["content"][0]["text"]  # its prompt, replaced


def test_start_finds_the_openhands_python_and_what_the_sandbox_must_show(tmp_path):
    if not OPENHANDS_PYTHON.exists():
        pytest.skip("needs the OpenHands environment (make setup-test)")
    harness = OpenHandsHarness()

    async def start_and_close() -> None:
        await harness.start()  # as root it begins the prefork server's start too; close() ends it
        await harness.close()

    asyncio.run(start_and_close())
    assert harness.binary == str(OPENHANDS_PYTHON) and harness.server is None
    prefix, base = (Path(p) for p in harness.visible_paths)
    assert prefix == OPENHANDS_PYTHON.parent.parent.resolve() and (base / "lib").is_dir()


@needs_openhands
def test_tool_params_reach_the_sdks_tool(tokenizer, tmp_path):
    """harness.tool_params: the terminal's no-change timeout, 2 s instead of its 30, hands a command that prints
    nothing back to the agent."""
    def script(i, ids):
        if i == 0:
            return render_tool_call_text("terminal", {"command": "sleep 60"})
        return "Done."
    result, _, calls, _ = asyncio.run(run_openhands(
        tokenizer, tmp_path, script, tools=["terminal"], tool_params={"terminal": {"no_change_timeout_seconds": 2}}))
    assert result.exit_status == "Submitted", result
    assert len(calls) == 2
    observation = json.dumps(calls[1].request["messages"][-1])
    assert "2 seconds" in observation, observation[-800:]  # its own note of the timeout it was given


@pytest.mark.parametrize(("kw", "message"), [
    ({"tools": ["terminal", "bash"]}, "OpenHands has no tool bash"),
    ({"tools": ["file_editor"]}, "must keep terminal"),
    ({"append_system_prompt": "x"}, "no such switch"),
    ({"tools": ["terminal"], "tool_params": {"file_editor": {}}}, "file_editor is not among the agent's tools"),
])
def test_a_switch_openhands_cannot_honour_is_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        OpenHandsHarness(**kw)


@needs_openhands
@pytest.mark.skipif(os.geteuid() != 0, reason="a fork enters a sandbox's namespaces as root (privileged bwrap)")
def test_openhands_forked_from_a_prefork_server_plays_the_same_episode(tokenizer, tmp_path):
    """The sandbox runs as its own uid, as in a training run: the runner is forked into it with the SDK already
    imported (harness/prefork.py), and the episode is the same, token for token."""
    harness = OpenHandsHarness(timeout=300, tools=["terminal", "file_editor"])
    forked = []
    close = harness.close

    async def count_then_close():
        forked.append(harness.server.forked if harness.server is not None else 0)
        await close()

    harness.close = count_then_close
    seen: list[str] = []
    result, _, calls, calc = asyncio.run(run_episode(harness, tokenizer, tmp_path, make_script(tokenizer, seen),
                                                     box_kw={}))
    assert forked == [1], "the episode ran through the prefork server"
    assert result.exit_status == "Submitted", (result, seen[-1][-3000:] if seen else None)
    assert calc == CALC.replace("a - b", "a + b")
    assert [t.name for c in calls for t in c.tool_calls] == ["terminal", "file_editor", "terminal"]
    check_fidelity(tokenizer, calls)
    assert [c.parent_index for c in calls[1:]] == [c.index for c in calls[:-1]]
