"""Why rollouts failed: one kind per rollout, from its outcome, its calls, its diff and the gold patch."""

from __future__ import annotations

import json

from legorl.monitor.failures import KINDS, diff_paths, failure_kind, failure_shares
from legorl.records import GraderReport, LLMCall, Outcome, Rollout, ToolCall
from legorl.tasks import generate_tasks

TASK = generate_tasks(["wrong_operator"], 1, seed=3, split="heldout")[0]
GOLD = sorted(diff_paths(TASK.patch))
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def _diff(path: str) -> str:
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-x\n+y\n"


def rollout(outcome: Outcome, commands: list[str | None], diff: str = "", tests_pass: bool = False) -> Rollout:
    calls = []
    for i, cmd in enumerate(commands):
        tcs = [ToolCall(id=f"c{i}", name="bash", arguments=json.dumps({"command": cmd}))] if cmd else []
        calls.append(LLMCall(rollout_id="r", index=i, wire_format="openai_chat",
                             request={"messages": [{"role": "user", "content": "fix"}], "tools": TOOLS},
                             prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1], finish_reason="stop",
                             weight_version=0, completion_text="```python\nfix\n```" if cmd is None else "",
                             tool_calls=tcs))
    report = GraderReport(resolved=tests_pass, outcome=Outcome.RESOLVED if tests_pass else Outcome.UNRESOLVED)
    return Rollout(id="r", step=0, task_id=TASK.instance_id, group_id="g", sample_index=0, harness="mini-swe-agent",
                   outcome=outcome, diff=diff, report=report, calls=calls)


def test_each_kind_is_told_apart() -> None:
    assert GOLD and all(p.startswith("pkg_") for p in GOLD)
    edit = "sed -i s/a/b/ f.py"
    cases = {
        "resolved": rollout(Outcome.RESOLVED, [edit], _diff(GOLD[0]), tests_pass=True),
        "error": rollout(Outcome.SANDBOX_ERROR, [edit], _diff(GOLD[0])),
        "format": rollout(Outcome.UNRESOLVED, [None, None]),  # prose and code fences, never a tool call
        "no_edit": rollout(Outcome.MAX_TURNS, ["ls", "cat README.md"]),
        "fixed_unsubmitted": rollout(Outcome.MAX_TURNS, [edit], _diff(GOLD[0]), tests_pass=True),
        "wrong_file": rollout(Outcome.UNRESOLVED, [edit], _diff("tests/test_x.py") + _diff("notes.txt")),
        "wrong_fix": rollout(Outcome.UNRESOLVED, [edit], _diff("scratch.py") + _diff(GOLD[0])),
    }
    assert set(cases) == set(KINDS)
    assert {kind: failure_kind(r, TASK) for kind, r in cases.items()} == {k: k for k in cases}
    # without a gold patch a changed file cannot be called the wrong one
    assert failure_kind(cases["wrong_file"], TASK.model_copy(update={"patch": ""})) == "wrong_fix"


def test_shares_cover_every_kind() -> None:
    rs = [rollout(Outcome.UNRESOLVED, [None]), rollout(Outcome.UNRESOLVED, [None]),
          rollout(Outcome.RESOLVED, ["x"], _diff(GOLD[0]), tests_pass=True), rollout(Outcome.AGENT_CRASH, [])]
    shares = failure_shares((failure_kind(r, TASK) for r in rs), "eval/heldout/")
    assert shares == {"eval/heldout/failures/format": 0.5, "eval/heldout/failures/resolved": 0.25,
                      "eval/heldout/failures/error": 0.25, **{f"eval/heldout/failures/{k}": 0.0 for k in
                                                             ("no_edit", "fixed_unsubmitted", "wrong_file", "wrong_fix")}}
    assert failure_shares([], "p/") == {f"p/failures/{k}": 0.0 for k in KINDS}


def test_renamed_and_new_files_are_both_paths() -> None:
    d = "diff --git a/old.py b/new.py\nsimilarity index 90%\ndiff --git a/added.py b/added.py\nnew file mode 100644\n"
    assert diff_paths(d) == {"old.py", "new.py", "added.py"}


def test_text_mode_actions_are_its_bash_blocks() -> None:
    """mini-swe-agent's text mode declares no tool: a ```bash block is an action, prose around it is not."""
    def text_rollout(texts: list[str]) -> Rollout:
        r = rollout(Outcome.MAX_TURNS, [])
        r.calls = [LLMCall(rollout_id="r", index=i, wire_format="openai_chat",
                           request={"messages": [{"role": "user", "content": "fix"}]}, prompt_ids=[1],
                           completion_ids=[2], completion_logprobs=[-0.1], finish_reason="stop", weight_version=0,
                           completion_text=t) for i, t in enumerate(texts)]
        return r

    commented = text_rollout(["Let me look.\n```bash\n# This is a bug in the repository.\n```"] * 2)
    assert failure_kind(commented, TASK) == "no_edit"  # a valid action that changes nothing
    assert failure_kind(text_rollout(["The fix:\n```python\ndef f(): pass\n```"] * 2), TASK) == "format"
