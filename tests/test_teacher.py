"""Teacher scripts derived from gold patches: the sed edit reproduces the gold fix exactly."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from legorl.rollout.teacher import CHECK, Slip, gold_line_edit, scripted_teacher, teacher_script
from legorl.tasks import builtin_splits

TASKS = builtin_splits(48, 0, seed=3)[0]


@pytest.mark.parametrize("harness", ["mini-swe-agent", "gemini-cli"])  # gemini-cli: no $(...), piped to xargs
@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.instance_id)
def test_teacher_sed_turns_buggy_file_into_fixed_file(task, harness, tmp_path):
    edit = gold_line_edit(task.patch)
    for path, text in task.files.items():  # the whole repo: the command finds the file itself
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    target = tmp_path / edit.path
    sed = next(json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", t, re.DOTALL).group(1))["arguments"]["command"]
               for t in teacher_script(task, harness=harness) if "sed -i" in t)
    assert ("$(" in sed) == (harness == "mini-swe-agent")
    subprocess.run(["bash", "-c", sed], cwd=tmp_path, check=True)
    gold = tmp_path / "gold"
    (gold / edit.path).parent.mkdir(parents=True)
    (gold / edit.path).write_text(task.files[edit.path])
    subprocess.run(["git", "apply", "-"], input=task.patch, text=True, cwd=gold, check=True)
    assert target.read_text() == (gold / edit.path).read_text()


def test_teacher_finds_the_file_without_the_function_name_when_it_is_the_only_source():
    from legorl.rollout.teacher import SOURCES

    for task in TASKS:  # built-in repos: one module with functions, tests under tests/
        assert all(SOURCES in t for t in teacher_script(task)[:2]), teacher_script(task)


def test_teacher_quotes_a_script_with_single_quotes_in_double_quotes():
    """`s|'min'|'h': 3600, 'min'|` in single quotes would need `'\\''` around every key."""
    missing = [t for t in TASKS if "missing_case" in t.instance_id]
    assert missing
    for task in missing:
        fix = teacher_script(task)[1]
        assert 'sed -i \\"s|' in fix and "'\\\\''" not in fix, fix


def _command(turn: str) -> str:
    return json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", turn, re.DOTALL).group(1))["arguments"]["command"]


def test_a_recovery_demonstration_slips_sees_no_change_and_then_fixes(tmp_path):
    """The slip's sed changes nothing (its check prints nothing); the redo makes the gold fix and says so."""
    slipping = [t for t in TASKS if any(isinstance(turn, Slip) for turn in teacher_script(t, check_edits=True, slip=True))]
    assert len(slipping) >= len(TASKS) // 2, "most built-in tasks have an edit that can be written backwards"
    for i, task in enumerate(slipping[:8]):
        repo = tmp_path / str(i)
        for path, text in task.files.items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(text)
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
        subprocess.run(git + ["add", "-A"], cwd=repo, check=True)
        subprocess.run(git + ["commit", "-qm", "buggy"], cwd=repo, check=True)
        _read, slip, redo, _submit = teacher_script(task, check_edits=True, slip=True)
        assert isinstance(slip, Slip) and not isinstance(redo, Slip)
        assert _command(slip).endswith(CHECK) and _command(redo).endswith(CHECK)
        assert subprocess.run(["bash", "-c", _command(slip)], cwd=repo, capture_output=True, text=True,
                              check=True).stdout == ""
        out = subprocess.run(["bash", "-c", _command(redo)], cwd=repo, capture_output=True, text=True, check=True).stdout
        assert "1 file changed" in out, out
        edit = gold_line_edit(task.patch)
        fixed = subprocess.run(["git", "apply", "--cached", "-"], input=task.patch, text=True, cwd=repo, check=False)
        assert fixed.returncode == 0
        gold = subprocess.run(["git", "show", f":{edit.path}"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout
        assert (repo / edit.path).read_text() == gold


def test_scripted_teacher_slips_on_the_requested_share_of_tasks():
    tasks = builtin_splits(400, 0, seed=5)[0]
    assert not any(isinstance(turn, Slip) for t in tasks for turn in scripted_teacher(check_edits=True)(t))
    script = scripted_teacher(check_edits=True, recovery=0.5)
    share = sum(any(isinstance(turn, Slip) for turn in script(t)) for t in tasks) / len(tasks)
    slippable = sum(any(isinstance(turn, Slip) for turn in teacher_script(t, check_edits=True, slip=True))
                    for t in tasks) / len(tasks)
    assert 0.35 * slippable < share < 0.65 * slippable
    assert script(tasks[0]) == script(tasks[0])  # drawn by task id: the same on every call and resume
