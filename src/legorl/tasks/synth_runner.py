"""Run a package's own pytest suite for ``legorl tasks synth``: once to find the passing tests
(and which tests execute which source lines), then once per candidate bug.

The suite is foreign code, so every run is time-limited (the whole process group is killed at
the deadline), niced, memory-limited and, where ``bwrap`` works, sandboxed: a read-only view of
the system dirs and the Python runtime only, the repository copy and a control dir writable, a
private ``/tmp``, no network and its own pid namespace. ``sandbox="none"`` (or ``auto`` on a host
without a working bubblewrap) keeps only the limits. A package's task environment
(``with_environment``) is on ``PYTHONPATH``, read-only, as in the grader's sandboxes; one that carries
its own pytest (``envs.has_runner``) is run with ``python -S``, as its tasks' test command does: the
standard library and the environment only, never this interpreter's site-packages.

Results come from a small pytest plugin (stdlib + pytest only) that writes one JSON file: every
test's outcome (a test passes when setup, call and teardown all pass), the failure's traceback
entries (for the problem statement), collection errors, tests with several results per phase
(subtests: legorl's grader refuses duplicate results) and, on request, line coverage per test
from ``sys.settrace`` restricted to the package's source files.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN_NAME = "legorl_synth_plugin"
PLUGIN_SOURCE = r"""
import json, os, sys, threading
import pytest

_OUT = os.environ["LEGORL_SYNTH_OUT"]
_TRACE = os.environ.get("LEGORL_SYNTH_TRACE")
_tests = {}
_phases = {}
_errors = []
_order = []
_ctx = [-1]
_hits = set()
_known = {}


def _entries(longrepr):
    out = {"crash": "", "entries": [], "text": ""}
    tb = getattr(longrepr, "reprtraceback", None)
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None:
        out["crash"] = str(getattr(crash, "message", ""))[:2000]
    if tb is not None:
        for e in getattr(tb, "reprentries", [])[-8:]:
            loc = getattr(e, "reprfileloc", None)
            out["entries"].append({
                "path": str(getattr(loc, "path", "")) if loc is not None else "",
                "lines": [str(x) for x in getattr(e, "lines", [])][-40:],
            })
    else:
        out["text"] = str(longrepr)[-3000:]
    return out


def pytest_collectreport(report):
    if report.failed:
        _errors.append({"nodeid": report.nodeid, "text": str(report.longrepr)[-2000:]})


def pytest_runtest_logreport(report):
    key = (report.nodeid, report.when)
    _phases[key] = _phases.get(key, 0) + 1
    r = _tests.get(report.nodeid)
    if r is None:
        r = _tests[report.nodeid] = {"outcome": "passed", "phases": [], "duration": 0.0, "multi": False}
        _order.append(report.nodeid)
    if _phases[key] > 1:
        r["multi"] = True
    r["phases"].append(report.when)
    r["duration"] += float(getattr(report, "duration", 0.0) or 0.0)
    if hasattr(report, "wasxfail"):
        r["outcome"] = "xfail"
    elif report.failed:
        if r["outcome"] != "failed":
            r["outcome"] = "failed"
            r["when"] = report.when
            r["detail"] = _entries(report.longrepr)
    elif report.skipped and r["outcome"] == "passed":
        r["outcome"] = "skipped"


def _local(frame, event, arg):
    if event == "line":
        _hits.add((frame.f_code.co_filename, frame.f_lineno, _ctx[0]))
    return _local


def _global(frame, event, arg):
    name = frame.f_code.co_filename
    hit = _known.get(name)
    if hit is None:
        hit = _known[name] = os.path.realpath(name) in _sources
    if hit:
        _hits.add((name, frame.f_lineno, _ctx[0]))
        return _local
    return None


_sources = set()
if _TRACE:
    with open(_TRACE) as f:
        _sources = {os.path.realpath(p) for p in json.load(f)}
    sys.settrace(_global)
    threading.settrace(_global)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _ctx[0] = len(_order) if item.nodeid not in _tests else _order.index(item.nodeid)
    if item.nodeid not in _tests:
        _tests[item.nodeid] = {"outcome": "passed", "phases": [], "duration": 0.0, "multi": False}
        _order.append(item.nodeid)
    yield
    _ctx[0] = -1


def pytest_unconfigure(config):
    if _TRACE:
        sys.settrace(None)
        threading.settrace(None)
    for nodeid, r in _tests.items():
        if r["outcome"] == "passed" and sorted(set(r["phases"])) != ["call", "setup", "teardown"]:
            r["outcome"] = "incomplete"
    cover = {}
    for name, line, ctx in _hits:
        cover.setdefault(os.path.realpath(name), {}).setdefault(str(line), []).append(ctx)
    tmp = _OUT + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"tests": _tests, "order": _order, "errors": _errors, "cover": cover}, f)
    os.replace(tmp, _OUT)
"""


@dataclass
class TestResult:
    outcome: str  # passed | failed | skipped | xfail | incomplete
    duration: float = 0.0
    multi: bool = False  # several results for one phase (subtests)
    when: str = ""
    detail: dict = field(default_factory=dict)


@dataclass
class TestRun:
    tests: dict[str, TestResult]
    errors: list[dict]  # collection errors: {"nodeid", "text"}
    returncode: int
    timed_out: bool
    duration: float
    output: str
    cover: dict[str, dict[int, list[int]]] = field(
        default_factory=dict
    )  # relpath -> line -> test indices (-1: none)
    order: list[str] = field(default_factory=list)

    @property
    def passed(self) -> set[str]:
        return {t for t, r in self.tests.items() if r.outcome == "passed"}

    @property
    def failed(self) -> set[str]:
        return {t for t, r in self.tests.items() if r.outcome == "failed"}

    complete: bool = False  # the plugin wrote its results (pytest reached its end)


def _system_binds() -> list[str]:
    args: list[str] = []
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    roots: list[str] = []
    for p in (
        sys.base_prefix,
        sys.prefix,
        os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))),
    ):
        real = os.path.realpath(p)
        if (
            real not in roots
            and not any(real.startswith(r + "/") for r in roots)
            and real.split("/")[1:2] not in (["usr"], ["etc"])
        ):
            roots.append(real)
    for r in roots:
        args += ["--ro-bind", r, r]
    if os.path.realpath(sys.prefix) != sys.prefix:  # a venv reached through a symlink
        args += ["--symlink", os.path.realpath(sys.prefix), sys.prefix]
    return args


def bwrap_prefix(writable: list[Path], chdir: Path | None = None) -> list[str]:
    """bwrap's argv up to ``--``: system dirs and the runtime read-only, ``writable`` dirs at the
    same paths, private /tmp, every namespace unshared (no network), an unprivileged uid."""
    argv = ["bwrap", *_system_binds(), "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for w in writable:
        argv += ["--bind", str(w), str(w)]
    if chdir is not None:
        argv += ["--chdir", str(chdir)]
    argv += ["--unshare-all", "--die-with-parent", "--new-session", "--setenv", "HOME", "/tmp"]
    if os.geteuid() == 0:
        argv += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
    return [*argv, "--"]


@functools.cache
def bwrap_works() -> bool:
    if shutil.which("bwrap") is None:
        return False
    with tempfile.TemporaryDirectory(prefix="legorl-synth-probe-") as d:
        try:
            p = subprocess.run(
                [*bwrap_prefix([Path(d)]), sys.executable, "-c", "print('ok')"],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return False
    return p.returncode == 0 and p.stdout.strip() == "ok"


class Runner:
    """Runs pytest on a repository copy; ``sandbox`` is ``auto`` | ``bwrap`` | ``none``."""

    def __init__(
        self, *, sandbox: str = "auto", nice: int = 10, memory_mb: int = 4096, python: str | None = None
    ):
        if sandbox not in ("auto", "bwrap", "none"):
            raise ValueError(f"sandbox must be auto, bwrap or none, not {sandbox!r}")
        if sandbox == "bwrap" and not bwrap_works():
            raise RuntimeError("sandbox=bwrap but bubblewrap does not work on this host")
        self.sandbox = "bwrap" if sandbox == "bwrap" or (sandbox == "auto" and bwrap_works()) else "none"
        self.nice = nice
        self.memory_mb = memory_mb
        self.python = python or sys.executable
        self.environment: Path | None = None  # a task environment (legorl.tasks.envs): read-only, on PYTHONPATH
        self.isolated = False  # python -S: no site-packages (the environment carries pytest)

    def with_environment(self, environment: Path | None) -> Runner:
        """This runner for one package: its test runs see ``environment`` as its sandboxes will."""
        from legorl.tasks.envs import has_runner

        other = copy.copy(self)
        other.environment = Path(environment).resolve() if environment else None
        other.isolated = bool(environment) and has_runner(environment)
        return other

    def _limits(self) -> None:  # runs in the child before exec
        os.nice(self.nice)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        gib = 1 << 30
        resource.setrlimit(resource.RLIMIT_FSIZE, (gib, gib))
        if self.memory_mb:
            mem = self.memory_mb * (1 << 20)
            resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    def run(
        self,
        repo: Path,
        paths: list[str],
        *,
        timeout: float,
        pytest_args: list[str] = (),  # type: ignore[assignment]
        trace: list[Path] | None = None,
    ) -> TestRun:
        """pytest on ``paths`` (relative to ``repo``) with the results plugin; ``trace`` lists source
        files whose executed lines are recorded per test."""
        repo = Path(repo).resolve()
        with tempfile.TemporaryDirectory(prefix="legorl-synth-ctl-") as ctl_s:
            ctl = Path(ctl_s)
            (ctl / f"{PLUGIN_NAME}.py").write_text(PLUGIN_SOURCE)
            env = {
                "PATH": f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin",
                "PYTHONPATH": f"{ctl}:{self.environment}" if self.environment else str(ctl),
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                "PYTEST_ADDOPTS": "",
                "LEGORL_SYNTH_OUT": str(ctl / "out.json"),
                "HOME": "/tmp" if self.sandbox == "bwrap" else str(ctl),
                "LANG": "C.UTF-8",
            }
            if trace is not None:
                (ctl / "trace.json").write_text(json.dumps([str(Path(p).resolve()) for p in trace]))
                env["LEGORL_SYNTH_TRACE"] = str(ctl / "trace.json")
            cmd = [self.python, *(["-S"] if self.isolated else []), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", PLUGIN_NAME,
                   f"--rootdir={repo}", *pytest_args, *paths]  # fmt: skip
            if self.sandbox == "bwrap":
                prefix = bwrap_prefix([repo, ctl], chdir=repo)
                if self.environment:  # read-only, at its host path (PYTHONPATH names it)
                    prefix[-1:-1] = ["--ro-bind", str(self.environment), str(self.environment)]
                cmd = [*prefix, *cmd]
            t0 = time.monotonic()
            proc = subprocess.Popen(
                cmd, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=self._limits,  # noqa: PLW1509 - rlimits only, no locks
            )  # fmt: skip
            timed_out = False
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                out, _ = proc.communicate()
            duration = time.monotonic() - t0
            text = out.decode("utf-8", errors="replace")[-4000:]
            data: dict = {}
            if (ctl / "out.json").is_file():
                data = json.loads((ctl / "out.json").read_text())
        tests = {
            k: TestResult(v["outcome"], v.get("duration", 0.0), v.get("multi", False), v.get("when", ""),
                          v.get("detail") or {})
            for k, v in data.get("tests", {}).items()
        }  # fmt: skip
        cover: dict[str, dict[int, list[int]]] = {}
        for name, lines in data.get("cover", {}).items():
            try:
                rel = str(Path(name).relative_to(repo))
            except ValueError:
                continue
            cover[rel] = {int(line): ctxs for line, ctxs in lines.items()}
        return TestRun(tests, data.get("errors", []), proc.returncode, timed_out, duration, text, cover,
                       data.get("order", []), complete=bool(data) and not timed_out)  # fmt: skip
