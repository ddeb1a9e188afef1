"""Each task's pristine repo, prepared once (``prepare_repo``) and copied per use: an episode's workspace
and a grading's sources are copies of it, and the grader compares a patched copy with it."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from legorl.tasks.repo import prepare_repo
from legorl.tasks.schema import Task


def base_paths(repo: Path) -> set[str]:
    """Every path of a repo's tree (files and directories, ``.git`` left out), relative to it."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(repo):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        rel = os.path.relpath(dirpath, repo)
        for name in (*dirnames, *filenames):
            out.add(name if rel == "." else f"{rel}/{name}")
    return out


@dataclass(frozen=True)
class Pristine:
    path: Path  # root-owned, never shown to a sandbox; copied per patch
    base: str  # the orphan commit
    base_paths: frozenset[str]


class PristineCache:
    """``prepare_repo`` once per task content (an LRU of ``size``, ~150 KB each for a built-in task), in a
    private dir of this process: an episode's workspace and a grading's sources are copies of it."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._root: Path | None = None
        self._entries: dict[str, Pristine] = {}
        self._lock = threading.Lock()

    def _dir(self) -> Path:
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="legorl-pristine-"))
            atexit.register(shutil.rmtree, self._root, True)
        return self._root

    @staticmethod
    def key(task: Task) -> str:
        src = None
        if task.repo_path:
            with contextlib.suppress(OSError):
                st = os.stat(task.repo_path)
                src = [st.st_mtime_ns, st.st_size]
        fields = [task.instance_id, task.repo_path, src, task.base_commit, task.files, task.binary_files,
                  sorted(task.hidden_files), task.tests_dir]  # fmt: skip
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]

    def get(self, task: Task) -> Pristine:
        """Blocking (run it in a thread)."""
        key = self.key(task)
        with self._lock:
            if (hit := self._entries.pop(key, None)) is not None:
                self._entries[key] = hit  # most recent last
                return hit
            root = self._dir()
        tmp = root / f"tmp-{secrets.token_hex(6)}"
        base = prepare_repo(task, tmp)
        entry = Pristine(root / key, base, frozenset(base_paths(tmp)))
        with self._lock:
            if key in self._entries:  # prepared twice at once: keep the first
                shutil.rmtree(tmp, ignore_errors=True)
                return self._entries[key]
            tmp.rename(entry.path)
            self._entries[key] = entry
            while len(self._entries) > self.size:
                old = self._entries.pop(next(iter(self._entries)))
                shutil.rmtree(old.path, ignore_errors=True)
        return entry

    def copy(self, task: Task, dest: Path, ids: tuple[int, int] | None = None) -> Pristine:
        """A private copy of the task's pristine repo at ``dest``, owned by ``ids`` (default: this process's
        uid), what ``prepare_repo(task, dest)`` would write, for a copy's cost (made under the lock: an entry
        is never evicted mid-copy)."""
        while True:
            entry = self.get(task)
            with self._lock:
                if self._entries.get(self.key(task)) is entry:
                    copy_repo(entry.path, dest, ids)
                    return entry


PRISTINE = PristineCache()


def copy_repo(src: Path, dest: Path, ids: tuple[int, int] | None) -> None:
    """A private copy of a pristine repo, owned by ``ids`` (a sandbox's uid, as ``open_to`` does a workspace)."""
    shutil.copytree(src, dest, symlinks=True)
    if ids is None:
        return
    for dirpath, dirnames, filenames in os.walk(dest):
        os.lchown(dirpath, *ids)
        for name in (*dirnames, *filenames):
            os.lchown(os.path.join(dirpath, name), *ids)
