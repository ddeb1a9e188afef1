"""Which parts of an agent's diff the grader applies (path policy).

Agents edit tests, add conftest hooks, sitecustomize or .pth files, or shadow the test
runner itself to force passes. The grader keeps only source changes: every file section
of the diff is dropped when it touches

* a test or test-infrastructure path: anything under a ``tests``/``test``/``testing`` dir,
  ``test_*.py``, ``*_test.py``, ``conftest.py``, ``pytest.ini``, ``.pytest.ini``, ``tox.ini``,
  ``setup.cfg``, ``pyproject.toml`` (whole files: their test sections cannot be split off
  reliably, so a fix that also needs a packaging change there does not get it), ``noxfile.py``,
  ``.coveragerc``;
* interpreter start-up hooks: ``sitecustomize.py``, ``usercustomize.py``, ``*.pth``; bytecode;
* a new top-level module or package that would shadow the standard library or the test runner
  (``pytest.py``, ``_pytest/``, ``json.py``...: ``python -m pytest`` puts the repo first on sys.path);
* a symlink or submodule, anything under ``.git``;
* a path the task declares protected (its hidden tests, ``Task.protected_paths`` globs).
"""

from __future__ import annotations

import fnmatch
import re
import sys
from dataclasses import dataclass, field
from pathlib import PurePosixPath

TEST_DIRS = {"tests", "test", "testing"}
TEST_FILE_GLOBS = (
    "test_*.py", "*_test.py", "conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg",
    "pyproject.toml", "sitecustomize.py", "usercustomize.py", "*.pth", "*.pyc", "*.pyo", "noxfile.py",
    ".coveragerc",
)  # fmt: skip
# Modules the test run imports besides the stdlib; a repo-root file with one of these names would replace it.
RUNNER_MODULES = frozenset(
    {"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "exceptiongroup", "tomli", "pygments",
     "colorama", "legorl_verifier", "_virtualenv", "__editable__", "typing_extensions"}
)  # fmt: skip
SHADOWABLE = RUNNER_MODULES | frozenset(sys.stdlib_module_names)
_HEADER = re.compile(r"^diff --git (?P<a>\"(?:[^\"\\]|\\.)*\"|\S+) (?P<b>\"(?:[^\"\\]|\\.)*\"|\S+)$")
_MODE = re.compile(r"^(new file mode|new mode|old mode|deleted file mode|index \S+) (120000|160000)")
_PATH_LINES = ("--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to ")


def is_test_path(path: str, extra: frozenset[str] | set[str] = frozenset()) -> bool:
    """True for test / test-infrastructure paths (``extra``: exact paths or globs to protect too)."""
    p = PurePosixPath(path)
    if path in extra or any(fnmatch.fnmatch(path, g) for g in extra if any(c in g for c in "*?[")):
        return True
    if any(part in TEST_DIRS or part in ("__pycache__", ".git") for part in p.parts[:-1]):
        return True
    return any(fnmatch.fnmatch(p.name, g) for g in TEST_FILE_GLOBS)


def shadows_runner(path: str, base_paths: set[str] | frozenset[str] | None) -> bool:
    """A new top-level module/package whose name hides a stdlib or test-runner module."""
    top = PurePosixPath(path).parts[0] if PurePosixPath(path).parts else ""
    name = top.split(".")[0]
    if name not in SHADOWABLE:
        return False
    if len(PurePosixPath(path).parts) == 1 and "." in top and not top.endswith((".py", ".so", ".pyd", ".pyc")):
        return False  # e.g. `json.md`, `io.txt`: not importable
    return base_paths is None or not any(b == top or b.startswith(top + "/") for b in base_paths)


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


@dataclass
class FilteredDiff:
    kept: str  # the diff the grader applies
    dropped: str  # the file sections it does not
    applied_paths: list[str]
    dropped_paths: list[str]
    reasons: dict[str, str]  # dropped path -> why


def drop_reason(
    sec: FileSection, protected: set[str] | frozenset[str], base_paths: set[str] | frozenset[str] | None
) -> str:
    if sec.symlink_or_submodule:
        return "symlink or submodule"
    for p in sorted(sec.paths):
        if p in protected or any(fnmatch.fnmatch(p, g) for g in protected if any(c in g for c in "*?[")):
            return "protected by the task"
        if is_test_path(p):
            return "test or test-infrastructure path"
        if shadows_runner(p, base_paths):
            return "shadows a standard-library or test-runner module"
    return ""


def filter_diff_detailed(
    diff: str,
    protected: set[str] | frozenset[str] = frozenset(),
    base_paths: set[str] | frozenset[str] | None = None,
) -> FilteredDiff:
    """``protected``: hidden-test paths and task globs; ``base_paths``: files of the pristine tree
    (a top-level name that already exists there is the repo's own, not a shadow)."""
    kept: list[str] = []
    dropped: list[str] = []
    applied: set[str] = set()
    reasons: dict[str, str] = {}
    for sec in split_diff(diff):
        if not sec.paths:  # preamble text (commit message etc.): nothing to apply
            continue
        text = sec.text if sec.text.endswith("\n") else sec.text + "\n"
        if why := drop_reason(sec, protected, base_paths):
            dropped.append(text)
            reasons.update(dict.fromkeys(sec.paths, why))
        else:
            kept.append(text)
            applied.update(sec.paths)
    return FilteredDiff("".join(kept), "".join(dropped), sorted(applied), sorted(reasons), reasons)


def filter_diff(
    diff: str,
    protected: set[str] | frozenset[str] = frozenset(),
    base_paths: set[str] | frozenset[str] | None = None,
) -> tuple[str, list[str], list[str]]:
    """Returns (kept diff, applied paths, dropped paths). ``protected``: hidden test paths."""
    f = filter_diff_detailed(diff, protected, base_paths)
    return f.kept, f.applied_paths, f.dropped_paths


def patch_paths(diff: str) -> set[str]:
    return {p for sec in split_diff(diff) for p in sec.paths}


def added_lines(diff: str) -> dict[str, list[str]]:
    """path -> lines the diff adds (for the tamper scan); a rename's lines count for both names."""
    out: dict[str, list[str]] = {}
    for sec in split_diff(diff):
        lines: list[str] = []
        in_hunk = False
        for line in sec.text.splitlines():
            if line.startswith("@@"):
                in_hunk = True
            elif in_hunk and line.startswith("+"):
                lines.append(line[1:])
        for p in sec.paths:
            out.setdefault(p, []).extend(lines)
    return out
