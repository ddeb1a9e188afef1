"""Codex CLI (the pinned npm package), unmodified, in a real bubblewrap sandbox, through the proxy.

The scripted engine plays a short episode (read a file, edit it, run a check, finish) with the tool
Codex declares in its own Responses request (`exec_command`); the test checks the captured calls
token by token, the edit in the workspace, and that a Codex that never reaches its model is
reported as such (no_model_calls), never as a success.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from harness_episode import CALC, run_episode, tool_names
from test_proxy import check_fidelity

from legorl.harness.claude_code import NPM_BIN
from legorl.harness.codex import CodexHarness, native_codex
from legorl.models import render_tool_call_text
from legorl.records import Outcome
from legorl.rollout.outcomes import EpisodeFacts, decide

pytestmark = pytest.mark.skipif(not (NPM_BIN / "codex").exists() or shutil.which("bwrap") is None,
                                reason="needs the pinned Codex CLI (make setup-test) and bubblewrap")


def make_script(tokenizer, seen: list[str]):
    def script(i: int, prompt_ids: list[int]) -> str:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen.append(prompt)
        if "XML tags:\n<tools>" not in prompt:  # a side call: plain text
            return "ok"
        names = tool_names(prompt)
        assert "exec_command" in names, f"Codex no longer declares exec_command: {names}"
        step = prompt.count("<tool_response>")
        if step == 0:
            return "I will read the file.\n" + render_tool_call_text("exec_command", {"cmd": "cat calc.py"})
        if step == 1:
            return render_tool_call_text("exec_command", {"cmd": "sed -i 's/a - b/a + b/' calc.py"})
        if step == 2:
            return render_tool_call_text("exec_command",
                                         {"cmd": "python -c 'import calc; print(calc.add(2, 3))'"})
        return "Fixed: add now returns a + b (checked: prints 5)."
    return script


async def run_codex(tokenizer, tmp_path: Path, script, **harness_kw):
    return await run_episode(CodexHarness(timeout=240, retries=0, **harness_kw), tokenizer, tmp_path, script)


def test_codex_plays_an_episode_through_the_proxy(tokenizer, tmp_path):
    seen: list[str] = []
    result, session, calls, calc = asyncio.run(run_codex(tokenizer, tmp_path, make_script(tokenizer, seen)))
    assert result.exit_status == "Submitted", (result, seen[-1][-3000:] if seen else None)
    assert calc == CALC.replace("a - b", "a + b")
    main = [c for c in calls if c.tool_calls or "Fixed" in c.completion_text]
    assert [c.tool_calls[0].name for c in main if c.tool_calls] == ["exec_command"] * 3
    assert all(c.wire_format == "openai_responses" for c in calls)
    check_fidelity(tokenizer, calls)
    idx = [c.index for c in main]
    assert [c.parent_index for c in main[1:]] == idx[:-1], [(c.index, c.parent_index, c.segment_break)
                                                             for c in calls]
    assert "return a - b" in seen[-3]  # cat's output reached the model
    assert "Fixed" in result.messages[-1]["content"]
    outcome, _ = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.GRADER_ERROR  # i.e. everything up to grading was a valid episode


def test_codex_without_model_calls_is_no_model_calls(tokenizer, tmp_path):
    # A provider without a reachable base URL: Codex exits without reaching its model.
    result, session, calls, calc = asyncio.run(
        run_codex(tokenizer, tmp_path, lambda i, ids: "unused", extra_args=["-c", "model_provider=nowhere"]))
    assert result.exit_status != "Submitted" and result.error
    assert session.n_calls == 0 and calls == [] and calc == CALC
    outcome, reason = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.NO_MODEL_CALLS, reason


def test_codex_starts_its_native_binary_as_the_npm_launcher_would(tmp_path):
    # The npm `codex` is a Node launcher that execs the platform binary with two variables set: the
    # harness runs that binary itself (one Node start less per episode), with the same variables.
    harness = CodexHarness()
    asyncio.run(harness.start())
    assert harness.binary is not None and Path(harness.binary).name == "codex" and Path(harness.binary).is_file()
    assert "/vendor/" in harness.binary and not harness.binary.endswith(".js")
    assert harness.launcher_env["CODEX_MANAGED_BY_NPM"] == "1"
    assert Path(harness.launcher_env["CODEX_MANAGED_PACKAGE_ROOT"], "bin", "codex.js").is_file()
    assert native_codex(str(tmp_path / "codex")) is None  # not the launcher: used as given
    fake = tmp_path / "node_modules" / "@openai" / "codex" / "bin" / "codex.js"
    fake.parent.mkdir(parents=True)
    fake.write_text("")
    assert native_codex(str(fake)) is None  # the launcher without its platform package
