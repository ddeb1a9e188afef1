"""What a patch did to a tree, read from the filesystem, and the part of it the grader keeps.

The text of a patch says what it means to change; `git apply` decides what it does (git and
traditional sections in one file, any spelling of a mode, renames, binary hunks). So the grader
applies the filtered patch, then compares every entry of the tree with a snapshot taken before:
an entry created, changed, removed or turned into something else is judged by what it now is
(a link, a device, a submodule's empty directory, a test-infrastructure file, a shadow of the
standard library...), and whatever the policy refuses is put back as it was in the pristine
tree. The grading tree then holds the pristine sources plus allowed regular files, whatever the
patch's text claimed. Blocking (run it in a thread).
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from legorl.grading.policy import path_reason

Snapshot = dict[str, tuple[int, int, int, int]]  # relative path -> (st_mode, size, mtime_ns, inode)


def snapshot(root: Path) -> Snapshot:
    """Every entry under ``root`` but ``.git``, by lstat (links are not followed)."""
    out: Snapshot = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath == str(root):
            dirnames[:] = [d for d in dirnames if d != ".git"]
        rel = os.path.relpath(dirpath, root)
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[name if rel == "." else f"{rel}/{name}"] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
        # os.walk lists a link to a directory among dirnames but does not enter it (followlinks=False)
    return out


@dataclass
class Effect:
    applied: list[str] = field(default_factory=list)  # regular files created, changed or removed, kept
    dropped: dict[str, str] = field(default_factory=dict)  # path -> why it was put back
    new_text: dict[str, str] = field(default_factory=dict)  # kept file -> its content now (the tamper scan)


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "link" if stat.S_ISLNK(mode) else "special"


def _parents(rel: str) -> list[str]:
    parts = rel.split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts))]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def judge(
    root: Path,
    before: Snapshot,
    pristine: Path,
    protected: frozenset[str] | set[str],
    base_paths: frozenset[str] | set[str] | None,
) -> Effect:
    """Compare ``root`` now with ``before`` (its snapshot when it equalled ``pristine``), put back what the
    policy refuses, and say what was kept and what was dropped."""
    after = snapshot(root)
    effect = Effect()
    for rel in sorted(set(before) | set(after), key=lambda p: (p.count("/"), p)):
        old, new = before.get(rel), after.get(rel)
        if old == new:
            continue  # git apply writes a new file for every change (new inode and mtime)
        if any(parent in effect.dropped for parent in _parents(rel)):
            continue  # under a path put back whole
        if new is not None and _kind(new[0]) == "dir":
            if old is not None and _kind(old[0]) == "dir":
                continue  # a directory's own entry changes when its files do; they are judged one by one
            if why := path_reason(rel, protected, base_paths):
                effect.dropped[rel] = why
            continue  # a new directory: its files are judged; left empty, it goes (below)
        unchanged_mode = old is not None and new is not None and stat.S_IMODE(old[0]) == stat.S_IMODE(new[0])
        if unchanged_mode and _kind(old[0]) == _kind(new[0]) == "file" and _same_file(root / rel, pristine / rel):
            continue  # rewritten as it was
        kind = _kind(new[0]) if new is not None else None
        if kind == "link":
            why = "symlink (git created a link)"
        elif kind == "special":
            why = "not a regular file"
        else:
            why = path_reason(rel, protected, base_paths)
        if why:
            effect.dropped[rel] = why
        else:
            effect.applied.append(rel)
            if new is not None:
                effect.new_text[rel] = (root / rel).read_bytes().decode("utf-8", errors="replace")
    _put_back(root, pristine, before, effect.dropped)
    _remove_empty_new_dirs(root, before, effect)
    return effect


def _put_back(root: Path, pristine: Path, before: Snapshot, dropped: dict[str, str]) -> None:
    owner = os.lstat(root)
    for rel in sorted(dropped, key=lambda p: p.count("/")):
        target = root / rel
        if os.path.lexists(target):
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            else:
                os.unlink(target)
        if rel not in before:
            continue
        source = pristine / rel
        if os.path.islink(source):
            os.symlink(os.readlink(source), target)
        elif os.path.isdir(source):
            shutil.copytree(source, target, symlinks=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        for dirpath, dirnames, filenames in os.walk(target) if os.path.isdir(target) else [("", [], [])]:
            for name in (*dirnames, *filenames):
                os.lchown(os.path.join(dirpath, name), owner.st_uid, owner.st_gid)
        os.lchown(target, owner.st_uid, owner.st_gid)


def _remove_empty_new_dirs(root: Path, before: Snapshot, effect: Effect) -> None:
    """A directory the patch created and nothing kept lives in (a submodule's checkout, dropped files)."""
    for dirpath, _, _ in sorted(os.walk(root), key=lambda w: -w[0].count("/")):
        rel = os.path.relpath(dirpath, root)
        if rel == "." or rel in before or rel.split("/")[0] == ".git":
            continue
        if os.path.isdir(dirpath) and not os.listdir(dirpath):
            os.rmdir(dirpath)
            if not any(p.startswith(rel + "/") for p in effect.applied):
                effect.dropped.setdefault(rel, "an empty directory (a submodule, or only dropped files)")
