"""Task schema, loaders, the built-in suite and orphan-commit repo preparation."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from legorl.tasks import (
    FAMILIES,
    Task,
    TaskError,
    assert_clean_history,
    builtin_splits,
    generate_tasks,
    load_jsonl,
    prepare_repo,
)
from legorl.tasks.builtin import HIDDEN_TEST_PATH
from legorl.tasks.repo import git


def test_generation_is_deterministic_by_seed() -> None:
    a = generate_tasks(None, 16, seed=3, split="train")
    b = generate_tasks(None, 16, seed=3, split="train")
    c = generate_tasks(None, 16, seed=4, split="train")
    assert [t.model_dump() for t in a] == [t.model_dump() for t in b]
    assert {t.instance_id for t in a}.isdisjoint({t.instance_id for t in c})
    assert {t.family for t in a} == set(FAMILIES) and len(FAMILIES) >= 8
    assert len({t.instance_id for t in a}) == 16


def test_splits_share_no_instance() -> None:
    train, heldout = builtin_splits(40, 24, seed=0)
    assert len(train) == 40 and len(heldout) == 24
    assert {t.instance_id for t in train}.isdisjoint({t.instance_id for t in heldout})
    contents = {json.dumps(t.files, sort_keys=True) for t in train}
    assert not any(json.dumps(t.files, sort_keys=True) in contents for t in heldout)
    assert {t.split for t in heldout} == {"heldout"}


def test_instances_are_small_and_well_formed() -> None:
    for task in generate_tasks(None, 8, seed=11, split="train"):
        assert HIDDEN_TEST_PATH not in task.files and HIDDEN_TEST_PATH in task.hidden_files
        assert task.FAIL_TO_PASS and task.PASS_TO_PASS
        assert all(t.startswith(f"{HIDDEN_TEST_PATH}::test_") for t in task.test_ids)
        assert (
            task.patch.startswith("diff --git a/") and task.patch.count("\n-") == task.patch.count("\n+") == 2
        )
        code = [p for p in task.files if p.endswith(".py") and not p.startswith("tests/")]
        assert all(len(task.files[p].splitlines()) <= 30 for p in code)


def test_gold_patch_fixes_and_hidden_tests_fail_before(tmp_path: Path) -> None:
    # Host-side sanity check of the generator (the grader does this in a sandbox).
    task = generate_tasks(["missing_case"], 1, seed=5, split="train")[0]
    repo = tmp_path / "r"
    prepare_repo(task, repo)
    (repo / HIDDEN_TEST_PATH).write_text(task.hidden_files[HIDDEN_TEST_PATH])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", HIDDEN_TEST_PATH]
    env = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"}
    before = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env=env, check=False)
    assert before.returncode == 1 and "1 failed" in before.stdout
    subprocess.run(["git", "apply", "-"], cwd=repo, input=task.patch, text=True, check=True)
    after = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, env=env, check=False)
    assert after.returncode == 0, after.stdout


def test_prepare_repo_one_orphan_commit_deterministic(tmp_path: Path) -> None:
    task = generate_tasks(None, 1, seed=2, split="train")[0]
    sha1 = prepare_repo(task, tmp_path / "a")
    sha2 = prepare_repo(task, tmp_path / "b")
    assert sha1 == sha2
    assert git(tmp_path / "a", "rev-list", "--all").split() == [sha1]
    assert not (tmp_path / "a" / HIDDEN_TEST_PATH).exists()
    assert HIDDEN_TEST_PATH not in git(tmp_path / "a", "ls-files")
    assert git(tmp_path / "a", "status", "--porcelain") == ""


def test_an_episodes_cached_copy_is_what_prepare_repo_writes(tmp_path: Path) -> None:
    # Episodes take their workspace from the pristine cache (grading/pool.py): the same files, the same one
    # orphan commit, a clean work tree, and a private copy each (one episode's edits never reach the next).
    from legorl.tasks.pristine import PristineCache
    from legorl.tasks.repo import assert_clean_history

    task = generate_tasks(None, 1, seed=3, split="train")[0]
    cache = PristineCache(size=2)
    sha = prepare_repo(task, tmp_path / "fresh")
    cache.copy(task, tmp_path / "one")
    (tmp_path / "one" / next(iter(task.files))).write_text("edited by an agent\n")
    cache.copy(task, tmp_path / "two")

    def tree(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                if p.is_file() and ".git" not in p.relative_to(root).parts}  # fmt: skip

    assert tree(tmp_path / "two") == tree(tmp_path / "fresh")
    assert git(tmp_path / "two", "rev-parse", "HEAD").strip() == sha
    assert git(tmp_path / "two", "status", "--porcelain") == ""
    assert_clean_history(tmp_path / "two")
    assert (tmp_path / "two").stat().st_uid == os.getuid()


def test_task_repo_git_never_reaches_the_repository_around_it(tmp_path: Path) -> None:
    """A run directory inside a project checkout (``runs/`` of a clone): when a cancelled grading's
    clean-up removes a task repo's .git mid-way, git must fail there, not commit to the project."""
    outer = tmp_path / "project"
    outer.mkdir()
    git(outer, "init", "-q")
    git(outer, "commit", "-q", "--allow-empty", "-m", "project")
    task = generate_tasks(None, 1, seed=2, split="train")[0]
    repo = outer / "runs" / "r" / "repo"
    prepare_repo(task, repo)
    shutil.rmtree(repo / ".git")
    with pytest.raises(TaskError, match="not a git repository"):
        git(repo, "commit", "-q", "--allow-empty", "-m", "stray")
    assert len(git(outer, "rev-list", "--all").split()) == 1
    assert git(outer, "diff", "--cached", "--name-only") == ""


def test_assert_clean_history_catches_leaks(tmp_path: Path) -> None:
    task = generate_tasks(None, 1, seed=2, split="train")[0]
    repo = tmp_path / "r"
    prepare_repo(task, repo)
    (repo / "fix.txt").write_text("the answer\n")
    git(repo, "add", "fix.txt")
    git(repo, "commit", "-q", "-m", "future")
    with pytest.raises(TaskError, match="exactly one commit"):
        assert_clean_history(repo)
    git(repo, "reset", "-q", "--hard", "HEAD~1")  # the future commit is now only unreachable
    with pytest.raises(TaskError, match="ORIG_HEAD"):
        assert_clean_history(repo)
    (repo / ".git" / "ORIG_HEAD").unlink()
    with pytest.raises(TaskError, match="unreachable"):
        assert_clean_history(repo)

    for leak in (["tag", "v1"], ["remote", "add", "origin", "/nowhere"]):
        other = tmp_path / f"o-{leak[0]}"
        prepare_repo(task, other)
        git(other, *leak)
        with pytest.raises(TaskError):
            assert_clean_history(other)


def test_prepare_repo_from_git_dir_and_tarball(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    git(src, "init", "-q")
    (src / "m.py").write_text("X = 1\n")
    git(src, "add", "-A")
    git(src, "commit", "-q", "-m", "one")
    base = git(src, "rev-parse", "HEAD").strip()
    (src / "m.py").write_text("X = 2  # the future fix\n")
    git(src, "commit", "-q", "-am", "two")
    task = Task(
        instance_id="local-1", repo="local/x", repo_path=str(src), base_commit=base, problem_statement="p"
    )
    prepare_repo(task, tmp_path / "from_git")
    assert (tmp_path / "from_git" / "m.py").read_text() == "X = 1\n"
    assert "future" not in git(tmp_path / "from_git", "log", "--all", "--format=%B")

    tarball = tmp_path / "proj.tar.gz"
    with tarfile.open(tarball, "w:gz") as tf:
        tf.add(src, arcname="proj-1.0")  # includes the source .git: must not survive
    task2 = task.model_copy(update={"repo_path": str(tarball), "base_commit": ""})
    prepare_repo(task2, tmp_path / "from_tar")
    assert (tmp_path / "from_tar" / "m.py").exists()
    assert_clean_history(tmp_path / "from_tar")


def test_load_jsonl_swebench_rows_and_errors(tmp_path: Path) -> None:
    good = {
        "instance_id": "o__r-1", "repo": "o/r", "base_commit": "abc", "problem_statement": "broken",
        "FAIL_TO_PASS": json.dumps(["tests/test_a.py::test_x"]), "PASS_TO_PASS": "[]", "version": "1.0",
    }  # fmt: skip
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "instance_id": "o__r-2"}) + "\n")
    tasks = load_jsonl(path)
    assert [t.instance_id for t in tasks] == ["o__r-1", "o__r-2"]
    assert tasks[0].FAIL_TO_PASS == ["tests/test_a.py::test_x"] and tasks[0].version == "1.0"

    bad = {k: v for k, v in good.items() if k != "problem_statement"}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TaskError, match=r"tasks.jsonl:2 .*problem_statement"):
        load_jsonl(path)
    path.write_text(json.dumps({**good, "FAIL_TO_PASS": "[not json"}) + "\n")
    with pytest.raises(TaskError, match=r":1 .*FAIL_TO_PASS"):
        load_jsonl(path)
    path.write_text("{oops\n")
    with pytest.raises(TaskError, match=r":1: not valid JSON"):
        load_jsonl(path)


# ---- SWE-bench rows with a real local repo, Harbor / terminal-bench dirs ----------------------------

HIDDEN_JMESPATH_TESTS = '''"""Hidden tests for jmespath functions."""
import jmespath


def test_avg():
    assert jmespath.search("avg(@)", [1, 2, 3, 6]) == 3.0


def test_avg_single():
    assert jmespath.search("avg(@)", [4]) == 4.0


def test_length():
    assert jmespath.search("length(@)", [1, 2, 3]) == 3


def test_max():
    assert jmespath.search("max(@)", [3, 9, 2]) == 9
'''


def make_swebench_jsonl(root: Path) -> tuple[Path, dict]:
    """A SWE-bench-format task file over a git repo of a real package (jmespath) with a planted bug.

    The repo has the buggy base commit and a later "future" commit holding the fix (which must
    never reach the agent); the row names the repo with a relative ``repo_path``.
    """
    import jmespath

    from legorl.tasks.builtin import unified_diff

    repo = root / "jmespath-src"
    shutil.copytree(Path(jmespath.__file__).parent, repo / "jmespath", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "README.md").write_text("# jmespath (test fixture)\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_basic.py").write_text(
        "import jmespath\n\n\ndef test_field():\n    assert jmespath.search('a', {'a': 1}) == 1\n"
    )
    funcs = repo / "jmespath" / "functions.py"
    good = funcs.read_text()
    bad = good.replace("return sum(arg) / len(arg)", "return sum(arg) / (len(arg) + 1)")
    assert bad != good
    funcs.write_text(bad)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base (buggy)")
    base = git(repo, "rev-parse", "HEAD").strip()
    funcs.write_text(good)
    git(repo, "commit", "-q", "-am", "future: fix avg")
    row = {
        "instance_id": "jmespath__jmespath-1", "repo": "jmespath/jmespath", "repo_path": "jmespath-src",
        "base_commit": base, "problem_statement": "`avg` returns the wrong value: avg([4]) is 2.0, not 4.0.",
        "patch": unified_diff("jmespath/functions.py", bad, good),
        "test_patch": unified_diff("tests/test_functions_hidden.py", "", HIDDEN_JMESPATH_TESTS).replace(
            "--- a/tests/test_functions_hidden.py", "new file mode 100644\n--- /dev/null"),
        "FAIL_TO_PASS": json.dumps(["tests/test_functions_hidden.py::test_avg",
                                    "tests/test_functions_hidden.py::test_avg_single"]),
        "PASS_TO_PASS": json.dumps(["tests/test_functions_hidden.py::test_length",
                                    "tests/test_functions_hidden.py::test_max", "tests/test_basic.py::test_field"]),
        "version": "1.0", "created_at": "2024-01-01",
    }  # fmt: skip
    path = root / "tasks.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path, row


def test_swebench_row_with_local_git_repo(tmp_path: Path) -> None:
    path, row = make_swebench_jsonl(tmp_path)
    (task,) = load_jsonl(path)
    assert task.repo_path == str((tmp_path / "jmespath-src").resolve()) and task.version == "1.0"
    dest = tmp_path / "ws"
    prepare_repo(task, dest)
    assert "(len(arg) + 1)" in (dest / "jmespath" / "functions.py").read_text()  # the base, not the future
    assert git(dest, "log", "--all", "--format=%s").strip() == "base"  # nothing of the task's id
    assert "future" not in git(dest, "log", "--all", "--format=%B")
    assert not (dest / "tests" / "test_functions_hidden.py").exists()
    # A row whose base already holds the hidden tests fails the task, not silently.
    leaky = task.model_copy(update={"test_patch": row["test_patch"], "base_commit": task.base_commit})
    (tmp_path / "jmespath-src" / "tests" / "test_functions_hidden.py").write_text(HIDDEN_JMESPATH_TESTS)
    git(tmp_path / "jmespath-src", "add", "-A")
    git(tmp_path / "jmespath-src", "commit", "-q", "-m", "tests leaked into history")
    leaky = leaky.model_copy(update={"base_commit": git(tmp_path / "jmespath-src", "rev-parse", "HEAD").strip()})
    with pytest.raises(TaskError, match="does not apply to the base"):
        prepare_repo(leaky, tmp_path / "leaky")


def test_hidden_file_content_anywhere_in_the_repo_fails_the_task(tmp_path: Path) -> None:
    task = generate_tasks(None, 1, seed=9, split="train")[0]
    hidden = task.hidden_files[HIDDEN_TEST_PATH]
    copy = task.model_copy(update={"files": {**task.files, "docs/notes.py": hidden}})
    with pytest.raises(TaskError, match="hidden test .* is in the agent's repo"):
        prepare_repo(copy, tmp_path / "r")


def test_load_tasks_specs(tmp_path: Path) -> None:
    from legorl.tasks import load_tasks

    assert len(load_tasks("builtin")) == 8 and len(load_tasks("builtin:3")) == 3
    assert [t.instance_id for t in load_tasks("builtin:2:5")] == [t.instance_id for t in generate_tasks(None, 2, 5)]
    path, _ = make_swebench_jsonl(tmp_path)
    assert [t.instance_id for t in load_tasks(path)] == ["jmespath__jmespath-1"]
    with pytest.raises(TaskError, match="not found"):
        load_tasks(tmp_path / "nope.jsonl")
    with pytest.raises(TaskError, match="not a Harbor"):
        load_tasks(tmp_path / "jmespath-src")


def make_task_dirs(root: Path) -> Path:
    """One Harbor task (task.toml) and one terminal-bench task (task.yaml), same problem."""
    calc = "import pathlib\nnums = pathlib.Path('/app/data/numbers.txt').read_text().split()\nprint(sum(int(n) for n in nums[1:]))\n"
    tests = (
        "import subprocess\nfrom pathlib import Path\n\n\n"
        "def test_answer_file():\n    assert Path('/app/answer.txt').read_text().strip() == '15'\n\n\n"
        "class TestCalc:\n    def test_calc_prints_sum(self):\n"
        "        out = subprocess.run(['python', '/app/calc.py'], capture_output=True, text=True).stdout\n"
        "        assert out.strip() == '15'\n"
    )
    solve = "sed -i 's/nums\\[1:\\]/nums/' /app/calc.py\npython /app/calc.py > /app/answer.txt\n"
    h = root / "tasks" / "sum-numbers"
    (h / "environment" / "data").mkdir(parents=True)
    (h / "task.toml").write_text(
        'version = "1.0"\n[metadata]\ndifficulty = "easy"\n[verifier]\ntimeout_sec = 90.0\n'
        '[agent]\ntimeout_sec = 300.0\n[environment]\ncpus = 1\nmemory = "2G"\ndocker_image = "python:3.11-slim"\n'
    )
    (h / "instruction.md").write_text("Fix /app/calc.py and write the sum to /app/answer.txt.\n")
    (h / "environment" / "Dockerfile").write_text(
        "FROM python:3.11-slim\nWORKDIR /app\nCOPY data/ /app/data/\nCOPY calc.py /app/calc.py\n"
        "RUN pip install --no-cache-dir numpy\n"
    )
    (h / "environment" / "data" / "numbers.txt").write_text("1 2 3 4 5\n")
    (h / "environment" / "calc.py").write_text(calc)
    (h / "tests").mkdir()
    (h / "tests" / "test.sh").write_text("#!/bin/bash\npytest /tests/test_outputs.py\n")
    (h / "tests" / "test_outputs.py").write_text(tests)
    (h / "solution").mkdir()
    (h / "solution" / "solve.sh").write_text(solve)
    t = root / "tasks" / "tb-sum"
    (t / "data").mkdir(parents=True)
    (t / "task.yaml").write_text(
        "instruction: |\n  Fix calc.py and write the sum to /app/answer.txt.\nauthor_email: a@b.c\n"
        "difficulty: easy\nmax_agent_timeout_sec: 200\nmax_test_timeout_sec: 60\n"
    )
    (t / "Dockerfile").write_text("FROM python:3.11\nWORKDIR /app\nCOPY . .\n")
    (t / "data" / "numbers.txt").write_text("1 2 3 4 5\n")
    (t / "calc.py").write_text(calc)
    (t / "solution.sh").write_text(solve)
    (t / "run-tests.sh").write_text("pytest $TEST_DIR/test_outputs.py\n")
    (t / "tests").mkdir()
    (t / "tests" / "test_outputs.py").write_text(tests)
    return root / "tasks"


def test_harbor_and_terminal_bench_dirs_map_to_tasks(tmp_path: Path) -> None:
    from legorl.tasks import load_task_dirs

    harbor, tbench = sorted(load_task_dirs(make_task_dirs(tmp_path)), key=lambda t: t.instance_id)
    assert harbor.instance_id == "sum-numbers" and tbench.instance_id == "tb-sum"
    for t in (harbor, tbench):
        assert t.workdir == "/app" and t.tests_dir == "/tests"
        assert set(t.files) == {"data/numbers.txt", "calc.py"}, t.files  # no infra file enters the workspace
        assert set(t.hidden_files) >= {"test_outputs.py"}
        assert t.FAIL_TO_PASS == ["test_outputs.py::test_answer_file", "test_outputs.py::TestCalc::test_calc_prints_sum"]
        assert "sed -i" in t.solution_script and "Fix" in t.problem_statement
    assert harbor.limits == {"agent_timeout_s": 300.0, "grading_timeout_s": 90.0, "cpus": 1, "memory_mb": 2048}
    assert harbor.image == "python:3.11-slim" and any("RUN" in n for n in harbor.environment_notes)
    assert tbench.limits["agent_timeout_s"] == 200
    ws = tmp_path / "ws"
    prepare_repo(harbor, ws)
    assert sorted(p.name for p in ws.iterdir()) == [".git", "calc.py", "data"]  # hidden tests stay out
    bad = tmp_path / "bad"
    (bad / "tests").mkdir(parents=True)
    (bad / "task.yaml").write_text("instruction: x\n")
    (bad / "tests" / "check.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    with pytest.raises(TaskError, match="no pytest tests"):
        load_task_dirs(bad)
