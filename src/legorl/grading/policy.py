"""Which parts of an agent's diff the grader applies (path policy).

Agents edit tests, add conftest hooks, sitecustomize or .pth files to force passes.
The grader keeps only source changes: every file section of the diff touching a
test or test-configuration path (or a symlink, submodule, bytecode) is dropped.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

TEST_DIRS = {"tests", "test", "testing"}
TEST_FILE_GLOBS = (
    "test_*.py", "*_test.py", "conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml",
    "sitecustomize.py", "usercustomize.py", "*.pth", "*.pyc", "noxfile.py", ".coveragerc",
)  # fmt: skip
_HEADER = re.compile(r"^diff --git (?P<a>\"(?:[^\"\\]|\\.)*\"|\S+) (?P<b>\"(?:[^\"\\]|\\.)*\"|\S+)$")
_MODE = re.compile(r"^(new file mode|new mode|old mode|deleted file mode|index \S+) (120000|160000)")
_PATH_LINES = ("--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to ")


def is_test_path(path: str, extra: frozenset[str] | set[str] = frozenset()) -> bool:
    p = PurePosixPath(path)
    if path in extra or any(part in TEST_DIRS or part in ("__pycache__", ".git") for part in p.parts[:-1]):
        return True
    return any(fnmatch.fnmatch(p.name, g) for g in TEST_FILE_GLOBS)


def _clean(raw: str) -> str | None:
    raw = raw.strip().split("\t")[0]
    if raw.startswith('"') and raw.endswith('"'):
        raw = raw[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
    if raw == "/dev/null":
        return None
    for prefix in ("a/", "b/"):
        if raw.startswith(prefix):
            return raw[len(prefix) :]
    return raw


@dataclass
class FileSection:
    text: str
    paths: set[str] = field(default_factory=set)
    symlink_or_submodule: bool = False


def split_diff(diff: str) -> list[FileSection]:
    """Split a (git or plain unified) diff into one section per file."""
    lines = diff.splitlines(keepends=True)
    git_style = any(line.startswith("diff --git ") for line in lines)
    sections: list[FileSection] = []
    in_hunk = False  # path-like lines inside hunks are content, not headers
    for i, line in enumerate(lines):
        starts = line.startswith("diff --git ") if git_style else (
            line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")
        )  # fmt: skip
        if starts or not sections:
            sections.append(FileSection(""))
            in_hunk = False
        sec = sections[-1]
        sec.text += line
        if line.startswith(("@@", "GIT binary patch")):
            in_hunk = True
        elif in_hunk:
            continue
        elif m := _HEADER.match(line.rstrip("\n")):
            sec.paths.update(p for p in (_clean(m["a"]), _clean(m["b"])) if p)
        elif line.startswith(_PATH_LINES):
            prefix = next(x for x in _PATH_LINES if line.startswith(x))
            if (p := _clean(line[len(prefix) :])) is not None:
                sec.paths.add(p)
        elif _MODE.match(line):
            sec.symlink_or_submodule = True
    return [s for s in sections if s.text.strip()]


def filter_diff(
    diff: str, protected: set[str] | frozenset[str] = frozenset()
) -> tuple[str, list[str], list[str]]:
    """Returns (kept diff, applied paths, dropped paths). ``protected``: hidden test paths."""
    kept: list[str] = []
    applied: list[str] = []
    dropped: list[str] = []
    for sec in split_diff(diff):
        if not sec.paths:  # preamble text (commit message etc.): nothing to apply
            continue
        if sec.symlink_or_submodule or any(is_test_path(p, protected) for p in sec.paths):
            dropped.extend(sorted(sec.paths))
        else:
            kept.append(sec.text if sec.text.endswith("\n") else sec.text + "\n")
            applied.extend(sorted(sec.paths))
    return "".join(kept), sorted(set(applied)), sorted(set(dropped))


def patch_paths(diff: str) -> set[str]:
    return {p for sec in split_diff(diff) for p in sec.paths}
