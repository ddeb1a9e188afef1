"""Behaviour analytics on hand-built trajectories in mini-swe-agent, Claude Code, Codex and OpenHands styles."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from legorl.monitor.behaviour import aggregate, analyse_calls, step_metrics, turns_from_calls
from legorl.monitor.commands import classify_command, classify_tool_call, same_file
from legorl.monitor.messages import FORMATS, conversation_items, messages_of, new_messages
from legorl.records import ABANDONED, LLMCall, Outcome, Rollout, ToolCall

BASH_TOOL = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def call(i: int, request: dict[str, Any], tool_calls: list[ToolCall], text: str = "", fmt: str = "openai_chat",
         finish: str = "stop") -> LLMCall:
    return LLMCall(rollout_id="r", index=i, wire_format=fmt, request=request, prompt_ids=[1], completion_ids=[2],
                   completion_logprobs=[-0.1], finish_reason=finish, weight_version=0, completion_text=text,
                   tool_calls=tool_calls)


def chat_tool_turn(calls: list[LLMCall], msgs: list[dict[str, Any]], i: int, request: dict[str, Any], tool: str,
                   command: str, output: str) -> None:
    """Call i asks `tool` to run `command` (OpenAI Chat); its answer and the tool's output join the messages."""
    tc = ToolCall(id=f"c{i}", name=tool, arguments=json.dumps({"command": command}))
    calls.append(call(i, request, [tc]))
    msgs.append({"role": "assistant", "content": "", "tool_calls": [
        {"id": tc.id, "type": "function", "function": {"name": tool, "arguments": tc.arguments}}]})
    msgs.append({"role": "tool", "tool_call_id": tc.id, "content": output})


# ---- mini-swe-agent: OpenAI Chat, one `bash` tool, format errors answered by a user note ------------------
def mini_trajectory() -> list[LLMCall]:
    cmds = ["grep -rn 'def net_price' .", "cat pkg/pricing.py", None,
            "sed -i 's|price + discount|price - discount|' pkg/pricing.py", "cd /repo && python -m pytest -q",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": "Fix net_price."}]
    calls = []
    for i, cmd in enumerate(cmds):
        req = {"model": "m", "messages": list(msgs), "tools": BASH_TOOL}
        if cmd is None:  # the model wrote prose: mini drops the turn and says so
            calls.append(call(i, req, [], text="I think the bug is in pricing."))
            msgs.append({"role": "user", "content": "Tool call error:\n<error>\nNo tool calls found in the response. "
                                                    "Every response MUST include at least one tool call.\n</error>"})
            continue
        chat_tool_turn(calls, msgs, i, req, "bash", cmd, f"<returncode>0</returncode> out {i}")
    return calls


def test_mini_swe_agent_trajectory() -> None:
    b = analyse_calls(mini_trajectory(), "mini-swe-agent")
    assert (b.turns, b.tool_calls, b.text_only_turns, b.format_errors) == (6, 5, 1, 1)
    assert b.submitted
    assert (b.edits, b.verified_edits) == (1, 1)  # pytest after the sed -i
    assert dict(b.mix) == {"search": 1, "read": 1, "edit": 1, "test": 1, "submit": 1}


def test_mini_turn_feedback_is_read_from_the_next_request() -> None:
    turns = turns_from_calls(mini_trajectory())
    assert [m.role for m in turns[0].feedback] == ["tool"] and "out 0" in turns[0].feedback[0].text
    assert turns[2].feedback[0].role == "user" and "No tool calls found" in turns[2].feedback[0].text
    assert turns[-1].feedback == []


def test_abandoned_calls_are_not_turns() -> None:
    """A call whose client went away (recorded with the index its retry takes) is no turn of its own."""
    calls = mini_trajectory()
    gone = LLMCall(rollout_id="r", index=2, wire_format="openai_chat", request=calls[2].request, prompt_ids=[1],
                   completion_ids=[], completion_logprobs=[], finish_reason=ABANDONED, weight_version=0,
                   completion_text="")
    assert analyse_calls(calls[:2] + [gone] + calls[2:], "mini-swe-agent") == analyse_calls(calls, "mini-swe-agent")


def test_mini_unverified_edit_and_no_submit() -> None:
    calls = mini_trajectory()[:4]  # ends right after the edit
    b = analyse_calls(calls, "mini-swe-agent")
    assert (b.edits, b.verified_edits, b.submitted) == (1, 0, False)


# ---- Claude Code: Anthropic Messages, Read/Edit/Bash tools, ends with a plain-text answer ----------------
def claude_trajectory() -> list[LLMCall]:
    tools = [{"name": n, "input_schema": {"type": "object"}} for n in ("Read", "Edit", "Bash", "Grep")]
    steps = [("Grep", {"pattern": "def total", "path": "src"}), ("Read", {"file_path": "/repo/src/cart.py"}),
             ("Edit", {"file_path": "/repo/src/cart.py", "old_string": "+", "new_string": "-"}),
             ("Edit", {"file_path": "/repo/src/util.py", "old_string": "a", "new_string": "b"}),
             ("Read", {"file_path": "src/cart.py"}), None]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "Fix total()."}]}]
    calls = [call(0, {"model": "m", "system": "title generator", "messages": [{"role": "user", "content": "t"}]},
                  [], text="Fix cart total", fmt="anthropic_messages")]  # a side request without tools
    for i, step in enumerate(steps, start=1):
        req = {"model": "m", "system": [{"type": "text", "text": "You are Claude Code."}], "tools": tools,
               "messages": [dict(m) for m in msgs]}
        if step is None:
            calls.append(call(i, req, [], text="I fixed the sign in total().", fmt="anthropic_messages"))
            break
        name, args = step
        tc = ToolCall(id=f"toolu_{i}", name=name, arguments=json.dumps(args))
        calls.append(call(i, req, [tc], text="", fmt="anthropic_messages"))
        msgs.append({"role": "assistant", "content": [{"type": "tool_use", "id": tc.id, "name": name, "input": args}]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": tc.id,
                                                  "content": [{"type": "text", "text": f"result {i}"}]}]})
    return calls


def test_claude_code_trajectory() -> None:
    b = analyse_calls(claude_trajectory(), "claude-code")
    assert b.turns == 6  # the side request without tools is not an agent turn
    assert (b.tool_calls, b.text_only_turns, b.format_errors) == (5, 1, 0)
    assert b.submitted  # ended with a plain-text answer
    assert (b.edits, b.verified_edits) == (2, 1)  # cart.py re-read after its edit; util.py never checked
    assert dict(b.mix) == {"search": 1, "read": 2, "edit": 2}


def test_claude_code_tool_results_and_moved_cache_markers() -> None:
    calls = claude_trajectory()
    prev = conversation_items(calls[2].request, "anthropic_messages")
    cur = conversation_items(calls[3].request, "anthropic_messages")
    cur[0] = {**cur[0], "cache_control": {"type": "ephemeral"}}  # a marker moved: not a new message
    new = new_messages(prev, cur, "anthropic_messages")
    assert [(m.role, m.tool_call_id, m.text) for m in new] == [("tool", "toolu_2", "result 2")]


def test_claude_code_truncated_last_turn_is_not_a_submit() -> None:
    calls = claude_trajectory()
    calls[-1].finish_reason = "length"
    assert not analyse_calls(calls, "claude-code").submitted


# ---- Codex: OpenAI Responses, shell with argv lists, apply_patch -----------------------------------------
def codex_trajectory(bad_args: bool = False) -> list[LLMCall]:
    patch = "*** Begin Patch\n*** Update File: src/calc.py\n@@\n-    return a + b\n+    return a - b\n*** End Patch"
    steps = [("shell", {"command": ["bash", "-lc", "rg -n 'def sub' src"]}),
             ("shell", {"command": ["bash", "-lc", "sed -n '1,40p' src/calc.py"]}),
             ("apply_patch", {"input": patch}),
             ("shell", {"command": ["bash", "-lc", "cat src/calc.py && pytest -q tests/test_calc.py"]}),
             None]
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Fix sub()."}]}]
    tools = [{"type": "function", "name": "shell"}, {"type": "function", "name": "apply_patch"}]
    calls = []
    for i, step in enumerate(steps):
        req = {"model": "m", "instructions": "You are Codex.", "tools": tools, "input": list(items)}
        if step is None:
            calls.append(call(i, req, [], text="Done: sub() subtracts now.", fmt="openai_responses"))
            break
        name, args = step
        arguments = "{not json" if bad_args and i == 1 else json.dumps(args)
        tc = ToolCall(id=f"call_{i}", name=name, arguments=arguments)
        calls.append(call(i, req, [tc], fmt="openai_responses"))
        items.append({"type": "function_call", "call_id": tc.id, "name": name, "arguments": arguments})
        items.append({"type": "function_call_output", "call_id": tc.id, "output": f"exit 0, output {i}"})
    return calls


def test_codex_trajectory() -> None:
    b = analyse_calls(codex_trajectory(), "codex")
    assert (b.turns, b.tool_calls, b.text_only_turns, b.format_errors) == (5, 4, 1, 0)
    assert b.submitted
    assert (b.edits, b.verified_edits) == (1, 1)
    assert dict(b.mix) == {"search": 1, "read": 1, "edit": 1, "test": 1}


def test_codex_malformed_arguments_are_format_errors() -> None:
    b = analyse_calls(codex_trajectory(bad_args=True), "codex")
    assert b.format_errors == 1
    assert b.mix["other"] == 1  # the malformed call could not be classified


# ---- OpenHands SDK: OpenAI Chat, `terminal`; a reply without a tool call finishes the conversation ----------
def test_openhands_text_reply_is_its_submit_not_a_format_error() -> None:
    steps = ["cat pkg/geometry.py", "sed -i 's|w + h|w * h|' pkg/geometry.py", None]
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are OpenHands agent."},
                                  {"role": "user", "content": "Fix area()."}]
    terminal = [{"type": "function", "function": {"name": "terminal", "parameters": {"type": "object"}}}]
    calls = []
    for i, cmd in enumerate(steps):
        req = {"model": "m", "messages": list(msgs), "tools": terminal}
        if cmd is None:
            calls.append(call(i, req, [], text="Done"))
            break
        chat_tool_turn(calls, msgs, i, req, "terminal", cmd, f"out {i}")
    b = analyse_calls(calls, "openhands")
    assert (b.turns, b.tool_calls, b.text_only_turns, b.format_errors) == (3, 2, 1, 0)
    assert b.submitted and dict(b.mix) == {"read": 1, "edit": 1}


def test_codex_tool_results_parsed() -> None:
    calls = codex_trajectory()
    msgs = messages_of(calls[2].request, "openai_responses")
    assert msgs[0].role == "system" and msgs[0].text == "You are Codex."
    assert [m.role for m in msgs[1:]] == ["user", "assistant", "tool", "assistant", "tool"]
    assert msgs[-1].tool_call_id == "call_1" and msgs[-1].text == "exit 0, output 1"


# ---- one parser per wire format: the dashboard reads bodies as the proxy parsed them ------------------------
@pytest.mark.parametrize("calls,fmt", [(mini_trajectory, "openai_chat"), (claude_trajectory, "anthropic_messages"),
                                       (codex_trajectory, "openai_responses")])
def test_messages_are_the_proxys_canonical_messages(calls, fmt: str) -> None:
    parser = FORMATS[fmt](strict_fields=False)
    for c in calls():
        body = {"max_tokens": 64, **c.request}  # Anthropic requires max_tokens; the dashboard does not
        want = parser.parse(body).messages
        got = messages_of(body, fmt)
        assert [(m.role, m.text, m.tool_call_id) for m in got] == \
            [(m["role"], m["content"] or "", m.get("tool_call_id")) for m in want]


def test_anthropic_tool_results_flagged_as_errors() -> None:
    body = claude_trajectory()[3].request
    body["messages"][-1]["content"][0]["is_error"] = True  # Claude Code: "<tool_use_error>..." results
    msgs = messages_of(body, "anthropic_messages")
    assert [(m.role, m.is_error) for m in msgs if m.role == "tool"] == [("tool", False), ("tool", True)]


def test_the_dashboard_does_not_load_torch() -> None:
    code = "import sys, legorl.monitor.server, legorl.monitor.messages; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- aggregation and step metrics -------------------------------------------------------------------------
def test_aggregate_is_a_ratio_of_sums() -> None:
    a = analyse_calls(mini_trajectory(), "mini-swe-agent")
    c = analyse_calls(claude_trajectory(), "claude-code")
    m = aggregate([a, c])
    assert m["behaviour/turns_per_rollout"] == pytest.approx((6 + 6) / 2)
    assert m["behaviour/tool_calls_per_turn"] == pytest.approx((5 + 5) / 12)
    assert m["behaviour/text_only_turn_rate"] == pytest.approx(2 / 12)
    assert m["behaviour/format_error_rate"] == pytest.approx(1 / 12)
    assert m["behaviour/verify_after_edit_rate"] == pytest.approx((1 + 1) / (1 + 2))
    assert m["behaviour/submit_rate"] == 1.0
    assert m["behaviour/mix/edit"] == pytest.approx(3 / 10)
    assert sum(v for k, v in m.items() if "/mix/" in k) == pytest.approx(1.0)
    assert aggregate([]) == {}


def test_step_metrics_from_rollouts() -> None:
    r = Rollout(id="r", step=0, task_id="t", group_id="g", sample_index=0, harness="mini-swe-agent",
                outcome=Outcome.RESOLVED, reward=1.0, calls=mini_trajectory())
    empty = Rollout(id="e", step=0, task_id="t", group_id="g", sample_index=1, harness="mini-swe-agent")
    m = step_metrics([r, empty])
    assert m["behaviour/rollouts"] == 1.0 and m["behaviour/submit_rate"] == 1.0


# ---- the command classifier -------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd,kind", [
    ("cat src/a.py", "read"), ("nl -ba src/a.py | sed -n '10,20p'", "read"), ("head -n 30 a.py", "read"),
    ("sed -n '1,50p' src/a.py", "read"), ("tail -f log.txt", "read"), ("git diff", "read"),
    ("grep -rn 'def f' src/", "search"), ("rg foo", "search"), ("find . -name '*.py'", "search"), ("ls -la", "search"),
    ("sed -i 's/a/b/' src/a.py", "edit"), ("cat > src/a.py <<'EOF'\nx = 1\nEOF", "edit"),
    ("echo 'x = 1' > src/b.py", "edit"), ("python -c \"open('a.py', 'w').write('x')\"", "edit"),
    ("python - <<EOF\nfrom pathlib import Path\nPath('a.py').write_text('x')\nEOF", "edit"),
    ("perl -pi -e 's/a/b/' f.py", "edit"), ("git apply fix.patch", "edit"), ("apply_patch <<'EOF'\n*** Begin Patch\nEOF", "edit"),
    ("pytest -q", "test"), ("python -m pytest tests/test_a.py -k x", "test"), ("tox -e py311", "test"),
    ("cd /repo && python -m pytest 2>&1 | tail -5", "test"), ("timeout 60 python test_bug.py", "test"),
    ("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "submit"),
    ("python script.py", "other"), ("pip install requests", "other"), ("echo 'a > b'", "other"),
    ("python -c 'print(1)'", "other"),
])
def test_classify_command(cmd: str, kind: str) -> None:
    assert classify_command(cmd).kind == kind


def test_compound_commands_keep_their_order_and_paths() -> None:
    c = classify_command("cd /repo && sed -i 's/a/b/' src/x.py && cat src/x.py")
    assert [(a.kind, a.paths) for a in c.actions] == [("edit", ["src/x.py"]), ("read", ["src/x.py"])]
    assert classify_command("echo \"a > b\" >> notes.txt").actions[0].paths == ["notes.txt"]


@pytest.mark.parametrize("name,args,kind,valid", [
    ("Read", {"file_path": "/r/a.py"}, "read", True), ("Edit", {"file_path": "a.py"}, "edit", True),
    ("MultiEdit", {"file_path": "a.py", "edits": []}, "edit", True), ("Write", {"file_path": "n.py"}, "edit", True),
    ("Grep", {"pattern": "x"}, "search", True), ("Glob", {"pattern": "**/*.py"}, "search", True),
    ("Bash", {"command": "pytest"}, "test", True), ("TodoWrite", {"todos": []}, "other", True),
    ("shell", {"command": ["bash", "-lc", "cat a.py"]}, "read", True),
    ("shell", {"command": ["apply_patch", "*** Begin Patch\n*** Add File: b.py\n+x\n*** End Patch"]}, "edit", True),
    ("apply_patch", {"input": "*** Begin Patch\n*** Delete File: c.py\n*** End Patch"}, "edit", True),
    ("str_replace_editor", {"command": "view", "path": "a.py"}, "read", True),
    ("str_replace_editor", {"command": "str_replace", "path": "a.py"}, "edit", True),
    ("submit", {}, "submit", True), ("bash", {"cmd": ""}, "other", False), ("Read", {}, "read", False),
])
def test_classify_tool_call(name: str, args: dict[str, Any], kind: str, valid: bool) -> None:
    c = classify_tool_call(name, json.dumps(args))
    assert (c.kind, c.valid) == (kind, valid)


def test_patch_paths_and_same_file() -> None:
    c = classify_tool_call("apply_patch", json.dumps({"input": "*** Begin Patch\n*** Update File: src/x.py\n*** End Patch"}))
    assert c.actions[0].paths == ["src/x.py"]
    assert same_file("/repo/src/x.py", "./src/x.py") and same_file("x.py", "/repo/src/x.py")
    assert not same_file("src/x.py", "src/y.py") and not same_file("a/x.py", "b/x.py")
    assert not classify_tool_call("bash", "{not json").valid


def test_reasoning_and_tool_call_shares_of_the_output(tmp_path) -> None:
    import json

    from legorl.monitor.analytics import evaluation_shares
    from legorl.monitor.behaviour import output_shares
    from legorl.monitor.db import RunDB
    from legorl.records import LLMCall, Rollout, ToolCall
    from legorl.store import Store

    def call(text: str, tools: bool) -> LLMCall:
        return LLMCall(rollout_id="r", index=0, wire_format="openai_chat", request={}, prompt_ids=[1],
                       completion_ids=[2], completion_logprobs=[-0.1], finish_reason="stop", weight_version=0,
                       completion_text=text, tool_calls=[ToolCall("c", "bash", "{}")] if tools else [])

    r = Rollout(id="r", step=0, task_id="t", group_id="g", sample_index=0, harness="h",
                calls=[call("<think>abcdef</think>done", True), call("plain text", False)])
    shares = output_shares([r], ("<think>", "</think>"))
    assert shares["reasoning_share"] == pytest.approx(6 / (len("<think>abcdef</think>done") + len("plain text")))
    assert shares["tool_call_share"] == 0.5
    assert output_shares([r], None)["reasoning_share"] == 0.0
    # a generation prompt that opens the block (Qwen3-Thinking's): the reply starts inside the reasoning
    opened = Rollout(id="o", step=0, task_id="t", group_id="g", sample_index=0, harness="h",
                     calls=[call("abcd</think>done", False)])
    prompts = {1: "<|im_start|>assistant\n<think>\n"}
    assert output_shares([opened], ("<think>", "</think>"))["reasoning_share"] == 0.0  # no decode: not seen
    shares = output_shares([opened], ("<think>", "</think>"), lambda ids: "".join(prompts[i] for i in ids))
    assert shares["reasoning_share"] == pytest.approx(4 / len("abcd</think>done"))

    # per evaluation, from summary.json and the step rows; an evaluation covering under half the cohort is flagged
    Store(tmp_path / "store.sqlite").add_step(3, {"eval/heldout/pass_at_1": 0.2, "eval/heldout/cohort_coverage": 0.4,
                                                  "eval/heldout/h/behaviour/reasoning_share": 0.3})
    before = {"eval/heldout/pass_at_1": 0.1, "eval/heldout/cohort_coverage": 1.0,
              "eval/heldout/h/behaviour/reasoning_share": 0.1, "eval/heldout/h/behaviour/tool_call_share": 0.9}
    (tmp_path / "summary.json").write_text(json.dumps({"before_rl": before, "after_rl": before, "steps": 8}))
    c = evaluation_shares(RunDB(tmp_path))
    assert c["x"] == [0, 4, 8] and c["flagged"] == [4]
    series = {s["name"]: s["values"] for s in c["series"]}
    assert series["reasoning share · h"] == [0.1, 0.3, 0.1] and "under half" in c["title"]
