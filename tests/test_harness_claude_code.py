"""Claude Code (the pinned npm CLI), unmodified, in a real bubblewrap sandbox, through the proxy.

The scripted engine plays a short episode (read a file, edit it, run a check, finish) using the tool
names and argument schemas Claude Code declares in its own request; the test checks the captured
calls token by token, the edit in the workspace, and that a Claude Code that never reaches its
model is reported as such (no_model_calls), never as a success.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest
from harness_episode import CALC, run_episode, sandbox_kwargs, tool_names
from test_proxy import check_fidelity

from legorl.harness.claude_code import NPM_BIN, ClaudeCodeHarness
from legorl.models import render_tool_call_text
from legorl.records import Outcome
from legorl.rollout.outcomes import EpisodeFacts, decide

pytestmark = pytest.mark.skipif(not (NPM_BIN / "claude").exists() or shutil.which("bwrap") is None,
                                reason="needs the pinned Claude Code CLI (make setup-test) and bubblewrap")

def make_script(tokenizer, seen: list[str]):
    """Decide each reply from the prompt: how many tool results came back so far in this conversation."""
    def script(i: int, prompt_ids: list[int]) -> str:
        prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        seen.append(prompt)
        if "XML tags:\n<tools>" not in prompt:  # a side call (e.g. a title or summary): plain text
            return "Fix calc"
        names = tool_names(prompt)
        assert {"Read", "Edit", "Bash"} <= names, f"Claude Code no longer declares Read/Edit/Bash: {names}"
        step = prompt.count("<tool_response>")
        if step == 0:
            return "I will read the file.\n" + render_tool_call_text("Read", {"file_path": "/workspace/calc.py"})
        if step == 1:
            return render_tool_call_text("Edit", {"file_path": "/workspace/calc.py", "old_string": "return a - b",
                                                  "new_string": "return a + b"})
        if step == 2:
            return render_tool_call_text("Bash", {"command": "python -c 'import calc; print(calc.add(2, 3))'",
                                                  "description": "Check add"})
        return "Fixed: add now returns a + b (checked: prints 5)."
    return script


async def run_claude(tokenizer, tmp_path: Path, script, **harness_kw):
    return await run_episode(ClaudeCodeHarness(max_turns=8, timeout=240, **harness_kw), tokenizer, tmp_path, script)


def test_claude_code_plays_an_episode_through_the_proxy(tokenizer, tmp_path):
    seen: list[str] = []
    result, session, calls, calc = asyncio.run(run_claude(tokenizer, tmp_path, make_script(tokenizer, seen)))
    assert result.exit_status == "Submitted", (result, seen[-1][-3000:] if seen else None)
    assert calc == CALC.replace("a - b", "a + b")
    main = [c for c in calls if c.tool_calls or "Fixed" in c.completion_text]
    assert [c.tool_calls[0].name for c in main if c.tool_calls] == ["Read", "Edit", "Bash"]
    assert all(c.wire_format == "anthropic_messages" for c in calls)
    check_fidelity(tokenizer, calls)
    # the episode is one token-exact chain: every main-line call after the first extends the one before
    idx = [c.index for c in main]
    assert [c.parent_index for c in main[1:]] == idx[:-1], [(c.index, c.parent_index, c.segment_break)
                                                             for c in calls]
    assert re.search(r"<tool_response>\n.*return a - b", seen[-3], re.DOTALL)  # Read's output reached the model
    outcome, _ = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.GRADER_ERROR  # i.e. everything up to grading was a valid episode


@pytest.mark.skipif(not sandbox_kwargs(), reason="needs a sandbox that can run as root")
def test_claude_code_without_model_calls_is_no_model_calls(tokenizer, tmp_path):
    # As root, skipped permissions without IS_SANDBOX=1 make Claude Code exit before any model call.
    result, session, calls, calc = asyncio.run(
        run_claude(tokenizer, tmp_path, lambda i, ids: "unused", extra_env={"IS_SANDBOX": None}))
    assert result.exit_status != "Submitted" and result.error
    assert session.n_calls == 0 and calls == [] and calc == CALC
    outcome, reason = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.NO_MODEL_CALLS, reason
