"""Task environments: a package's dependencies, built once on the host, shown read-only to its sandboxes.

An environment is a directory of installed Python distributions (``pip install --target``). A task
names it in ``environment`` (a path; relative to the tasks file in a JSONL row); every sandbox made
for the task, the agent's and the grader's, on either backend, mounts it read-only at
``/opt/legorl-env`` and puts that on ``PYTHONPATH`` (``legorl.sandbox.factory``). Nothing inside can
change it, and tasks of one package share one build.

``build_environment(requirements, dest)`` builds one, or finds it already built for the same
requirements (a ``.legorl-env.json`` stamp). A build that fails or outlasts its timeout raises
``TaskEnvironmentError`` with the reason, and leaves nothing half-built at ``dest``.

``suite_requirements(root)`` reads what a package's tests need from its sdist (``legorl tasks synth``
builds that once per package and names it in every task it mines from the package).

With ``runner=True`` the environment also carries the test runner: the pytest this interpreter runs
and its dependencies, copied file by file from their installed distributions (offline, the same
versions). A task's test command then runs ``python -S -m pytest``: no site-packages at all, only the
standard library and this directory. That is the environment its tests were mined in and the one
they are graded in, on bwrap (the host's venv and whatever else it holds stay out of sight) and on
docker (the image's own pytest stays out of sight) alike.
"""

from __future__ import annotations

import ast
import configparser
import email.parser
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

from legorl.tasks.schema import TaskError

STAMP = ".legorl-env.json"


class TaskEnvironmentError(TaskError):
    """A task environment could not be built, or is missing or broken."""


RUNNER = "pytest"  # the test runner an environment carries with runner=True


def environment_key(requirements: Sequence[str], python: str, runner: Sequence[str] = ()) -> str:
    """What a build depends on: the requirements, the interpreter's version and the runner's distributions."""
    version = subprocess.run([python, "-c", "import sys; print(sys.version)"], capture_output=True, text=True,
                             timeout=60, check=False).stdout.strip()  # fmt: skip
    parts: list = [sorted(requirements), version]
    if runner:  # the key of an environment without a runner stays what it was
        parts.append(sorted(runner))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def runner_distributions(name: str = RUNNER) -> list[importlib.metadata.Distribution]:
    """``name``'s installed distribution in this interpreter and those it requires here (markers evaluated
    for this interpreter, extras left out), each once."""
    from packaging.requirements import Requirement

    out: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        key = _requirement_name(todo.pop())
        if key in out:
            continue
        try:
            dist = importlib.metadata.distribution(key)
        except importlib.metadata.PackageNotFoundError:
            raise TaskEnvironmentError(f"the test runner needs {key}, which this interpreter does not have") from None
        out[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(out.values(), key=lambda d: _requirement_name(d.metadata["Name"]))


def _pins(dists: Sequence[importlib.metadata.Distribution]) -> list[str]:
    return [f"{_requirement_name(d.metadata['Name'])}=={d.version}" for d in dists]


def copy_distributions(dists: Sequence[importlib.metadata.Distribution], dest: Path) -> None:
    """Copy installed distributions (their files under site-packages, from RECORD; scripts left out) into
    ``dest``, replacing any other version of them there."""
    names = {_requirement_name(d.metadata["Name"]).replace("-", "_") for d in dists}
    for info in Path(dest).glob("*.dist-info"):  # a version pip put there as some requirement's dependency
        if _requirement_name(info.name.split("-")[0]).replace("-", "_") in names:
            for rel in (info / "RECORD").read_text().splitlines() if (info / "RECORD").is_file() else []:
                target = Path(dest) / rel.split(",")[0]
                if ".." not in Path(rel.split(",")[0]).parts and target.is_file():
                    target.unlink()
            shutil.rmtree(info, ignore_errors=True)
    for dist in dists:
        if not dist.files:
            raise TaskEnvironmentError(f"{dist.metadata['Name']} {dist.version}: no RECORD to copy it from")
        for f in dist.files:
            if ".." in f.parts:  # console scripts in bin/
                continue
            src = Path(str(dist.locate_file(f)))
            if src.is_file():
                target = Path(dest) / f
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)  # pyc files stay valid: same minor version, same source mtime


def has_runner(env: Path | str) -> bool:
    """True when a built environment carries its own test runner (run it with ``python -S``)."""
    try:
        return bool(json.loads((Path(env) / STAMP).read_text()).get("runner"))
    except (OSError, ValueError):
        return False


def built(dest: Path, key: str | None = None) -> bool:
    """True when ``dest`` holds a finished build (of ``key``, when given)."""
    try:
        stamp = json.loads((Path(dest) / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return key is None or stamp.get("key") == key


def build_environment(
    requirements: Sequence[str],
    dest: Path,
    *,
    python: str | None = None,
    timeout: float = 900.0,
    pip_args: Sequence[str] = (),
    runner: bool = False,
) -> Path:
    """Install ``requirements`` (pip requirement strings or local paths) into ``dest`` once; returns ``dest``.

    Built with ``python -m pip install --target`` into a temporary sibling, then renamed into place,
    so a failed, killed or timed-out build never leaves a partial environment that looks usable.
    ``runner``: add this interpreter's pytest and its dependencies (copied; see the module's doc).
    """
    python = python or sys.executable
    dest = Path(dest).resolve()
    runner_dists = runner_distributions() if runner else []
    key = environment_key(requirements, python, _pins(runner_dists))
    if built(dest, key):
        return dest
    tmp = dest.with_name(f".{dest.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    argv = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
            "--no-warn-script-location", "--target", str(tmp), *pip_args, *requirements]  # fmt: skip
    t0 = time.monotonic()
    try:
        if requirements:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                raise TaskEnvironmentError(
                    f"building the environment {dest.name} took longer than {timeout:.0f}s: {' '.join(requirements)}"
                ) from None
            if proc.returncode != 0:
                tail = out.decode(errors="replace").strip()[-1500:]
                raise TaskEnvironmentError(f"building the environment {dest.name} failed (pip exit "
                                           f"{proc.returncode}): {tail}")  # fmt: skip
        copy_distributions(runner_dists, tmp)
        (tmp / STAMP).write_text(json.dumps({"key": key, "requirements": list(requirements),
                                             "runner": _pins(runner_dists),
                                             "seconds": round(time.monotonic() - t0, 1)}))  # fmt: skip
        for dirpath, dirnames, filenames in os.walk(tmp):  # readable by every sandbox uid
            os.chmod(dirpath, 0o755)
            for name in filenames:
                p = os.path.join(dirpath, name)
                if not os.path.islink(p):
                    os.chmod(p, os.stat(p).st_mode & 0o755 | 0o444)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        return dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---- what a package's tests need ------------------------------------------------------------------

# Extras and dependency groups that hold test dependencies; "dev" only where none of these exists.
TEST_EXTRAS = ("test", "tests", "testing")
# Tooling, not test dependencies: the runner is the sandbox's own pytest (a second one on PYTHONPATH would
# shadow it and the grader's verifier plugin), plugins are never auto-loaded there, and the rest (coverage,
# linters, docs, packaging) does not change a test's outcome.
TOOLING = re.compile(
    r"^(pytest([-_].*)?|coverage|covdefaults|codecov|tox|nox|flake8.*|pyflakes|pycodestyle|pylint|mypy|ruff|"
    r"black|isort|pre[-_]commit|sphinx.*|furo|twine|wheel|setuptools.*|build|check[-_]manifest|pyright|"
    r"types[-_].*|bandit|docutils|readme[-_]renderer|pip|virtualenv|"
    # pytest's own dependencies: the runner's versions, never shadowed by a lockfile's pins
    r"pluggy|iniconfig|packaging|pygments|exceptiongroup|tomli|colorama)$",
    re.IGNORECASE,
)
REQUIREMENT_FILES = ("requirements-test.txt", "requirements_test.txt", "test-requirements.txt",
                     "test_requirements.txt", "requirements-tests.txt", "requirements/test.txt",
                     "requirements/tests.txt", "requirements/testing.txt", "tests/requirements.txt")  # fmt: skip


def _requirement_name(spec: str) -> str:
    return re.split(r"[\s\[<>=!~;@(]", spec.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _applies(spec: str, extras: Sequence[str]) -> str | None:
    """``spec`` without its marker when the marker holds here for no extra or one of ``extras``, else None."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        req = Requirement(spec)
    except InvalidRequirement:
        return None
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
        return None
    req.marker = None
    return str(req)


def _setup_py_requirements(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """Literal ``install_requires`` / ``tests_require`` / ``extras_require`` of a ``setup(...)`` call."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return [], {}
    base: list[str] = []
    extras: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "setup"):
            continue
        for kw in node.keywords:
            try:
                value = ast.literal_eval(kw.value)
            except (ValueError, SyntaxError, TypeError):
                continue
            if kw.arg in ("install_requires", "tests_require") and isinstance(value, (list, tuple)):
                base += [v for v in value if isinstance(v, str)]
            elif kw.arg == "extras_require" and isinstance(value, dict):
                extras.update({k: [v for v in vs if isinstance(v, str)] for k, vs in value.items()
                               if isinstance(vs, (list, tuple))})  # fmt: skip
    return base, extras


def _cfg_lines(value: str) -> list[str]:
    return [x.strip() for x in value.splitlines() if x.strip() and not x.strip().startswith("#")]


def _requirements_file(path: Path) -> list[str]:
    return [ln.split(" #")[0].strip() for ln in path.read_text(errors="replace").splitlines()
            if ln.strip() and not ln.lstrip().startswith(("#", "-"))]  # fmt: skip


_NOT_TESTS = {".git", ".tox", ".nox", "build", "dist", "docs", "doc", "__pycache__", "site-packages"}


def test_imports(root: Path) -> set[str]:
    """Top-level modules the package's test files import (``import x``, ``from x import``,
    ``pytest.importorskip("x")``), lower-cased."""
    out: set[str] = set()
    for p in Path(root).rglob("*.py"):
        rel = p.relative_to(root)
        if _NOT_TESTS & set(rel.parts[:-1]) or p.is_symlink():
            continue
        if not (p.name.startswith("test_") or p.name.endswith("_test.py") or p.name == "conftest.py"
                or {"test", "tests", "testing"} & set(rel.parts[:-1])):  # fmt: skip
            continue
        try:
            tree = ast.parse(p.read_text(errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0].lower() for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                out.add(node.module.split(".")[0].lower())
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "importorskip"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):  # fmt: skip
                out.add(node.args[0].value.split(".")[0].lower())
    return out


def suite_requirements(root: Path, name: str = "") -> list[str]:
    """What a package's test suite needs from PyPI, read from its sdist: its runtime dependencies and its
    test extras / dependency groups / requirements files (pyproject.toml, setup.cfg, a literal setup.py,
    PKG-INFO), markers evaluated for this interpreter, and the requirements of other extras that the tests
    import (an optional dependency with tests of its own); tooling and the package itself left out. Sorted."""
    root = Path(root)
    base: list[str] = []
    extras: dict[str, list[str]] = {}
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        try:
            data = tomllib.loads(pyproject.read_text(errors="replace"))
        except tomllib.TOMLDecodeError:
            data = {}
        project = data.get("project", {})
        name = name or str(project.get("name", ""))
        base += [d for d in project.get("dependencies", []) if isinstance(d, str)]
        for group in (project.get("optional-dependencies", {}), data.get("dependency-groups", {})):
            for k, vs in group.items():
                extras.setdefault(k, []).extend(v for v in vs if isinstance(v, str))
    setup_cfg = root / "setup.cfg"
    if setup_cfg.is_file():
        cp = configparser.ConfigParser(interpolation=None)
        try:
            cp.read_string(setup_cfg.read_text(errors="replace"))
        except configparser.Error:
            cp = configparser.ConfigParser()
        if cp.has_option("options", "install_requires"):
            base += _cfg_lines(cp.get("options", "install_requires"))
        if cp.has_option("options", "tests_require"):
            base += _cfg_lines(cp.get("options", "tests_require"))
        if cp.has_section("options.extras_require"):
            for k, v in cp.items("options.extras_require"):
                extras.setdefault(k, []).extend(_cfg_lines(v))
    if (root / "setup.py").is_file():
        b, e = _setup_py_requirements((root / "setup.py").read_text(errors="replace"))
        base += b
        for k, vs in e.items():
            extras.setdefault(k, []).extend(vs)
    pkg_info = root / "PKG-INFO"
    wanted = [e for e in extras if e.lower() in TEST_EXTRAS] or [e for e in extras if e.lower() == "dev"]
    if pkg_info.is_file():  # Requires-Dist: what the build backend made of all the above
        msg = email.parser.Parser().parsestr(pkg_info.read_text(errors="replace"))
        name = name or msg.get("Name", "")
        test_extras = [e for e in msg.get_all("Provides-Extra") or [] if e.lower() in TEST_EXTRAS]
        wanted += [e for e in test_extras if e not in wanted]
        base += [r for r in msg.get_all("Requires-Dist") or [] if _applies(r, test_extras) is not None]
        for e in msg.get_all("Provides-Extra") or []:  # the other extras, for the optional imports below
            extras.setdefault(e, []).extend(r for r in msg.get_all("Requires-Dist") or []
                                            if _applies(r, []) is None and _applies(r, [e]) is not None)  # fmt: skip
    for rel in REQUIREMENT_FILES:
        if (root / rel).is_file():
            base += _requirements_file(root / rel)
    specs = [*base, *(s for e in wanted for s in extras.get(e, []))]
    # An optional dependency the tests import (tabulate's `widechars` extra, wcwidth): its tests run with it.
    imported = test_imports(root)
    specs += [a for e, vs in extras.items() if e not in wanted for v in vs
              if _requirement_name(v).replace("-", "_") in imported and (a := _applies(v, [e])) is not None]  # fmt: skip
    own = _requirement_name(name) if name else ""
    out: dict[str, str] = {}
    for spec in specs:
        applied = _applies(spec, wanted)
        if applied is None:
            continue
        key = _requirement_name(applied)
        if key and key != own and not TOOLING.match(key):
            out.setdefault(key, applied)
    return sorted(out.values())


def installed_distributions(env: Path) -> list[str]:
    """``name==version`` of every distribution in a built environment (what the build resolved to)."""
    return sorted(p.name.removesuffix(".dist-info").replace("-", "==", 1) for p in Path(env).glob("*.dist-info"))
