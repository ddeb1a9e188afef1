"""The scripted teacher on repository-snapshot tasks (no inline `files`): the file, lines and edit come
from the gold patch, one-line and multi-line fixes alike, and a demonstration through mini-swe-agent's
own shell tool resolves when graded. Tasks are mined on the spot from a tiny local package."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import run_mini_episode

from legorl.config import HarnessConfig
from legorl.records import Outcome
from legorl.rollout.teacher import CHECK, Slip, gold_file_edits, teacher_script
from legorl.tasks.loaders import load_jsonl
from legorl.tasks.repo import GIT_OPTS, git_env
from legorl.tasks.synth import SynthConfig, synthesize_package, write_rows
from legorl.tasks.synth_runner import Runner

PKG = {
    "pyproject.toml": '[project]\nname = "shapes"\nversion = "1.0"\n',
    "shapes/__init__.py": textwrap.dedent("""\
        def clamp(x, lo, hi):
            if x < lo:
                return lo
            if x > hi:
                return hi
            return x


        def sign(x):
            if x > 0:
                out = 1
            else:
                out = -1 if x else 0
            return out
        """),
    "tests/test_shapes.py": textwrap.dedent("""\
        from shapes import clamp, sign


        def test_clamp_below():
            assert clamp(-3, 0, 9) == 0


        def test_clamp_above():
            assert clamp(12, 0, 9) == 9


        def test_clamp_inside():
            assert clamp(4, 0, 9) == 4


        def test_sign():
            assert [sign(-2), sign(0), sign(5)] == [-1, 0, 1]
        """),
}


@pytest.fixture(scope="module")
def mined(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("teach-snap")
    pkg = base / "shapes-src"
    for rel, text in PKG.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    out = base / "out"
    res = synthesize_package(str(pkg), out, SynthConfig(n=6, seed=1, max_attempts=30), runner=Runner(),
                             cache=base / "cache")  # fmt: skip
    assert not res.error, res.error
    write_rows(out, [res])
    tasks = load_jsonl(out / "tasks.jsonl")
    assert all(not t.files for t in tasks)  # snapshot tasks: the repo is a git dir, nothing inline
    return tasks


def _changed_lines(patch: str) -> int:
    return sum(1 for ln in patch.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---")))


def _commands(turns: list[str]) -> list[str]:
    return [json.loads(re.search(r"<tool_call>\n(.*)\n</tool_call>", t, re.DOTALL).group(1))["arguments"]["command"]
            for t in turns if "<tool_call>" in t]  # fmt: skip


def _checkout(task, dest: Path) -> Path:
    subprocess.run(["git", *GIT_OPTS, "clone", "-q", "--no-checkout", task.repo_path, str(dest)], check=True,
                   env=git_env())  # fmt: skip
    subprocess.run(["git", *GIT_OPTS, "-C", str(dest), "checkout", "-q", task.base_commit], check=True, env=git_env())
    return dest


def _diff(repo: Path) -> str:
    return subprocess.run(["git", *GIT_OPTS, "-C", str(repo), "diff"], capture_output=True, text=True, check=True,
                          env=git_env()).stdout  # fmt: skip


def test_gold_file_edits_reads_blocks_and_line_numbers() -> None:
    patch = textwrap.dedent("""\
        diff --git a/p/m.py b/p/m.py
        --- a/p/m.py
        +++ b/p/m.py
        @@ -10,5 +10,7 @@ def f(x):
             a = 1
        -    pass
        +    if x:
        +        return x
             b = 2
        +    c = 3
             return b
        -    # gone
        """)
    (edit,) = gold_file_edits(patch)
    assert edit.path == "p/m.py" and (edit.first, edit.last) == (10, 14)
    assert [(b.start, b.removed, b.added) for b in edit.blocks] == [
        (11, ["    pass"], ["    if x:", "        return x"]), (12, [], ["    c = 3"]), (14, ["    # gone"], [])]
    with pytest.raises(ValueError, match="changes nothing"):
        gold_file_edits("diff --git a/x b/x\n")


@pytest.mark.parametrize("check_edits", [False, True])
def test_teacher_commands_turn_the_snapshot_into_the_gold_fix(mined, tmp_path: Path, check_edits: bool) -> None:
    """Every mined task, one-line and multi-line (a restored branch): the teacher's shell commands on the
    buggy checkout give exactly the tree the gold patch gives, slips included."""
    assert any(_changed_lines(t.patch) > 2 for t in mined), "a multi-line gold patch (drop_branch) was mined"
    assert any(_changed_lines(t.patch) == 2 for t in mined)
    for i, task in enumerate(mined):
        turns = teacher_script(task, check_edits=check_edits, slip=check_edits)
        cmds = _commands(turns)
        assert cmds[-1] == "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and "nl -ba " in cmds[0]
        assert all(CHECK in c for c in cmds[1:-1]) == check_edits
        agent = _checkout(task, tmp_path / f"agent-{check_edits}-{i}")
        for c in cmds[:-1]:
            subprocess.run(["bash", "-c", c], cwd=agent, check=True, capture_output=True)
        gold = _checkout(task, tmp_path / f"gold-{check_edits}-{i}")
        subprocess.run(["git", "apply", "-"], input=task.patch, text=True, cwd=gold, check=True)
        assert _diff(agent) == _diff(gold) != "", (task.instance_id, cmds)
    slipped = [t for t in mined if any(isinstance(x, Slip) for x in teacher_script(t, check_edits=True, slip=True))]
    assert slipped, "a one-line fix can be written backwards first"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_teacher_demonstrations_of_snapshot_tasks_resolve_through_mini_swe_agent(mined, tokenizer,
                                                                                 tmp_path: Path) -> None:
    """Through mini-swe-agent's own bash tool, in a real sandbox, graded from pristine sources with the hidden
    tests: a one-line and a multi-line fix both resolve; the same episode without the fix does not."""
    one = next(t for t in mined if _changed_lines(t.patch) == 2)
    multi = next(t for t in mined if _changed_lines(t.patch) > 2)
    for i, (task, solve) in enumerate([(one, True), (multi, True), (multi, False)]):
        r = run_mini_episode(tokenizer, tmp_path / str(i), task, HarnessConfig(step_limit=8), label="t",
                             agent_timeout=120, grading_timeout=120,
                             script_for=lambda t, h, solve=solve: teacher_script(t, solve=solve, check_edits=True,
                                                                                 harness=h))  # fmt: skip
        if solve:
            assert r.outcome == Outcome.RESOLVED, (task.instance_id, r.outcome_reason, r.report)
            assert r.reward == 1.0 and r.report.tests and all(v == "passed" for v in r.report.tests.values())
        else:
            assert r.outcome == Outcome.UNRESOLVED and r.reward == 0.0
