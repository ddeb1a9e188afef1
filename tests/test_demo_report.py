"""The teacher's demonstrations in words (`legorl.rollout.demo_report`): resolved of total, the commonest reasons
for the rest, and a teacher calling a tool, or an argument, the agent's own requests do not declare, read from
the request as each of the four wire formats carries its tools."""

from __future__ import annotations

import json

import pytest

from legorl.records import LLMCall, Outcome, Rollout, ToolCall
from legorl.rollout.demo_report import declared_tools, demo_report, undeclared_calls

SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}}
REQUESTS = {  # the same single `bash` tool in each wire format (a case name, then its wire format's name)
    "openai_chat": {"tools": [{"type": "function", "function": {"name": "bash", "parameters": SCHEMA}}]},
    "openai_responses": {"tools": [{"type": "function", "name": "bash", "parameters": SCHEMA}]},
    "anthropic_messages": {"tools": [{"name": "bash", "input_schema": SCHEMA}]},
    "gemini": {"tools": [{"functionDeclarations": [{"name": "bash", "parameters": SCHEMA}]}]},
    "gemini_snake_json_schema": {"tools": [{"function_declarations": [{"name": "bash",
                                                                       "parametersJsonSchema": SCHEMA}]}]},
}


def call_with(request: dict, wire_format: str = "openai_chat", tool_calls: list[ToolCall] | None = None,
              index: int = 0) -> LLMCall:
    return LLMCall(rollout_id="r", index=index, wire_format=wire_format, request=request, prompt_ids=[1],
                   completion_ids=[2], completion_logprobs=[0.0], finish_reason="stop", weight_version=0,
                   completion_text="", tool_calls=tool_calls or [])


@pytest.mark.parametrize("case", list(REQUESTS))
def test_the_declared_tools_are_read_from_every_wire_format(case) -> None:
    wire_format = case.removesuffix("_snake_json_schema")
    assert declared_tools(call_with(REQUESTS[case], wire_format)) == {"bash": {"command"}}


def test_a_request_without_tools_declares_none() -> None:
    assert declared_tools(call_with({"messages": []})) == {}
    assert declared_tools(call_with({"tools": ["junk", {"type": "web_search"}]})) == {}


def demo(outcome: Outcome, reason: str = "", calls: tuple[tuple[str, dict], ...] = (),
         request: dict | None = None) -> Rollout:
    llm_calls = [call_with(REQUESTS["openai_chat"] if request is None else request, index=i,
                           tool_calls=[ToolCall(id=f"c{i}", name=name, arguments=json.dumps(args))])
                 for i, (name, args) in enumerate(calls)]
    return Rollout(id="r", step=-1, task_id="t", group_id="g", sample_index=0, harness="command", outcome=outcome,
                   outcome_reason=reason, calls=llm_calls, split="demo")


def test_it_counts_the_resolved_and_names_the_commonest_reasons_for_the_rest() -> None:
    demos = ([demo(Outcome.RESOLVED, calls=(("bash", {"command": "cat a.py"}),))] * 3
             + [demo(Outcome.UNRESOLVED, "empty patch: the agent changed nothing")] * 2
             + [demo(Outcome.AGENT_CRASH, "harness.command exited with 2: " + "x" * 500)])
    text = demo_report(demos)
    assert text.startswith("teacher demonstrations: 3 of 6 resolved; not resolved: ")
    assert "2 x unresolved: empty patch: the agent changed nothing; 1 x agent_crash: harness.command exited" in text
    assert "x" * 200 not in text  # a long reason is cut
    assert "shell_tool" not in text  # every teacher call was declared
    assert demo_report(demos[:3]) == "teacher demonstrations: 3 of 3 resolved"


def test_a_teacher_calling_a_tool_or_an_argument_the_agent_lacks_is_named_with_the_fix() -> None:
    wrong_tool = demo(Outcome.UNRESOLVED, "empty patch", calls=(("shell", {"cmd": "cat a.py"}),) * 2)
    wrong_arg = demo(Outcome.UNRESOLVED, "empty patch", calls=(("bash", {"cmd": "cat a.py"}),))
    no_tools = demo(Outcome.UNRESOLVED, "empty patch", calls=(("shell", {"cmd": "x"}),), request={"messages": []})
    assert undeclared_calls([wrong_tool, wrong_arg, no_tools]) == [
        "the teacher called the tool `shell`, which the agent does not declare (its tools: bash)",
        "the teacher called `bash` with the argument `cmd`, which that tool does not declare (its arguments: command)",
    ]  # each once, in order; a request without tools (a side call) checks nothing
    text = demo_report([wrong_tool])
    assert "0 of 1 resolved" in text and "`shell`" in text and "harness.shell_tool and harness.shell_arg" in text
    upstream = demo_report([wrong_tool], scripted=False)  # a model's own wrong call: no config to fix
    assert "`shell`" in upstream and "shell_tool" not in upstream


def test_an_upstream_teachers_many_wrong_calls_are_shown_a_few() -> None:
    wrong = demo(Outcome.UNRESOLVED, "empty patch", calls=tuple((f"tool{i}", {"command": "x"}) for i in range(5)))
    text = demo_report([wrong], scripted=False)
    assert "`tool0`" in text and "`tool2`" in text and "`tool3`" not in text and "(and 2 more)" in text
