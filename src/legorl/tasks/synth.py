"""``legorl tasks synth``: SWE-bench-style tasks mined from real Python packages by planting bugs.

For each package (``NAME==VERSION`` from PyPI, or a local sdist / source directory):

1. fetch the sdist (source only, sha256 checked against PyPI) and unpack it;
2. snapshot it as a git repository under ``OUT/repos/NAME-VERSION`` (commit ``pristine`` on ``main``);
3. build its task environment once (``OUT/envs/NAME-VERSION``): what its tests need beyond the
   standard library (``envs.suite_requirements``, ``pip install --target``) and the test runner, this
   interpreter's pytest, copied. It is read-only on ``PYTHONPATH`` in every test run here and in every
   sandbox of its tasks (rows name it in ``environment``), and every test run, here and in the
   grader, is ``python -S -m pytest``: the standard library and the environment, no site-packages, so
   a task's tests see the same modules on bwrap and in a container. A build that fails or times out
   is the package's typed error, not a crash (``SynthConfig.environments=False``: the old way, this
   interpreter's site-packages, which another backend's Python does not have);
4. run its own test suite twice (``synth_runner``): the tests passing both times, one result per
   phase, in files that collect cleanly, are usable; the first run records which tests execute
   which source lines;
5. take candidate bugs (``mutate.py``) on lines some test executes, in a seeded order that
   alternates operators, and for each run the test files that execute the line: keep it when at
   least one usable test fails, the failing tests live in at most ``max_hidden_files`` files, the
   failure reproduces when only those files run, and the pristine sources pass them again;
6. write the task: its base commit (the buggy sources without the hidden test files, tagged
   with the instance id in the snapshot), the gold ``patch`` (the reverse of the bug), the
   ``test_patch`` adding the hidden test files back, ``FAIL_TO_PASS`` (the failing tests),
   ``PASS_TO_PASS`` (the other usable tests of those files) and a ``problem_statement`` written
   from the failing tests' output (test names, the test's own frames and the error, never a
   frame of the library: no file, line or code of the bug).

Nothing here imports the grader: ``legorl tasks synth`` (the CLI layer) runs ``legorl tasks
validate``'s checks on the tasks this module keeps.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import random
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path, PurePosixPath
from typing import Any

from legorl.tasks.envs import build_environment, installed_distributions, suite_requirements
from legorl.tasks.mutate import Mutation, find_mutations, mutant_ok
from legorl.tasks.repo import GIT_OPTS, git_env
from legorl.tasks.schema import TaskError
from legorl.tasks.synth_runner import Runner, TestRun

PYPI = "https://pypi.org/pypi"
# Mirrors legorl.grading.policy (which tasks may not import): files the grader never takes from a
# diff. A bug is never planted in one, and only such files hold tests.
TEST_DIRS = {"tests", "test", "testing"}
TEST_GLOBS = ("test_*.py", "*_test.py", "conftest.py", "setup.py", "noxfile.py", "sitecustomize.py",
              "usercustomize.py")  # fmt: skip
NOT_SOURCE_DIRS = {"docs", "doc", "examples", "example", "benchmark", "benchmarks", "bench", "scripts", "tools",
                   "build", "dist", ".tox", ".nox", ".git", "__pycache__", "site-packages", ".eggs"}  # fmt: skip
NOT_SOURCE_FILES = {"versioneer.py", "_version.py", "__main__.py", "conf.py", "setup.py"}
REJECT_REASONS = (
    "no_test_fails", "breaks_other_tests", "breaks_collection", "timeout", "crash", "syntax", "equivalent",
    "duplicate", "not_reproducible", "gold_fails", "validation",
)  # fmt: skip


@dataclass
class PackageSource:
    name: str
    version: str
    root: Path  # unpacked sources
    origin: str  # "pypi:NAME==VERSION" or the local path

    @property
    def slug(self) -> str:
        return f"{normalize(self.name)}-{self.version}"


@dataclass
class SynthConfig:
    n: int = 20  # tasks per package (at most)
    seed: int = 0
    max_attempts: int = 0  # mutants run per package (0: 8 x n)
    max_hidden_files: int = 2
    max_fail_to_pass: int = 40
    timeout: float = 120.0  # seconds for one test run of a mutant (shorter when the suite is fast)
    baseline_timeout: float = 900.0
    heldout_fraction: float = 0.0
    operators: tuple[str, ...] | None = None
    environments: bool = True  # build each package's task environment (its test dependencies) once
    env_timeout: float = 600.0  # seconds for one environment build
    env_pip_args: tuple[str, ...] = ()  # e.g. an index or --no-index --find-links DIR


@dataclass
class PackageResult:
    source: PackageSource
    rows: list[dict[str, Any]] = field(default_factory=list)
    rejected: Counter = field(default_factory=Counter)
    candidates: int = 0
    uncovered: int = 0
    tried: int = 0
    usable_tests: int = 0
    baseline_s: float = 0.0
    seconds: float = 0.0  # fetching, baseline and mutants
    validate_s: float = 0.0  # the `legorl tasks validate` checks (set by the command)
    error: str = ""
    requirements: list[str] = field(default_factory=list)  # what its tests need (legorl.tasks.envs)
    environment: list[str] = field(default_factory=list)  # what the build installed (name==version)
    environment_s: float = 0.0


Progress = Callable[[str, dict[str, Any]], None]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- fetching and unpacking ---------------------------------------------------------------------


def _pypi_json(url: str, timeout: float) -> tuple[dict, str]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r), r.geturl()


def fetch_sdist(name: str, version: str, cache: Path, timeout: float = 120.0) -> Path:
    """Download NAME==VERSION's sdist from PyPI (source only) into ``cache``; checks its sha256.

    Reads ``/pypi/NAME/VERSION/json``, or the release list of ``/pypi/NAME/json`` where a mirror
    serves only that; file URLs may be relative to the JSON's address (mirrors)."""
    q = urllib.parse.quote
    try:
        try:
            meta, base = _pypi_json(f"{PYPI}/{q(name)}/{q(version)}/json", timeout)
            files = meta.get("urls", [])
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
            meta, base = _pypi_json(f"{PYPI}/{q(name)}/json", timeout)
            if version not in meta.get("releases", {}):
                known = list(meta.get("releases", {}))[-8:]
                raise TaskError(
                    f"{name}=={version}: PyPI has no release {version} (latest: {known})"
                ) from None
            files = meta["releases"][version]
    except TaskError:
        raise
    except Exception as e:
        raise TaskError(f"{name}=={version}: cannot read PyPI's JSON API at {PYPI}: {e}") from e
    sdists = [u for u in files if u.get("packagetype") == "sdist"]
    if not sdists:
        raise TaskError(f"{name}=={version}: PyPI has no sdist (source distribution) for this release")
    info = sdists[0]
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / info["filename"]
    want = info.get("digests", {}).get("sha256")
    if dest.is_file() and (not want or hashlib.sha256(dest.read_bytes()).hexdigest() == want):
        return dest
    try:
        with urllib.request.urlopen(urllib.parse.urljoin(base, info["url"]), timeout=timeout) as r:
            data = r.read()
    except Exception as e:
        raise TaskError(f"{name}=={version}: cannot download {info['url']}: {e}") from e
    if want and hashlib.sha256(data).hexdigest() != want:
        raise TaskError(f"{name}=={version}: sha256 of {info['filename']} does not match PyPI's")
    tmp = dest.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(dest)
    return dest


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack a .tar.gz / .tar.bz2 / .zip sdist into ``dest``; returns its single top-level dir."""
    dest.mkdir(parents=True, exist_ok=True)
    name = archive.name
    if name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for member in zf.namelist():
                p = PurePosixPath(member)
                if p.is_absolute() or ".." in p.parts:
                    raise TaskError(f"{archive}: unsafe member {member!r}")
            zf.extractall(dest)
    elif name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tar", ".tar.xz")):
        with tarfile.open(archive) as tf:
            tf.extractall(dest, filter="data")
    else:
        raise TaskError(f"{archive}: not an sdist (.tar.gz, .zip)")
    entries = [p for p in dest.iterdir()]
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest


def _metadata(root: Path) -> tuple[str | None, str | None]:
    pkg_info = root / "PKG-INFO"
    if pkg_info.is_file():
        msg = email.parser.Parser().parsestr(pkg_info.read_text(errors="replace"))
        if msg.get("Name") and msg.get("Version"):
            return msg["Name"], msg["Version"]
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        try:
            project = tomllib.loads(pyproject.read_text()).get("project", {})
        except tomllib.TOMLDecodeError:
            project = {}
        if project.get("name"):
            return project["name"], str(project.get("version") or "0")
    return None, None


def resolve_source(spec: str, work: Path, cache: Path) -> PackageSource:
    """``NAME==VERSION`` (PyPI), a local sdist file or a source directory, unpacked under ``work``."""
    path = Path(spec)
    if path.exists():
        if path.is_dir():
            root = work / "src"
            shutil.copytree(path, root, symlinks=True,
                            ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".tox", ".nox", ".pytest_cache"))  # fmt: skip
        else:
            root = unpack(path, work / "src")
        name, version = _metadata(root)
        if not name:
            stem = path.name.removesuffix(".tar.gz").removesuffix(".zip") if path.is_file() else path.name
            m = re.fullmatch(r"(.+?)-(\d[\w.+!-]*)", stem)
            name, version = (m[1], m[2]) if m else (stem, "0")
        return PackageSource(name, version or "0", root, str(path.resolve()))
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9][A-Za-z0-9.+!_-]*)\s*", spec)
    if not m:
        raise TaskError(
            f"--package {spec!r}: expected NAME==VERSION (an exact pin), a local sdist or a directory"
        )
    archive = fetch_sdist(m[1], m[2], cache)
    root = unpack(archive, work / "src")
    return PackageSource(m[1], m[2], root, f"pypi:{m[1]}=={m[2]}")


# ---- layout ---------------------------------------------------------------------------------------


def is_test_path(rel: str) -> bool:
    p = PurePosixPath(rel)
    return any(part in TEST_DIRS for part in p.parts[:-1]) or any(fnmatch(p.name, g) for g in TEST_GLOBS)


def _excluded_dir(rel: PurePosixPath) -> bool:
    return any(part in NOT_SOURCE_DIRS or part.endswith(".egg-info") for part in rel.parts[:-1])


def find_test_files(root: Path) -> list[str]:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = PurePosixPath(p.relative_to(root).as_posix())
        if _excluded_dir(rel) or p.is_symlink():
            continue
        if fnmatch(rel.name, "test_*.py") or fnmatch(rel.name, "*_test.py"):
            out.append(str(rel))
    return out


def find_source_files(root: Path) -> list[str]:
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = PurePosixPath(p.relative_to(root).as_posix())
        if _excluded_dir(rel) or is_test_path(str(rel)) or rel.name in NOT_SOURCE_FILES or p.is_symlink():
            continue
        out.append(str(rel))
    return out


def pytest_args(root: Path) -> list[str]:
    """Options for the package's suite: its ini ``addopts`` off (they name plugins and coverage
    options that are not installed), ``src`` on the path for src layouts."""
    args = ["-o", "addopts="]
    src = root / "src"
    if src.is_dir() and any((c / "__init__.py").is_file() or c.suffix == ".py" for c in src.iterdir()):
        args += ["-o", "pythonpath=src"]
    return args


def pytest_command(args: list[str], isolated: bool = False) -> str:
    """The task's test command; ``isolated``: its environment carries pytest, and ``-S`` keeps every
    site-packages dir out (the interpreter's, a venv's, an image's), on either backend."""
    return " ".join(["python -S -m pytest -q" if isolated else "python -m pytest -q", *args])


# ---- git snapshot ---------------------------------------------------------------------------------


def _git(repo: Path, *args: str, input: bytes | None = None, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        ["git", *GIT_OPTS, *args], cwd=repo, env={**git_env(repo), **(env or {})}, input=input,
        capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise TaskError(
            f"git {' '.join(args)} failed in {repo}: {proc.stderr.decode(errors='replace')[-800:]}"
        )
    return proc.stdout.decode("utf-8", errors="replace")


def make_snapshot(source: PackageSource, repo: Path) -> str:
    """OUT/repos/NAME-VERSION: a git repository whose ``main`` is one commit of the pristine sources."""
    if repo.exists():
        shutil.rmtree(repo)
    shutil.copytree(source.root, repo, symlinks=True)
    for p in sorted(repo.rglob(".git"), key=lambda p: len(p.parts), reverse=True):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    _git(repo, "init", "-q")
    _git(repo, "add", "-A", "--force")
    _git(repo, "commit", "-q", "--no-verify", "-m", f"{source.name} {source.version}: pristine sdist")
    return _git(repo, "rev-parse", "HEAD").strip()


def commit_task(repo: Path, pristine: str, rel: str, mutated: str, hidden: list[str], tag: str) -> str:
    """An orphan commit of the pristine tree with ``rel`` replaced by ``mutated`` and the hidden
    test files removed, tagged ``tag``; returns its sha (deterministic: fixed identity and date)."""
    with tempfile.TemporaryDirectory(prefix="legorl-synth-index-") as d:
        env = {"GIT_INDEX_FILE": str(Path(d) / "index")}
        _git(repo, "read-tree", pristine, env=env)
        mode = _git(repo, "ls-tree", pristine, "--", rel).split()[0]
        blob = _git(repo, "hash-object", "-w", "--stdin", input=mutated.encode("utf-8")).strip()
        _git(repo, "update-index", "--cacheinfo", f"{mode},{blob},{rel}", env=env)
        _git(repo, "update-index", "--force-remove", "--", *hidden, env=env)
        tree = _git(repo, "write-tree", env=env).strip()
    sha = _git(repo, "commit-tree", tree, "-m", tag).strip()
    _git(repo, "update-ref", f"refs/tags/{tag}", sha)
    return sha


def diff(repo: Path, a: str, b: str, paths: list[str]) -> str:
    return _git(
        repo, "diff", "--no-color", "--no-ext-diff", "--no-renames", "--full-index", a, b, "--", *paths
    )


# ---- problem statements ---------------------------------------------------------------------------

_ADDR = re.compile(r"0x[0-9a-fA-F]{6,}")
_LOC = re.compile(r"(\.py)(?::\d+|\", line \d+)")


def _scrub(text: str, root: Path) -> str:
    text = text.replace(str(root) + "/", "").replace(str(root), ".")
    return _LOC.sub(r"\1", _ADDR.sub("0x...", text))


def failure_excerpt(detail: dict, test_file: str, root: Path, max_lines: int = 30) -> list[str]:
    """The failing test's own frames and the error: never a frame outside the test file (the
    library's frames would show the bug's file, line and code)."""
    lines: list[str] = []
    entries = detail.get("entries") or []
    for e in entries:
        path = e.get("path", "")
        rel = path[len(str(root)) + 1 :] if path.startswith(str(root) + "/") else path
        if rel == test_file:
            lines += [ln for ln in e.get("lines", []) if ln.strip()]
    errors = [ln for ln in (entries[-1].get("lines", []) if entries else []) if ln.startswith("E ")]
    if entries and entries[-1].get("path", "").endswith(test_file):
        errors = []  # already shown with the test's frame
    lines += errors
    if not any(ln.startswith("E ") for ln in lines):
        crash = detail.get("crash") or ""
        if crash:
            lines += [f"E   {ln}" for ln in crash.splitlines()[:6]]
        elif detail.get("text"):
            lines += [ln for ln in detail["text"].splitlines() if ln.startswith("E ")][:8]
    if len(lines) > max_lines:
        lines = lines[: max_lines // 3] + ["    ..."] + lines[-(max_lines - max_lines // 3 - 1) :]
    return [_scrub(ln, root).rstrip() for ln in lines]


def problem_statement(source: PackageSource, run: TestRun, f2p: list[str], root: Path, shown: int = 3) -> str:
    n = len(f2p)
    out = [
        f"{source.name} {source.version}: {n} test{'s' if n != 1 else ''} of the package's own test suite "
        + ("fail." if n != 1 else "fails."),
        "",
        "Failing:",
        "",
        *[f"    {t}" for t in f2p[:20]],
        *([f"    ... and {n - 20} more"] if n > 20 else []),
    ]
    picked: list[str] = []
    for t in f2p:  # distinct test functions first
        if len(picked) < shown and t.split("[")[0] not in {p.split("[")[0] for p in picked}:
            picked.append(t)
    picked += [t for t in f2p if t not in picked][: shown - len(picked)]
    for t in picked:
        excerpt = failure_excerpt(run.tests[t].detail if t in run.tests else {}, t.split("::")[0], root)
        if excerpt:
            out += ["", f"`{t}` fails with:", "", *[f"    {ln}" for ln in excerpt]]
    out += ["", "The tests are right: fix the library so that they pass, without breaking its other tests."]
    return "\n".join(out) + "\n"


# ---- the search -----------------------------------------------------------------------------------


@dataclass
class _Baseline:
    usable: set[str]  # passing twice, one result per phase, in a usable file
    files: list[str]  # usable test files
    file_seconds: dict[str, float]
    cover: dict[str, dict[int, list[int]]]
    order: list[str]


def _baseline(runner: Runner, root: Path, tests: list[str], args: list[str], srcs: list[str], cfg: SynthConfig,
              ) -> _Baseline:  # fmt: skip
    # A file that cannot be collected (a missing dependency) is left out, not the whole suite.
    args = [*args, "--continue-on-collection-errors"]
    plain = runner.run(root, tests, timeout=cfg.baseline_timeout, pytest_args=args)
    if plain.timed_out or not plain.complete:
        raise TaskError(
            f"the test suite did not finish in {cfg.baseline_timeout:.0f} s: {plain.output[-600:]}"
        )
    # Tracing makes a suite several times slower; a package far slower than that is not worth mining.
    limit = min(cfg.baseline_timeout, max(120.0, 40 * plain.duration))
    traced = runner.run(root, tests, timeout=limit, pytest_args=args, trace=[root / s for s in srcs])
    if traced.timed_out or not traced.complete:
        raise TaskError(
            f"the test suite with line tracing did not finish in {limit:.0f} s (untraced: {plain.duration:.0f} s); "
            f"{'timed out' if traced.timed_out else traced.output[-600:]}"
        )
    bad_files = {e["nodeid"].split("::")[0] for e in (*traced.errors, *plain.errors)}
    for run in (traced, plain):
        bad_files |= {t.split("::")[0] for t, r in run.tests.items() if r.multi}
    # A parameter id holding "::" (`test_x[ldap://[::1]]`) is not mapped back from JUnit by the grader.
    usable = {
        t
        for t in traced.passed & plain.passed
        if t.split("::")[0] not in bad_files and "::" not in t.partition("[")[2]
    }
    files = sorted({t.split("::")[0] for t in usable})
    secs: Counter = Counter()
    for t, r in plain.tests.items():
        secs[t.split("::")[0]] += r.duration
    if not usable:
        raise TaskError(
            f"no test passes (errors: {[e['nodeid'] for e in traced.errors][:5]}): {plain.output[-600:]}"
        )
    return _Baseline(usable, files, dict(secs), traced.cover, traced.order)


def _order(cands: list[Mutation], rng: random.Random) -> list[Mutation]:
    """Seeded shuffle, then round-robin over operators so that every operator gets tried early."""
    by_op: dict[str, list[Mutation]] = {}
    for m in cands:
        by_op.setdefault(m.operator, []).append(m)
    ops = sorted(by_op)
    for op in ops:
        rng.shuffle(by_op[op])
    rng.shuffle(ops)
    out: list[Mutation] = []
    while any(by_op.values()):
        for op in ops:
            if by_op[op]:
                out.append(by_op[op].pop())
    return out


def _edit_lines(m: Mutation, text: bytes) -> range:
    first = text.count(b"\n", 0, min(s for s, _, _ in m.edits)) + 1
    last = text.count(b"\n", 0, max(e for _, e, _ in m.edits)) + 1
    return range(min(first, m.line), max(last, m.line) + 1)


def _covering_files(m: Mutation, text: bytes, base: _Baseline) -> list[str] | None:
    """Test files whose usable tests execute the mutated lines (every usable file when a line runs
    only at import); None when no test executes them."""
    lines = base.cover.get(m.path, {})
    ctxs: set[int] = set()
    for ln in _edit_lines(m, text):
        ctxs.update(lines.get(ln, []))
    if not ctxs:
        return None
    files = {
        base.order[c].split("::")[0]
        for c in ctxs
        if 0 <= c < len(base.order) and base.order[c] in base.usable
    }
    if -1 in ctxs and not files:
        return list(base.files)
    return sorted(files) or None


@dataclass
class _Verdict:
    mutation: Mutation
    reason: str = ""  # a REJECT_REASONS entry, or "" when kept
    f2p: list[str] = field(default_factory=list)
    p2p: list[str] = field(default_factory=list)
    hidden: list[str] = field(default_factory=list)
    run: TestRun | None = None
    mutated: str = ""


def _try(m: Mutation, original: str, work: Path, files: list[str], base: _Baseline, runner: Runner, args: list[str],
         cfg: SynthConfig) -> _Verdict:  # fmt: skip
    v = _Verdict(m)
    mutated = m.apply(original)
    if (why := mutant_ok(original, mutated)) is not None:
        v.reason = why
        return v
    v.mutated = mutated
    target = work / m.path
    expected = sum(base.file_seconds.get(f, 0.0) for f in files)
    timeout = min(cfg.timeout, 15.0 + 5 * expected)
    target.write_text(mutated, encoding="utf-8")
    try:
        run = runner.run(work, files, timeout=timeout, pytest_args=args)
        if run.timed_out:
            v.reason = "timeout"
            return v
        if not run.complete:
            v.reason = "crash"
            return v
        if run.errors:
            v.reason = "breaks_collection"
            return v
        ran = {t for t in base.usable if t.split("::")[0] in files}
        if ran - set(run.tests):  # a test no longer collected (a parametrization changed): not a clean bug
            v.reason = "breaks_collection"
            return v
        failing = sorted(t for t in ran if run.tests[t].outcome != "passed")
        if not failing:
            v.reason = "no_test_fails"
            return v
        hidden = sorted({t.split("::")[0] for t in failing})
        if len(hidden) > cfg.max_hidden_files or len(failing) > cfg.max_fail_to_pass:
            v.reason = "breaks_other_tests"
            return v
        in_hidden = {t for t in base.usable if t.split("::")[0] in hidden}
        alone = run
        if hidden != sorted(files):  # the grader runs the hidden files alone: the bug must show the same way
            alone = runner.run(work, hidden, timeout=timeout, pytest_args=args)
            failing_alone = sorted(t for t in in_hidden
                                   if alone.tests.get(t) is None or alone.tests[t].outcome != "passed")  # fmt: skip
            lost = in_hidden - set(alone.tests)
            if alone.timed_out or not alone.complete or alone.errors or lost or failing_alone != failing:
                v.reason = "not_reproducible"
                return v
    finally:
        target.write_text(original, encoding="utf-8")
    if hidden != base.files:  # else the baseline runs were exactly this run on the pristine sources
        gold = runner.run(work, hidden, timeout=timeout, pytest_args=args)
        if gold.timed_out or not gold.complete or not in_hidden <= gold.passed:
            v.reason = "gold_fails"
            return v
    v.f2p, v.p2p, v.hidden, v.run = failing, sorted(in_hidden - set(failing)), hidden, alone
    return v


def synthesize_package(
    spec: str, out: Path, cfg: SynthConfig, *, runner: Runner, cache: Path, progress: Progress | None = None
) -> PackageResult:
    """Mine up to ``cfg.n`` tasks from one package into ``out`` (snapshot under ``out/repos``);
    returns the rows (not yet written to ``out/tasks.jsonl``) and the rejection counts."""
    t0 = time.monotonic()
    emit = progress or (lambda kind, info: None)
    with tempfile.TemporaryDirectory(prefix="legorl-synth-") as tmp_s:
        tmp = Path(tmp_s)
        source = resolve_source(spec, tmp, cache)
        result = PackageResult(source)
        emit("package", {"name": source.slug})
        try:
            _search(source, out, cfg, runner, tmp, result, emit)
        except TaskError as e:
            result.error = str(e)
        except Exception as e:  # noqa: BLE001 - one package's failure must not end a run over many
            result.error = f"{type(e).__name__}: {e}"[:500]
        result.seconds = time.monotonic() - t0
        return result


def _search(source: PackageSource, out: Path, cfg: SynthConfig, runner: Runner, tmp: Path, result: PackageResult,
            emit: Callable[[str, dict[str, Any]], None]) -> None:  # fmt: skip
    root = source.root
    tests, srcs, args = find_test_files(root), find_source_files(root), pytest_args(root)
    if not tests:
        raise TaskError(f"{source.slug}: the sdist ships no test files (test_*.py / *_test.py)")
    work = tmp / "work"
    shutil.copytree(root, work, symlinks=True)
    env_rel = None
    result.requirements = suite_requirements(root, source.name) if cfg.environments else []
    if cfg.environments:  # built once; every test run here and every sandbox of its tasks sees it, nothing else
        emit("stage", {"stage": "environment"})
        t = time.monotonic()
        env = build_environment(result.requirements, out / "envs" / source.slug, timeout=cfg.env_timeout,
                                pip_args=cfg.env_pip_args, runner=True)  # fmt: skip
        result.environment_s, result.environment = time.monotonic() - t, installed_distributions(env)
        runner, env_rel = runner.with_environment(env), f"envs/{source.slug}"
    emit("stage", {"stage": "baseline"})
    t = time.monotonic()
    base = _baseline(runner, work, tests, args, srcs, cfg)
    result.baseline_s, result.usable_tests = time.monotonic() - t, len(base.usable)
    texts: dict[str, str] = {}
    cands: list[Mutation] = []
    for rel in srcs:
        if rel not in base.cover:
            continue
        try:
            text = (work / rel).read_text(encoding="utf-8")
            found = find_mutations(text, rel, cfg.operators)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        texts[rel] = text
        cands += found
    result.candidates = len(cands)
    rng = random.Random(f"{cfg.seed}:{source.slug}")
    plan: list[tuple[Mutation, list[str]]] = []
    for m in _order(cands, rng):
        files = _covering_files(m, texts[m.path].encode("utf-8"), base)
        if files is None:
            result.uncovered += 1
        else:
            plan.append((m, files))
    budget = cfg.max_attempts or 8 * cfg.n
    repo = out / "repos" / source.slug
    pristine = make_snapshot(source, repo)
    seen_sources: set[str] = set()
    kept_lines: set[tuple[str, int]] = set()
    emit("stage", {"stage": "mutants", "total": min(budget, len(plan))})
    for m, files in plan:
        if len(result.rows) >= cfg.n or result.tried >= budget:
            break
        if (m.path, m.line) in kept_lines:
            result.rejected["duplicate"] += 1
            continue
        mutated = m.apply(texts[m.path])
        digest = hashlib.sha256(f"{m.path}\0{mutated}".encode()).hexdigest()
        if digest in seen_sources:
            result.rejected["duplicate"] += 1
            continue
        seen_sources.add(digest)
        result.tried += 1
        v = _try(m, texts[m.path], work, files, base, runner, args, cfg)
        if v.reason:
            result.rejected[v.reason] += 1
            emit("tried", {"kept": False, "reason": v.reason})
            continue
        kept_lines.add((m.path, m.line))
        result.rows.append(_row(source, repo, pristine, v, work, cfg, env_rel, runner.isolated))
        emit("tried", {"kept": True, "reason": ""})
    if not result.rows:
        shutil.rmtree(repo, ignore_errors=True)


def _row(
    source: PackageSource, repo: Path, pristine: str, v: _Verdict, work: Path, cfg: SynthConfig, env: str | None,
    isolated: bool = False,
) -> dict[str, Any]:
    m = v.mutation
    iid = f"{normalize(source.name)}-{source.version}__{m.key}"
    base = commit_task(repo, pristine, m.path, v.mutated, v.hidden, iid)
    assert v.run is not None
    heldout = int(hashlib.sha256(iid.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < cfg.heldout_fraction
    return {
        "instance_id": iid,
        "repo": f"pypi/{normalize(source.name)}",
        "base_commit": base,
        "patch": diff(repo, base, pristine, [m.path]),
        "test_patch": diff(repo, base, pristine, v.hidden),
        "problem_statement": problem_statement(source, v.run, v.f2p, work),
        "hints_text": "",
        "created_at": "",
        "version": source.version,
        "environment_setup_commit": pristine,
        "FAIL_TO_PASS": json.dumps(v.f2p),
        "PASS_TO_PASS": json.dumps(v.p2p),
        "repo_path": f"repos/{source.slug}",
        "test_command": pytest_command(pytest_args(work), isolated=isolated),
        **({"environment": env} if env else {}),  # relative to the tasks file, as repo_path
        "family": f"synth-{m.operator}",
        "split": "heldout" if heldout else "train",
        "synth": {
            "operator": m.operator,
            "file": m.path,
            "line": m.line,
            "description": m.description,
            "source": source.origin,
            "seed": cfg.seed,
        },
    }


# ---- output ---------------------------------------------------------------------------------------


def write_rows(out: Path, results: list[PackageResult]) -> Path:
    """Write ``out/tasks.jsonl``: rows of these packages replace their earlier rows; other packages'
    rows already there are kept. Sorted, so the file is the same for the same seed."""
    path = out / "tasks.jsonl"
    repos = {r.source.slug for r in results}
    rows: list[dict[str, Any]] = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                if PurePosixPath(str(row.get("repo_path", ""))).name not in repos:
                    rows.append(row)
    for r in results:
        rows += r.rows
    rows.sort(key=lambda r: (r.get("repo", ""), r["instance_id"]))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return path


def add_environments(out: Path, cfg: SynthConfig, progress: Progress | None = None) -> dict[str, list[str]]:
    """Rows of ``out/tasks.jsonl`` mined without an environment carrying pytest (before environments, or
    with ``environments=False``): build their package's environment from its snapshot as mining now does
    and switch their test command to ``python -S``. Returns {package: what the build installed}. The rows'
    tests and verdicts are not re-derived: run ``legorl tasks validate OUT/tasks.jsonl --drop-failing``
    afterwards, which drops a row whose bug no longer shows in its new environment."""
    from legorl.tasks.envs import has_runner

    path = out / "tasks.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    built_for: dict[str, list[str]] = {}
    for row in rows:
        slug = PurePosixPath(str(row["repo_path"])).name
        if row.get("environment") and has_runner(out / row["environment"]):
            continue
        if slug not in built_for:
            root = out / row["repo_path"]
            name, _ = _metadata(root)
            if progress:
                progress("environment", {"name": slug})
            env = build_environment(suite_requirements(root, name or ""), out / "envs" / slug,
                                    timeout=cfg.env_timeout, pip_args=cfg.env_pip_args, runner=True)  # fmt: skip
            built_for[slug] = installed_distributions(env)
        row["environment"] = f"envs/{slug}"
        words = str(row.get("test_command") or "python -m pytest -q").split()
        if words[:3] == ["python", "-m", "pytest"]:
            row["test_command"] = " ".join(["python", "-S", *words[1:]])
        else:
            raise TaskError(f"{row['instance_id']}: test command {row.get('test_command')!r} is not `python -m pytest ...`")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)
    return built_for


def summary(results: list[PackageResult]) -> dict[str, Any]:
    return {
        "packages": [
            {
                "package": r.source.slug,
                "origin": r.source.origin,
                "kept": len(r.rows),
                "tried": r.tried,
                "candidates": r.candidates,
                "uncovered": r.uncovered,
                "usable_tests": r.usable_tests,
                "rejected": dict(sorted(r.rejected.items())),
                "baseline_s": round(r.baseline_s, 1),
                "seconds": round(r.seconds, 1),
                "validate_s": round(r.validate_s, 1),
                "requirements": r.requirements,
                "environment": r.environment,
                "environment_s": round(r.environment_s, 1),
                "error": r.error,
            }
            for r in results
        ],
        "kept": sum(len(r.rows) for r in results),
        "rejected": dict(sorted(sum((r.rejected for r in results), Counter()).items())),
    }


__all__ = [
    "PackageResult", "PackageSource", "SynthConfig", "add_environments", "fetch_sdist", "make_snapshot", "problem_statement",
    "resolve_source", "summary", "synthesize_package", "unpack", "write_rows",
]  # fmt: skip
