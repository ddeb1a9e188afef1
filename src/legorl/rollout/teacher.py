"""Teacher episodes derived from a task's gold patch, for the scripted engine.

The script is what a careful agent would do in any harness with a shell tool: find the
function, read the file, edit the line with sed, run the tests, finish. Each turn
is reasoning text plus one tool call, in the exact text the chat template renders
for a tool call, so the recorded tokens are what the policy should learn to emit.
Each harness is played through its own shell tool (`TOOL_STYLES`): mini-swe-agent's
`bash`, Claude Code's `Bash`, Codex's `exec_command`; mini-swe-agent finishes with its
submit command, the CLIs with a reply that calls no tool.

Repository-snapshot tasks (mined by `legorl tasks synth`, SWE-bench rows) carry no inline
`files`: the script takes the file, the lines and the edit from the gold patch's headers and
hunks, reads the buggy file from the snapshot at `base_commit` where it needs its text, and
plays the fix with `sed` too: a one-line change as `s|old|new|`, a multi-line one (a dropped
branch restored) as line-addressed `c` / `a` / `d` commands, every hunk in one `sed -i`.
"""

from __future__ import annotations

import functools
import random
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from legorl.harness.base import ToolStyle
from legorl.models.tokenizer import render_tool_call_text
from legorl.tasks.repo import GIT_OPTS, git_env
from legorl.tasks.schema import Task

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
CHECK = " && git diff --stat"  # what an edit changed: one line per file, nothing when it missed
DONE = "Done. The bug is fixed."  # a CLI harness's last turn: text and no tool call ends its run


TOOL_STYLES = {
    "mini-swe-agent": ToolStyle("bash", "command", SUBMIT),
    "mini-swe-agent/text": ToolStyle("bash", "command", SUBMIT, text=True),
    "claude-code": ToolStyle("Bash", "command", None),
    "codex": ToolStyle("exec_command", "cmd", None),
    "opencode": ToolStyle("bash", "command", None),
    "openhands": ToolStyle("terminal", "command", None),
    "gemini-cli": ToolStyle("run_shell_command", "command", None, substitution=False),
    "qwen-code": ToolStyle("run_shell_command", "command", None),
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


@dataclass
class Block:
    """One contiguous change of a hunk, in the buggy file's line numbers."""

    start: int  # first removed line; for a pure insertion, the line it goes after (0: the top)
    removed: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)


@dataclass
class FileEdit:
    """What a gold patch changes in one file, and the window of the buggy file its hunks show."""

    path: str
    blocks: list[Block]
    first: int  # first and last line of the hunks' old side (context included)
    last: int


def gold_file_edits(patch: str) -> list[FileEdit]:
    """Every file a unified diff changes, with its change blocks (hunk headers give the line numbers)."""
    edits: list[FileEdit] = []
    block: Block | None = None
    at = 0
    for text in patch.splitlines():
        if text.startswith(("diff --git ", "--- ")):
            block = None
            continue
        if text.startswith("+++ "):
            path = text[4:].split("\t")[0]
            if path == "/dev/null":
                raise ValueError("the gold patch deletes a file; write a teacher script by hand")
            edits.append(FileEdit(path.removeprefix("b/"), [], 0, 0))
            continue
        if hunk := re.match(r"^@@ -(\d+)(?:,(\d+))? \+\d+(?:,\d+)? @@", text):
            if not edits:
                raise ValueError("a hunk before any file header in the gold patch")
            at, count = int(hunk.group(1)), int(hunk.group(2) or 1)
            if count == 0:  # `-N,0`: nothing of the old side shown; the insertion goes after line N
                at += 1
            edit = edits[-1]
            edit.first = edit.first or max(at, 1)
            edit.last = max(edit.last, at + count - 1)
            block = None
            continue
        if not edits or not at or text.startswith("\\"):  # `\ No newline at end of file`
            continue
        if text.startswith("-"):
            if block is None or block.added:
                block = Block(at)
                edits[-1].blocks.append(block)
            block.removed.append(text[1:])
            at += 1
        elif text.startswith("+"):
            if block is None:
                block = Block(at - 1)
                edits[-1].blocks.append(block)
            block.added.append(text[1:])
        else:  # context
            block = None
            at += 1
    edits = [e for e in edits if e.blocks]
    if not edits:
        raise ValueError("the gold patch changes nothing")
    return edits


@functools.lru_cache(maxsize=256)
def _snapshot_file(repo: str, commit: str, path: str) -> str:
    proc = subprocess.run(["git", *GIT_OPTS, "show", f"{commit}:{path}"], cwd=repo, env=git_env(Path(repo)),
                          capture_output=True, timeout=60, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise ValueError(f"cannot read {path} at {commit[:12]} in {repo}: {proc.stderr.decode(errors='replace')[-300:]}")
    return proc.stdout.decode("utf-8", errors="replace")


def buggy_source(task: Task, path: str) -> str:
    """The buggy file's text: the task's inline `files`, else the snapshot at `base_commit` (a git repo_path)."""
    if path in task.files:
        return task.files[path]
    if task.repo_path and (Path(task.repo_path) / ".git").exists() and task.base_commit:
        return _snapshot_file(str(Path(task.repo_path).resolve()), task.base_commit, path)
    raise ValueError(f"task {task.instance_id}: no inline {path} and no git snapshot to read it from")


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
    return _slipped(task.files.get(edit.path, ""), edit, path)


def _slipped(source: str, edit: LineEdit, path: str) -> str | None:
    old, new = minimal_replacement(source, edit.old, edit.new)
    if new in source or not new.strip():
        return None
    return _sed(f"s|{_sed_escape(new, False)}|{_sed_escape(old, True)}|", path)


def edited_line(task: Task, edit: LineEdit) -> int | None:
    """The line to address when the old text occurs on several lines, else None (plain sed is enough)."""
    hits = sum(edit.old.strip() in text for text in task.files.get(edit.path, "").splitlines())
    return edit.line if hits > 1 else None


def _turn(thought: str, command: str, style: ToolStyle = TOOL_STYLES["mini-swe-agent"]) -> str:
    if not style.substitution:
        command = piped(command)
    if style.text:
        return f"{thought}\n```bash\n{command}\n```"
    return f"{thought}\n{render_tool_call_text(style.tool, {style.arg: command})}"


# `CMD $(grep -rl ...)[ && CHECK]`: a command on the files a grep finds, perhaps followed by a check.
_FOUND_FILES = re.compile(r"^(?P<cmd>.+) \$\((?P<finder>grep -rl [^()]*)\)(?P<rest>( && .*)?)$", re.DOTALL)


def piped(command: str) -> str:
    """`CMD $(grep -rl ...)` as `grep -rl ... | xargs CMD`: the same command without command substitution."""
    m = _FOUND_FILES.match(command)
    return f"{m['finder']} | xargs {m['cmd']}{m['rest']}" if m else command


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


def _sed_text(lines: list[str]) -> str:
    """Text for sed's one-line `c`, `a`, `i` commands: lines joined by a backslash-n, backslashes doubled (GNU sed)."""
    return "\\n".join(line.replace("\\", "\\\\") for line in lines)


def block_script(block: Block) -> str:
    """The sed command that makes one change block, addressed by the buggy file's line numbers."""
    if not block.removed:
        return f"{block.start}a\\{_sed_text(block.added)}" if block.start else f"1i\\{_sed_text(block.added)}"
    where = f"{block.start},{block.start + len(block.removed) - 1}" if len(block.removed) > 1 else f"{block.start}"
    return f"{where}c\\{_sed_text(block.added)}" if block.added else f"{where}d"


def lines_sed_command(edit: FileEdit) -> str:
    """One `sed -i` making every block of a file edit: sed addresses input lines, so earlier blocks never
    shift later ones."""
    scripts = [block_script(b) for b in edit.blocks]
    if len(scripts) == 1:
        return _sed(scripts[0], edit.path)
    return "sed -i " + " ".join("-e '" + sc.replace("'", "'\\''") + "'" for sc in scripts) + f" {edit.path}"


def snapshot_script(task: Task, solve: bool, check_edits: bool, slip: bool, style: ToolStyle) -> list[str]:
    """Turns for a task without inline files: read the window the gold hunks show, make the edit, submit.

    The path comes from the gold patch, as a careful agent would have found it from the failing test.
    A one-line change in one file is a `s|old|new|` (line-addressed when the old text repeats), the same
    edit the built-in scripts teach; anything else is line-addressed `c` / `a` / `d`, so the read shows
    line numbers.
    """
    edits = gold_file_edits(task.patch)
    check = CHECK if check_edits else ""
    turns = [_turn("Let me read the code.", " && ".join(
        f"nl -ba {e.path} | sed -n '{max(1, e.first - 2)},{e.last + 2}p'" for e in edits), style)]
    if solve:
        one = edits[0] if len(edits) == 1 else None
        block = one.blocks[0] if one and len(one.blocks) == 1 else None
        fixes: list[str] = []
        missed = None
        if one and block and len(block.removed) == 1 and len(block.added) == 1:
            source = buggy_source(task, one.path)
            line_edit = LineEdit(one.path, block.removed[0], block.added[0], block.start)
            repeats = sum(line_edit.old.strip() in text for text in source.splitlines()) > 1
            fixes.append(sed_command(line_edit, block.start if repeats else None, source, one.path))
            if slip and check_edits and not repeats:
                missed = _slipped(source, line_edit, one.path)
        else:
            fixes = [lines_sed_command(e) for e in edits]
        if missed:
            turns.append(Slip(_turn("This line is wrong. Let me fix it.", missed + check, style)))
            turns.append(_turn("That changed nothing. Let me fix it again.", fixes[0] + check, style))
        else:
            turns += [_turn("This is wrong. Let me fix it.", fix + check, style) for fix in fixes]
    turns.append(_turn("Done. Let me submit.", style.submit, style) if style.submit else DONE)
    return turns


def teacher_script(task: Task, solve: bool = True, run_tests: bool = False, check_edits: bool = False,
                   slip: bool = False, harness: str | ToolStyle = "mini-swe-agent") -> list[str]:
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
    harness: whose shell tool the turns call and how the episode ends (a key of `TOOL_STYLES`, or the style
    itself: `harness.name: command` names its agent's shell tool).
    """
    style = harness if isinstance(harness, ToolStyle) else TOOL_STYLES[harness]
    if not task.files:  # a repository snapshot: everything comes from the gold patch
        return snapshot_script(task, solve, check_edits, slip, style)
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


def scripted_teacher(check_edits: bool = False, recovery: float = 0.0) -> Callable[[Task, str | ToolStyle], list[str]]:
    """The script the scripted engine plays per (task, harness); a `recovery` share of tasks (by id) slip first."""
    def script(task: Task, harness: str | ToolStyle = "mini-swe-agent") -> list[str]:
        slip = recovery > 0 and random.Random(f"slip:{task.instance_id}").random() < recovery
        return teacher_script(task, check_edits=check_edits, slip=slip, harness=harness)
    return script
