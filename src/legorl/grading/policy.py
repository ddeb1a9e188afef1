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
# Every file name pytest reads its configuration from (``_pytest.config.findpaths.locate_config``, in the order
# it tries them; tests/test_grading_policy.py fails when an installed pytest knows a name that is not here).
PYTEST_CONFIG_FILES = ("pytest.toml", ".pytest.toml", "pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini",
                       "setup.cfg")  # fmt: skip
TEST_FILE_GLOBS = (
    *PYTEST_CONFIG_FILES, "test_*.py", "*_test.py", "conftest.py", "sitecustomize.py", "usercustomize.py", "*.pth",
    "*.pyc", "*.pyo", "noxfile.py", ".coveragerc",
)  # fmt: skip
# Modules the test run imports besides the stdlib; a repo-root file with one of these names would replace it.
RUNNER_MODULES = frozenset(
    {"pytest", "_pytest", "pluggy", "py", "iniconfig", "packaging", "exceptiongroup", "tomli", "pygments",
     "colorama", "legorl_verifier", "_virtualenv", "__editable__", "typing_extensions"}
)  # fmt: skip
SHADOWABLE = RUNNER_MODULES | frozenset(sys.stdlib_module_names)
MAX_PATCH_BYTES = 2_000_000  # a larger patch is refused as such (grader.py), never cut
_HEADER = re.compile(r"^diff --git (?P<a>\"(?:[^\"\\]|\\.)*\"|\S+) (?P<b>\"(?:[^\"\\]|\\.)*\"|\S+)$")
_HUNK = re.compile(r"^@@ -\d+(?:,(?P<old>\d+))? \+\d+(?:,(?P<new>\d+))? @@")
# git reads a mode with strtoul(base 8): any spelling of the number counts (`0120000`, `120777`, extra spaces).
_MODE = re.compile(r"^(?:new file mode|new mode|old mode|deleted file mode|index \S+)\s+(?P<mode>\S+)")
_PATH_LINES = ("--- ", "+++ ", "rename from ", "rename to ", "copy from ", "copy to ")


def is_link_mode(spelling: str) -> bool:
    """True for a mode git would read as a symlink or submodule (or cannot read at all)."""
    try:
        mode = int(spelling, 8)
    except ValueError:
        return True  # git refuses it or reads it some other way: never apply it
    return mode & 0o170000 in (0o120000, 0o160000)


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
    lines: list[str] = field(default_factory=list)
    paths: set[str] = field(default_factory=set)
    symlink_or_submodule: bool = False
    has_old_name: bool = False  # its `--- ` line is read: a next `--- `/`+++ ` pair starts another file

    @property
    def text(self) -> str:
        return "".join(self.lines)


def split_diff(diff: str) -> list[FileSection]:
    """Split a diff into one section per file, as `git apply` reads it: git sections (`diff --git`) and
    traditional ones (`--- `/`+++ `) mixed in one patch, a hunk's extent from its line counts (so a header
    after a hunk starts a new file even without `diff --git`), binary data skipped. Linear in the size."""
    lines = diff.splitlines(keepends=True)
    sections: list[FileSection] = []
    old = new = 0  # lines left in the current hunk
    binary = False  # inside GIT binary patch data (base85 lines never start with `-` or `diff `)
    for i, line in enumerate(lines):
        if old > 0 or new > 0:
            tag = line[:1]
            if tag in (" ", "-", "+", "\\", "\n"):  # git reads a bare newline as an empty context line
                sec = sections[-1]
                sec.lines.append(line)
                if tag in (" ", "\n", "-"):
                    old -= 1
                if tag in (" ", "\n", "+"):
                    new -= 1
                continue
            old = new = 0  # git calls the patch corrupt (it will not apply): read on as headers
        traditional = line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")
        if line.startswith("diff --git ") or not sections or (
            traditional and (sections[-1].has_old_name or binary)
        ):
            sections.append(FileSection())
            binary = False
        sec = sections[-1]
        sec.lines.append(line)
        if m := _HUNK.match(line):
            old, new = int(m["old"] or 1), int(m["new"] or 1)
            sec.has_old_name = True  # a hunk ends the headers, as a read `--- ` line does
        elif line.startswith("GIT binary patch"):
            binary = sec.has_old_name = True
        elif binary:
            continue
        elif m := _HEADER.match(line.rstrip("\n")):
            sec.paths.update(p for p in (_clean(m["a"]), _clean(m["b"])) if p)
        elif line.startswith(_PATH_LINES):
            prefix = next(x for x in _PATH_LINES if line.startswith(x))
            if (p := _clean(line[len(prefix) :])) is not None:
                sec.paths.add(p)
            sec.has_old_name = sec.has_old_name or prefix == "+++ "
        elif m := _MODE.match(line):
            sec.symlink_or_submodule = sec.symlink_or_submodule or is_link_mode(m["mode"].split(",")[0])
    return [s for s in sections if s.text.strip()]


@dataclass
class FilteredDiff:
    kept: str  # the diff the grader applies
    dropped: str  # the file sections it does not
    applied_paths: list[str]
    dropped_paths: list[str]
    reasons: dict[str, str]  # dropped path -> why


def path_reason(
    path: str, protected: set[str] | frozenset[str], base_paths: set[str] | frozenset[str] | None
) -> str:
    """Why the grader never applies a change to ``path`` ("" when it does)."""
    if path in protected or any(fnmatch.fnmatch(path, g) for g in protected if any(c in g for c in "*?[")):
        return "protected by the task"
    if is_test_path(path):
        return "test or test-infrastructure path"
    if shadows_runner(path, base_paths):
        return "shadows a standard-library or test-runner module"
    return ""


def drop_reason(
    sec: FileSection, protected: set[str] | frozenset[str], base_paths: set[str] | frozenset[str] | None
) -> str:
    if sec.symlink_or_submodule:
        return "symlink or submodule"
    return next((why for p in sorted(sec.paths) if (why := path_reason(p, protected, base_paths))), "")


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
