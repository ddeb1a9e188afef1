"""Task schema, loaders, the built-in suite and orphan-commit repo preparation."""

from __future__ import annotations

import json
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
