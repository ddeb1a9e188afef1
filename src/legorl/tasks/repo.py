"""Materialise a task's repo as a git repo with exactly one orphan commit.

Agents have been seen reading the fix from future git history; the repo they get
therefore has no history, remotes, tags, reflog or stray objects, and never the
hidden tests, and its one commit message says nothing of the task. Git runs with host config and
hooks disabled and a fixed identity/date, so the commit hash is deterministic.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import tarfile
from pathlib import Path, PurePosixPath

from legorl.tasks.schema import Task, TaskError

FIXED_DATE = "2000-01-01T00:00:00+0000"
GIT_OPTS = [
    "-c", "core.hooksPath=/dev/null",
    "-c", "core.fsmonitor=false",
    "-c", "core.logAllRefUpdates=false",
    "-c", "commit.gpgsign=false",
    "-c", "init.defaultBranch=main",
    "-c", "safe.directory=*",
    "-c", "user.name=legorl",
    "-c", "user.email=legorl@localhost",
    # A commit otherwise starts `git maintenance run --auto` (3 more processes each episode)
    "-c", "maintenance.auto=false",
    "-c", "gc.auto=0",
]  # fmt: skip


def git_env(repo: Path | None = None) -> dict[str, str]:
    """Git's environment: host config off, fixed identity and dates. With ``repo``, git never looks
    above it for a repository: a task repo whose .git was removed mid-way (a cancelled grading's
    clean-up) must fail, not commit into whatever repository holds the run directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    if repo is not None:
        env["GIT_CEILING_DIRECTORIES"] = str(Path(repo).resolve().parent)
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL="/dev/null",
        GIT_AUTHOR_DATE=FIXED_DATE,
        GIT_COMMITTER_DATE=FIXED_DATE,
        GIT_TERMINAL_PROMPT="0",
    )
    return env


def git(cwd: Path, *args: str, check: bool = True) -> str:
    proc = subprocess.run(
        ["git", *GIT_OPTS, *args],
        cwd=cwd,
        env=git_env(cwd),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check and proc.returncode != 0:
        raise TaskError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip()[-1000:]}")
    return proc.stdout


def _safe_rel(path: str) -> PurePosixPath:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or not p.parts or p.parts[0] == ".git":
        raise TaskError(f"unsafe repo path {path!r}")
    return p


def _copy_source(task: Task, dest: Path) -> None:
    if task.repo_path is None:
        if not task.files and not task.binary_files:
            raise TaskError(f"task {task.instance_id}: neither repo_path nor files given")
        for rel, content in task.files.items():
            target = dest / _safe_rel(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
        for rel, b64 in task.binary_files.items():
            target = dest / _safe_rel(rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(base64.b64decode(b64))
        return
    src = Path(task.repo_path)
    if src.is_dir():
        if not task.base_commit:
            raise TaskError(f"task {task.instance_id}: repo_path is a git dir but base_commit is empty")
        # `git archive` exports the tree only: nothing of the source's history comes along.
        archive = subprocess.run(
            ["git", *GIT_OPTS, "archive", "--format=tar", task.base_commit],
            cwd=src, env=git_env(), capture_output=True, timeout=300, check=False,
        )  # fmt: skip
        if archive.returncode != 0:
            raise TaskError(
                f"task {task.instance_id}: git archive {task.base_commit} failed in {src}: "
                f"{archive.stderr.decode(errors='replace')[-500:]}"
            )
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    elif src.name.endswith((".tar.gz", ".tgz", ".tar")):
        with tarfile.open(src) as tf:
            tf.extractall(dest, filter="data")
        entries = list(dest.iterdir())
        if len(entries) == 1 and entries[0].is_dir() and entries[0].name != ".git":
            # A tarball with one top-level dir (project-1.0/...): its contents are the repo.
            inner = entries[0]
            for child in inner.iterdir():
                child.rename(dest / child.name)
            inner.rmdir()
    else:
        raise TaskError(f"task {task.instance_id}: repo_path {src} is neither a directory nor a tarball")


def prepare_repo(task: Task, dest: Path) -> str:
    """Write the task repo at ``dest`` as one orphan commit; returns the commit sha."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise TaskError(f"prepare_repo: destination {dest} is not empty")
    dest.mkdir(parents=True, exist_ok=True)
    _copy_source(task, dest)
    # Any nested .git (a tarball's, a submodule's) would carry history: drop it.
    for p in sorted(dest.rglob(".git"), key=lambda p: len(p.parts), reverse=True):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    if not task.tests_dir:
        for rel in task.hidden_files:  # hidden tests never enter the agent's repo
            target = dest / _safe_rel(rel)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
    git(dest, "init", "-q")
    git(dest, "add", "-A", "--force")
    # The message names nothing of the task: a built-in task's id names its bug family, and an agent
    # reads `git log` (Qwen Code puts it in its system prompt).
    git(dest, "commit", "-q", "--no-verify", "--allow-empty", "-m", "base")
    shutil.rmtree(dest / ".git" / "logs", ignore_errors=True)
    for sample_hook in (dest / ".git" / "hooks").glob("*"):
        sample_hook.unlink()
    sha = git(dest, "rev-parse", "HEAD").strip()
    assert_clean_history(dest)
    assert_no_hidden_tests(dest, task)
    return sha


def assert_clean_history(dest: Path) -> None:
    """Raise TaskError unless ``dest`` holds exactly one commit and nothing else to find."""
    dest = Path(dest)
    gitdir = dest / ".git"
    if not gitdir.is_dir():
        raise TaskError(f"{dest}: no .git directory")
    commits = git(dest, "rev-list", "--all", "--reflog").split()
    if len(commits) != 1:
        raise TaskError(f"{dest}: expected exactly one commit, found {len(commits)}")
    refs = git(dest, "for-each-ref", "--format=%(refname)").split()
    if len(refs) != 1 or not refs[0].startswith("refs/heads/"):
        raise TaskError(f"{dest}: expected a single branch, found refs {refs}")
    if remotes := git(dest, "remote").split():
        raise TaskError(f"{dest}: has remotes {remotes}")
    logs = gitdir / "logs"
    if logs.exists() and any(p.is_file() and p.stat().st_size for p in logs.rglob("*")):
        raise TaskError(f"{dest}: has reflog entries")
    for extra in ("shallow", "objects/info/alternates", "FETCH_HEAD", "ORIG_HEAD"):
        if (gitdir / extra).exists() and (gitdir / extra).stat().st_size:
            raise TaskError(f"{dest}: unexpected .git/{extra}")
    # (no commit-graph or multi-pack-index to verify in a one-commit repo: two fewer processes)
    stray = git(dest, "-c", "core.commitGraph=false", "-c", "core.multiPackIndex=false",
                "fsck", "--unreachable", "--dangling", "--no-reflogs", "--no-progress").strip()
    if stray:
        raise TaskError(f"{dest}: unreachable objects: {stray.splitlines()[:3]}")


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id


def assert_no_hidden_tests(dest: Path, task: Task) -> None:
    """Raise TaskError if the hidden tests are in the prepared repo in any form we can detect:
    a hidden file's content anywhere in the tree (any path), or a test patch that no longer
    applies to the base (its changes are already there: wrong base_commit)."""
    blobs = {line.split()[2] for line in git(dest, "ls-tree", "-r", "HEAD").splitlines() if line.strip()}
    for rel, content in task.hidden_files.items():
        if len(content.strip()) >= 32 and _blob_id(content.encode("utf-8")) in blobs:  # tiny files are not distinctive
            raise TaskError(f"task {task.instance_id}: hidden test {rel} is in the agent's repo")
    if task.test_patch.strip():
        check = subprocess.run(
            ["git", *GIT_OPTS, "apply", "--check", "-"],
            cwd=dest, env=git_env(dest), input=task.test_patch.encode(), capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        if check.returncode != 0:
            raise TaskError(
                f"task {task.instance_id}: the hidden test patch does not apply to the base commit "
                f"(are the hidden tests already in the repo?): {check.stderr.decode(errors='replace')[-300:]}"
            )