"""Teacher episodes derived from a task's gold patch, for the scripted engine.

The script is what a careful agent would do in any bash-tool harness: find the
function, read the file, edit the line with sed, run the tests, submit. Each turn
is reasoning text plus one tool call, in the exact text the chat template renders
for a tool call, so the recorded tokens are what the policy should learn to emit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from legorl.models.tokenizer import render_tool_call_text
from legorl.tasks.schema import Task

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


@dataclass
class LineEdit:
    path: str
    old: str
    new: str


def gold_line_edit(patch: str) -> LineEdit:
    """The single-line replacement a one-line gold patch makes."""
    path = re.search(r"^\+\+\+ b/(.+)$", patch, re.MULTILINE)
    removed = [line[1:] for line in patch.splitlines() if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in patch.splitlines() if line.startswith("+") and not line.startswith("+++")]
    if path is None or len(removed) != 1 or len(added) != 1:
        raise ValueError("the gold patch is not a one-line change in one file; write a teacher script by hand")
    return LineEdit(path.group(1), removed[0], added[0])


def _sed_escape(text: str, replacement: bool) -> str:
    special = r"\|&" if replacement else r"\|.[]*^$"
    return "".join("\\" + ch if ch in special else ch for ch in text)


def sed_command(edit: LineEdit) -> str:
    old, new = _sed_escape(edit.old.strip(), False), _sed_escape(edit.new.strip(), True)
    script = f"s|{old}|{new}|"
    return "sed -i '" + script.replace("'", "'\\''") + f"' {edit.path}"


def _turn(thought: str, command: str) -> str:
    return f"{thought}\n{render_tool_call_text('bash', {'command': command})}"


def function_name(task: Task, edit: LineEdit) -> str:
    """The function the bug is in: the last `def` above the edited line in the buggy file."""
    source = task.files.get(edit.path, "")
    before = source[: source.find(edit.old)] if edit.old in source else source
    names = re.findall(r"^\s*def (\w+)", before, re.MULTILINE)
    return names[-1] if names else edit.path.rsplit("/", 1)[-1].removesuffix(".py")


def teacher_script(task: Task, solve: bool = True) -> list[str]:
    """Assistant turns for one episode. solve=False reads and submits without fixing."""
    edit = gold_line_edit(task.patch)
    turns = [
        _turn("Let me find the function.", f"grep -rn 'def {function_name(task, edit)}' ."),
        _turn("Let me read the file.", f"cat {edit.path}"),
    ]
    if solve:
        turns.append(_turn("This line is wrong. Let me fix it.", sed_command(edit)))
        turns.append(_turn("Let me run the tests.", "python -m pytest -q"))
    turns.append(_turn("Done. Let me submit.", SUBMIT))
    return turns
