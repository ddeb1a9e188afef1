"""Teacher scripts derived from gold patches: the sed edit reproduces the gold fix exactly."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from legorl.tasks import builtin_splits
from legorl.tasks.teacher import gold_line_edit, teacher_script

TASKS = builtin_splits(48, 0, seed=3)[0]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: t.instance_id)
def test_teacher_sed_turns_buggy_file_into_fixed_file(task, tmp_path):
    edit = gold_line_edit(task.patch)
    for path, text in task.files.items():  # the whole repo: the command finds the file itself
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    target = tmp_path / edit.path
    sed = next(json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", t, re.DOTALL).group(1))["arguments"]["command"]
               for t in teacher_script(task) if "sed -i" in t)
    subprocess.run(["bash", "-c", sed], cwd=tmp_path, check=True)
    gold = tmp_path / "gold"
    (gold / edit.path).parent.mkdir(parents=True)
    (gold / edit.path).write_text(task.files[edit.path])
    subprocess.run(["git", "apply", "-"], input=task.patch, text=True, cwd=gold, check=True)
    assert target.read_text() == (gold / edit.path).read_text()


def test_teacher_finds_the_file_without_the_function_name_when_it_is_the_only_source():
    from legorl.tasks.teacher import SOURCES

    for task in TASKS:  # built-in repos: one module with functions, tests under tests/
        assert all(SOURCES in t for t in teacher_script(task)[:2]), teacher_script(task)


def test_teacher_quotes_a_script_with_single_quotes_in_double_quotes():
    """`s|'min'|'h': 3600, 'min'|` in single quotes would need `'\\''` around every key."""
    missing = [t for t in TASKS if "missing_case" in t.instance_id]
    assert missing
    for task in missing:
        fix = teacher_script(task)[1]
        assert 'sed -i \\"s|' in fix and "'\\\\''" not in fix, fix
