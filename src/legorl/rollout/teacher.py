"""Teacher episodes derived from a task's gold patch, for the scripted engine.

The script is what a careful agent would do in any harness with a shell tool: find the
function, read the file, edit the line with sed, run the tests, finish. Each turn
is reasoning text plus one tool call, in the exact text the chat template renders
for a tool call, so the recorded tokens are what the policy should learn to emit.
Each harness is played through its own shell tool (`TOOL_STYLES`): mini-swe-agent's
`bash`, Claude Code's `Bash`, Codex's `exec_command`; mini-swe-agent finishes with its
submit command, the CLIs with a reply that calls no tool.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from legorl.models.tokenizer import render_tool_call_text
from legorl.tasks.schema import Task

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
CHECK = " && git diff --stat"  # what an edit changed: one line per file, nothing when it missed
DONE = "Done. The bug is fixed."  # a CLI harness's last turn: text and no tool call ends its run


@dataclass(frozen=True)
class ToolStyle:
    """How a harness takes a shell command, and how its episode ends."""

    tool: str  # the shell tool the harness declares
    arg: str  # its command argument
    submit: str | None  # the command that submits; None: a reply without a tool call ends the episode


TOOL_STYLES = {
    "mini-swe-agent": ToolStyle("bash", "command", SUBMIT),
    "claude-code": ToolStyle("Bash", "command", None),
    "codex": ToolStyle("exec_command", "cmd", None),
}


class Slip(str):
    """A teacher turn that shows a mistake to recover from: played to the harness, never trained on."""


@dataclass
class LineEdit:
    path: str
    old: str
    new: str
    line: int  # 1-based line of `old` in the buggy file


def gold_line_edit(patch: str) -> LineEdit:
    """The single-line replacement a one-line gold patch makes, with its line number."""
    path = re.search(r"^\+\+\+ b/(.+)$", patch, re.MULTILINE)
    removed, added, line, at = [], [], 0, 0
    for text in patch.splitlines():
        if hunk := re.match(r"^@@ -(\d+)", text):
            at = int(hunk.group(1))
        elif text.startswith("-") and not text.startswith("---"):
            removed.append(text[1:])
            line = at
            at += 1
        elif text.startswith("+") and not text.startswith("+++"):
            added.append(text[1:])
        elif at:
            at += 1
    if path is None or len(removed) != 1 or len(added) != 1:
        raise ValueError("the gold patch is not a one-line change in one file; write a teacher script by hand")
    return LineEdit(path.group(1), removed[0], added[0], line)


# What bash still interprets inside double quotes: `"$`, a backslash before another backslash or at
# the end (`\.` and `\[` pass through unchanged), and history expansion's `!`, to be safe.
_DOUBLE_QUOTE_SPECIAL = re.compile(r'["$`!]|\\\\|\\$')


def _sed_escape(text: str, replacement: bool) -> str:
    special = r"\|&" if replacement else r"\|.[]*^$"
    return "".join("\\" + ch if ch in special else ch for ch in text)


def minimal_replacement(source: str, old: str, new: str) -> tuple[str, str]:
    """The shortest whole-word span of `old` that changes and occurs once in `source`, with its new text.

    `return [v for v in values if v > limit]` -> `v <= limit` becomes `s|v > limit|v <= limit|`:
    less to copy for the model, and nothing to escape.
    """
    p = 0
    while p < min(len(old), len(new)) and old[p] == new[p]:
        p += 1
    q = 0
    while q < min(len(old), len(new)) - p and old[-1 - q] == new[-1 - q]:
        q += 1
    start, end = p, len(old) - q
    boundary = " ([{,"

    def grow() -> bool:
        nonlocal start, end
        grown = False
        while start > 0 and old[start - 1] not in boundary:
            start, grown = start - 1, True
        while end < len(old) and old[end] not in " )]},:":
            end, grown = end + 1, True
        return grown

    grow()
    while source.count(old[start:end]) != 1 and (start > 0 or end < len(old)):
        start, end = max(0, start - 1), min(len(old), end + 1)
        grow()
    return old[start:end], new[start: len(new) - (len(old) - end)]


def sed_command(edit: LineEdit, line: int | None = None, source: str = "", path: str = "") -> str:
    """`sed -i 's|old|new|' PATH` (the edit's path unless given), one line addressed if the old text repeats."""
    old, new = edit.old.strip(), edit.new.strip()
    if source and not line:
        old, new = minimal_replacement(source, edit.old, edit.new)
    return _sed(f"{line or ''}s|{_sed_escape(old, False)}|{_sed_escape(new, True)}|", path or edit.path)


def _sed(script: str, path: str) -> str:
    if "'" in script and not _DOUBLE_QUOTE_SPECIAL.search(script):
        # `s|'min'|'h': 3600, 'min'|` reads as it is in double quotes; in single quotes each ' becomes
        # '\'' -- four times the characters for the small model to copy exactly.
        return f'sed -i "{script}" {path}'
    return "sed -i '" + script.replace("'", "'\\''") + f"' {path}"


def slipped_sed(task: Task, edit: LineEdit, path: str) -> str | None:
    """The fix written backwards (`s|new|old|`), when that changes nothing in the buggy file, else None.

    It is the kind of slip the small policy makes most: a pattern that is not in the file, so sed
    succeeds and nothing changes.
    """
    source = task.files.get(edit.path, "")
    old, new = minimal_replacement(source, edit.old, edit.new)
    if new in source or not new.strip():
        return None
    return _sed(f"s|{_sed_escape(new, False)}|{_sed_escape(old, True)}|", path)


def edited_line(task: Task, edit: LineEdit) -> int | None:
    """The line to address when the old text occurs on several lines, else None (plain sed is enough)."""
    hits = sum(edit.old.strip() in text for text in task.files.get(edit.path, "").splitlines())
    return edit.line if hits > 1 else None


def _turn(thought: str, command: str, style: ToolStyle = TOOL_STYLES["mini-swe-agent"]) -> str:
    return f"{thought}\n{render_tool_call_text(style.tool, {style.arg: command})}"


def function_name(task: Task, edit: LineEdit) -> str:
    """The function the bug is in: the last `def` above the edited line in the buggy file."""
    source = task.files.get(edit.path, "")
    before = source[: source.find(edit.old)] if edit.old in source else source
    names = re.findall(r"^\s*def (\w+)", before, re.MULTILINE)
    return names[-1] if names else edit.path.rsplit("/", 1)[-1].removesuffix(".py")


SOURCES = "$(grep -rl 'def ' --include='*.py' --exclude-dir=tests .)"


def source_files(task: Task) -> list[str]:
    """What `SOURCES` finds in the task's repo: Python files outside tests/ that define a function."""
    return sorted(path for path, text in task.files.items()
                  if path.endswith(".py") and "tests" not in path.split("/")[:-1] and "def " in text)


def teacher_script(task: Task, solve: bool = True, run_tests: bool = False, check_edits: bool = False,
                   slip: bool = False, harness: str = "mini-swe-agent") -> list[str]:
    """Assistant turns for one episode: read the function's file, fix the line, submit.

    The file is found inside each command, so the agent never copies a path out of earlier output:
    `grep -rl 'def ' --include='*.py' --exclude-dir=tests .` (every source file with a function)
    when that finds only the buggy file, as in the built-in repos, else `grep -rl 'def NAME' .`.
    The small embedded model learns either from a few hundred episodes; the first does not ask
    it to copy an identifier out of the problem statement.
    solve=False reads and submits without fixing. run_tests adds a `pytest` turn before submitting
    (off by default: its output makes episodes much longer for the small embedded model).
    check_edits ends each edit with `&& git diff --stat`, so the episode shows whether it changed
    anything. slip (with check_edits) first makes an edit that changes nothing, as a `Slip` turn,
    then sees the empty check and makes the right edit: a recovery the policy can learn to repeat.
    harness: whose shell tool the turns call and how the episode ends (`TOOL_STYLES`).
    """
    style = TOOL_STYLES[harness]
    edit = gold_line_edit(task.patch)
    line = edited_line(task, edit)
    where = SOURCES if source_files(task) == [edit.path] else f"$(grep -rl 'def {function_name(task, edit)}' .)"
    read = f"nl -ba {where}" if line else f"cat {where}"  # line numbers when the fix needs one
    check = CHECK if check_edits else ""
    turns = [_turn("Let me read the function.", read, style)]
    if solve:
        fix = sed_command(edit, line, task.files.get(edit.path, ""), where)
        missed = slipped_sed(task, edit, where) if slip and check_edits and not line else None
        if missed:
            turns.append(Slip(_turn("This line is wrong. Let me fix it.", missed + check, style)))
            turns.append(_turn("That changed nothing. Let me fix it again.", fix + check, style))
        else:
            turns.append(_turn("This line is wrong. Let me fix it.", fix + check, style))
        if run_tests:
            turns.append(_turn("Let me run the tests.", "python -m pytest -q", style))
    turns.append(_turn("Done. Let me submit.", style.submit, style) if style.submit else DONE)
    return turns


def scripted_teacher(check_edits: bool = False, recovery: float = 0.0) -> Callable[[Task, str], list[str]]:
    """The script the scripted engine plays per (task, harness); a `recovery` share of tasks (by id) slip first."""
    def script(task: Task, harness: str = "mini-swe-agent") -> list[str]:
        slip = recovery > 0 and random.Random(f"slip:{task.instance_id}").random() < recovery
        return teacher_script(task, check_edits=check_edits, slip=slip, harness=harness)
    return script
