"""Tamper-resistant grading in a fresh sandbox.

1. Pristine sources: a fresh ``prepare_repo`` copy (one orphan commit), never the agent's workspace.
2. Only the source part of the agent's diff (``policy.py``), refused outright when it reaches into
   the test runner (``tamper.py``), applied strictly (``git apply``, no fuzz) in the sandbox.
3. Test files restored from the base commit, files the hidden test patch adds removed, hidden
   tests written last; graded test files and their conftests then belong to root, read-only,
   in sticky dirs, so code under test cannot rewrite them before pytest reads them.
   Harbor-style tasks (``Task.tests_dir``) get their tests as a read-only mount instead.
4. pytest runs with the verifier plugin from a read-only dir; every result streams to the
   host as it happens (``stream.py``); the verdict needs the stream, pytest's exit code and
   its own JUnit report to agree (``verdict.py``). The verifier-owned JUnit report is built on
   the host from the stream.

Infrastructure failures become GRADER_ERROR with the reason, never an exception and never a silent 0.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import functools
import json
import logging
import multiprocessing
import os
import secrets
import shlex
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from legorl.config import SandboxConfig
from legorl.grading import effect
from legorl.grading.junit import parse_junit_text, to_junit_xml
from legorl.grading.policy import MAX_PATCH_BYTES, FilteredDiff, filter_diff_detailed, patch_paths
from legorl.grading.pool import (
    HOST_DIR,
    Member,
    current_pool,
    fallback_reason,
    kind_of,
    member_limits,
    pytest_args,
)
from legorl.grading.stream import EMPTY_CONFIG, PLUGIN_MODULE, SOCKET_NAME, ResultServer, StreamedRun
from legorl.grading.tamper import scan
from legorl.grading.verdict import decide
from legorl.records import GraderReport, Outcome
from legorl.sandbox.base import Sandbox
from legorl.sandbox.bwrap import INSIDE_CTL
from legorl.sandbox.client import ExecResult
from legorl.sandbox.factory import ENV_INSIDE, create_sandbox
from legorl.sandbox.limits import SandboxLimits
from legorl.tasks.pristine import PRISTINE, Pristine
from legorl.tasks.schema import Task

log = logging.getLogger(__name__)
GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c safe.directory='*'"
VERIFIER_INSIDE = "/run/legorl-verifier"
LOG_TAIL = 2000
# No plugin autoload: installed plugins stay out of the verdict (and cost seconds per run);
# a task that needs one names it in its test_command (`-p asyncio`).
GRADER_ENV = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTEST_ADDOPTS": "",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
    "PYTHONPATH": VERIFIER_INSIDE,
    "LEGORL_VERIFIER_SOCKET": f"{VERIFIER_INSIDE}/{SOCKET_NAME}",
}


EMPTY_PATCH_REASON = (
    "empty patch: the agent changed nothing, so no tests ran (SWE-bench counts an empty patch as "
    "unresolved too); the unchanged repository fails the task's FAIL_TO_PASS tests, which "
    "`legorl tasks validate` checks"
)


def empty_patch_report(task: Task) -> GraderReport:
    """The verdict on an empty diff without a grading sandbox: the pristine repository is what task
    validation already graded, and it must fail. Most failed rollouts of a small policy change
    nothing, so this saves a sandbox and a pytest run for each of them."""
    return GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason=EMPTY_PATCH_REASON,
                        tests=dict.fromkeys(task.test_ids, "missing"))


class _Stop(Exception):
    """Ends grading early with the report as it stands."""


def hidden_paths(task: Task) -> set[str]:
    """Workspace paths holding hidden tests (empty for tasks whose tests live in ``tests_dir``)."""
    if task.tests_dir:
        return set()
    return set(task.hidden_files) | patch_paths(task.test_patch)


def test_files(task: Task) -> list[str]:
    """Files holding the graded tests (as pytest arguments), so unrelated broken files cannot sink the run."""
    files: list[str] = []
    for tid in task.test_ids:
        path = tid.split("::")[0]
        if task.tests_dir:
            path = str(PurePosixPath(task.tests_dir) / path)
        if path not in files:
            files.append(path)
    return files


BIG_PATCH_BYTES = 256 * 1024  # filtered in a worker process above this (bench/patch_filter.py)


@functools.cache
def _filter_process() -> concurrent.futures.ProcessPoolExecutor:
    # spawn: a fork of a driver holding an engine and threads is neither cheap nor safe
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    atexit.register(pool.shutdown, wait=False, cancel_futures=True)
    return pool


async def filter_off_loop(diff: str, protected: set[str], base_paths: frozenset[str] | set[str]) -> FilteredDiff:
    """``filter_diff_detailed`` without holding up the event loop (which serves the proxy to every other
    rollout): a small patch takes about a millisecond inline; a large one goes to a worker process, since
    in a thread its pure-Python work would hold the GIL the loop needs (a 2 MB patch: ~20 ms of it)."""
    if len(diff) < BIG_PATCH_BYTES:
        return filter_diff_detailed(diff, protected=protected, base_paths=base_paths)
    call = functools.partial(filter_diff_detailed, diff, protected=set(protected), base_paths=frozenset(base_paths))
    return await asyncio.get_running_loop().run_in_executor(_filter_process(), call)


@functools.lru_cache(maxsize=1024)
def pristine_config(repo: Path, files: tuple[str, ...]) -> str | None:
    """The config file pytest's own discovery picks for ``files`` on the pristine tree ``repo`` (relative to
    it; None: none there). The grading run reads that file (``-c``): whatever config files of other names
    the patch adds, they are never read."""
    from _pytest.config.findpaths import locate_config  # the runner's rules, not a copy of them

    args = [repo / f for f in files] or [repo]
    try:
        found = locate_config(repo, args)  # pytest >= 8.1
    except TypeError:
        found = locate_config(args)  # type: ignore[call-arg]
    inipath = found[1]
    if inipath is None or repo.resolve() not in Path(inipath).resolve().parents:
        return None
    return Path(inipath).resolve().relative_to(repo.resolve()).as_posix()


def config_args(task: Task, pristine: Pristine) -> list[str]:
    """The grading run's config: the pristine repository's (restored, agents cannot change it) or an empty
    one of the verifier's. Tests mounted from ``tests_dir`` sit outside the repository: no repo config is
    on pytest's search path there."""
    if task.tests_dir:
        return []
    rel = pristine_config(pristine.path, tuple(test_files(task)))
    return ["-c", f"{task.workdir}/{rel}" if rel else f"{VERIFIER_INSIDE}/{EMPTY_CONFIG}"]


def _pristine_reader(repo: Path):
    def read(rel: str) -> str | None:
        p = (repo / rel).resolve()
        if repo.resolve() not in p.parents or not p.is_file():
            return None
        try:
            return p.read_text(errors="replace")
        except OSError:
            return None

    return read


def _inside(repo: Path, p: Path) -> bool:
    try:
        real = p.resolve()
    except OSError:
        return False
    return real == repo.resolve() or repo.resolve() in real.parents


def protect_test_files(repo: Path, rels: list[str]) -> None:
    """Graded test files and the conftests above them -> root-owned, read-only, in root-owned sticky
    dirs: the sandbox's uid can still create files there, but not change, remove or rename these."""
    if os.geteuid() != 0:
        return  # without a separate sandbox uid there is no owner to protect them from
    repo = repo.resolve()
    for rel in rels:
        f = repo / rel
        if not _inside(repo, f.parent):
            continue
        d = f.parent.resolve()
        for target in (f, *(p / "conftest.py" for p in (d, *d.parents) if p == repo or repo in p.parents)):
            if target.is_file() and not target.is_symlink() and _inside(repo, target):
                os.lchown(target, 0, 0)
                os.chmod(target, 0o444)
        while True:
            os.lchown(d, 0, 0)
            os.chmod(d, 0o1777)
            if d == repo:
                break
            d = d.parent


def _materialize_tests_dir(task: Task, dest: Path) -> None:
    dest.mkdir(parents=True)
    for rel, content in task.hidden_files.items():
        p = PurePosixPath(rel)
        if p.is_absolute() or ".." in p.parts:
            raise ValueError(f"task {task.instance_id}: unsafe hidden test path {rel!r}")
        target = dest / p
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
    for dirpath, _, filenames in os.walk(dest):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444 if not name.endswith(".sh") else 0o555)


async def _install_hidden_tests(
    box: Sandbox, task: Task, base: str, ws: str | None = None, removed: bool = False
) -> str | None:
    """Write the in-workspace hidden tests over whatever is there (the repo at ``ws`` inside, default the
    sandbox's workspace; ``removed``: their paths were cleared already); returns an error message on failure."""
    cwd = ws
    ws = ws or box.inside_workspace
    if task.hidden_files and not removed:
        # Remove first: the agent could have pre-created a file (or a symlink) there.
        await box.exec(f"rm -rf -- {' '.join(map(shlex.quote, task.hidden_files))}", timeout=30, cwd=cwd)
    for rel, content in task.hidden_files.items():
        await box.write_file(f"{ws}/{rel}", content)
    if task.test_patch:
        for rel in sorted(patch_paths(task.test_patch)):
            q = shlex.quote(rel)
            # Restore from the base commit (not HEAD); files the patch adds are removed.
            await box.exec(
                f"rm -rf -- {q}; {GIT} cat-file -e {base}:{q} 2>/dev/null && {GIT} checkout {base} -- {q} || true",
                timeout=30, cwd=cwd,
            )
        await box.write_file("/tmp/hidden_tests.patch", task.test_patch)
        r = await box.exec(f"{GIT} apply --whitespace=nowarn /tmp/hidden_tests.patch", timeout=60, cwd=cwd)
        if r.returncode != 0:
            return f"hidden test patch did not apply: {r.output[-500:]}"
    return None


def _set_extra(report: GraderReport, **values: Any) -> None:
    """Fill optional GraderReport fields where the record has them (records.py may add them later)."""
    names = {f.name for f in dataclasses.fields(report)}
    for k, v in values.items():
        if k in names:
            setattr(report, k, v)


def _write_artifacts(
    artifacts_dir: Path | None, report: GraderReport, filtered: FilteredDiff | None, junit_xml: str,
    drop_reasons: dict[str, str],
) -> None:
    if artifacts_dir is None:
        return
    artifacts_dir.mkdir(parents=True, exist_ok=True)
    d = report.to_dict()
    if filtered is not None:
        d.update(applied_diff=filtered.kept, dropped_diff=filtered.dropped, drop_reasons=drop_reasons)
    (artifacts_dir / "report.json").write_text(json.dumps(d, indent=2))
    if junit_xml:
        (artifacts_dir / "junit.xml").write_text(junit_xml)


async def grade(
    task: Task,
    diff: str,
    *,
    work_dir: Path,
    timeout: float = 60,
    hide_paths: list[Path] | tuple[Path, ...] = (),
    keep: bool = False,
    memory_mb: int | None = None,
    limits: SandboxLimits | None = None,
    artifacts_dir: Path | None = None,
    label: str | None = None,
    sandbox: SandboxConfig | None = None,
) -> GraderReport:
    """Grade ``diff`` for ``task``. Never raises; ``work_dir`` must be a private host dir.

    ``timeout`` bounds the test command; ``limits`` / ``memory_mb`` bound the grading sandbox
    (its lifetime defaults to the timeout plus set-up room); ``artifacts_dir`` receives the
    verifier-owned ``junit.xml`` and a full ``report.json`` (applied and dropped diff parts);
    ``keep`` leaves the work dir for debugging; ``label`` tags the grading sandbox (reaping);
    ``sandbox`` is the run's sandbox section (its backend; default bwrap).
    """
    if fallback_reason(task, sandbox, keep) is None:
        limits = _limits(task, timeout, limits, memory_mb)
        report = await _grade_pooled(task, diff, timeout=timeout, hide_paths=tuple(hide_paths), limits=limits,
                                     artifacts_dir=artifacts_dir, label=label, sandbox=sandbox)  # fmt: skip
        if report is not None:
            return report
    g = _Grading(task, Path(work_dir) / f"grade-{secrets.token_hex(6)}", sandbox)
    limits = _limits(task, timeout, limits, memory_mb)

    async def steps() -> None:
        await g.pristine_sources(diff)
        async with ResultServer() as results:
            await g.start_sandbox(results, limits, hide_paths, label)
            await g.run_task_setup(timeout)
            await g.patch_and_test(lambda: g.run_tests(results, timeout))

    async def cleanup() -> None:
        if g.box is not None:
            await g.box.close()
        if not keep:
            shutil.rmtree(g.work, ignore_errors=True)

    return await g.graded(steps, cleanup, artifacts_dir)


async def _grade_pooled(
    task: Task, diff: str, *, timeout: float, hide_paths: tuple[Path, ...], limits: SandboxLimits,
    artifacts_dir: Path | None, label: str | None, sandbox: SandboxConfig | None,
) -> GraderReport | None:
    """``grade`` through a pooled grading sandbox and its zygote (``pool.py``): the same steps and verdict,
    with a fresh forked pytest process in namespaces of its own per patch instead of a fresh sandbox and
    interpreter. None when no pooled sandbox can be had (the caller then grades in a fresh sandbox)."""
    try:
        await asyncio.to_thread(PRISTINE.get, task)
    except Exception:  # noqa: BLE001 - the fresh-sandbox path reports the broken task as it always has
        return None
    pool = current_pool()
    kind = kind_of(sandbox, label or "grade-pool", hide_paths, member_limits(limits), task.workdir)
    start = functools.partial(Member.start, sandbox, label=kind.label, hide_paths=hide_paths,
                              limits=member_limits(limits), workdir=task.workdir, verifier_inside=VERIFIER_INSIDE,
                              env=GRADER_ENV)  # fmt: skip
    try:
        member = await pool.acquire(kind, start)
    except Exception as e:  # noqa: BLE001 - no pooled sandbox this time: a fresh one
        log.warning("no pooled grading sandbox (%s: %s); grading in a fresh one", type(e).__name__, e)
        return None
    if member is None:
        return None
    g = _Grading(task, member.root, sandbox)
    g.box = member.box

    async def steps() -> None:
        g.repo, g.ws, g.pristine = await asyncio.to_thread(member.new_slot, task)
        await g.filter_diff(diff)
        async with ResultServer(shared=member.verifier) as results:
            await g.patch_and_test(lambda: g.run_tests_pooled(member, results, timeout))

    async def cleanup() -> None:
        current = asyncio.current_task()
        cancelled = current is not None and current.cancelling() > 0
        pool.release(kind, member, not (g.infra_failed or member.box.violation or cancelled))
        if g.ws is not None:
            await asyncio.to_thread(shutil.rmtree, g.repo, True)

    return await g.graded(steps, cleanup, artifacts_dir)


def _limits(task: Task, timeout: float, limits: SandboxLimits | None, memory_mb: int | None) -> SandboxLimits:
    """The grading sandbox's limits: its lifetime covers the tests' timeout plus set-up room."""
    setup_room = _setup_room(task)
    limits = limits or SandboxLimits(lifetime_s=timeout + setup_room + 60)
    return limits.with_(memory_mb=memory_mb) if memory_mb is not None else limits


def _setup_room(task: Task) -> float:
    return 120.0 if task.setup.strip() else 30.0


@dataclasses.dataclass
class _TestRun:
    """What the test command left: its result, the streamed run and pytest's own JUnit report."""

    result: ExecResult
    run: StreamedRun
    junit: dict[tuple[str, str], str] | None
    junit_error: str


class _Grading:
    """One grading, step by step; each step fills ``report`` and raises _Stop when the verdict is in."""

    def __init__(self, task: Task, work: Path, sandbox: SandboxConfig | None = None) -> None:
        self.task = task
        self.work = work
        self.repo = work / "repo"
        self.sandbox_cfg = sandbox
        self.box: Sandbox | None = None
        self.ws: str | None = None  # the repo inside the sandbox, where it is not the workspace (a pool's slot)
        self.hidden_removed = False  # the hidden tests' paths already cleared (with the agent's patch)
        self.report = GraderReport(resolved=False, outcome=Outcome.GRADER_ERROR)
        self.filtered: FilteredDiff | None = None
        self.pristine: Pristine | None = None
        self.drop_reasons: dict[str, str] = {}  # every path the grader did not apply, and why
        self.infra_failed = False
        self.junit_xml = ""

    async def graded(
        self, steps: Callable[[], Awaitable[None]], cleanup: Callable[[], Awaitable[None]], artifacts_dir: Path | None
    ) -> GraderReport:
        """Runs ``steps`` to the verdict: a _Stop ends them with the report as it stands, any other failure
        is a GRADER_ERROR with the reason; then ``cleanup`` and the artifacts, whatever happened."""
        try:
            await steps()
        except _Stop:
            pass
        except Exception as e:  # noqa: BLE001 - any infra failure becomes a typed GRADER_ERROR, never a 0
            self.infrastructure_failed(e)
        finally:
            self.report.resolved = self.report.outcome == Outcome.RESOLVED
            await cleanup()
            _write_artifacts(artifacts_dir, self.report, self.filtered, self.junit_xml, self.drop_reasons)
        return self.report

    async def patch_and_test(self, run_tests: Callable[[], Awaitable[_TestRun]]) -> None:
        """The steps both paths share once the sources are in place: the patch, the hidden tests, pytest
        (``run_tests``: in a fresh sandbox or a pooled one's zygote) and the verdict."""
        assert self.pristine is not None
        await self.apply_agent_patch()
        await self.install_hidden_tests(self.pristine.base)
        self.judge(await run_tests())

    def _finish(self, outcome: Outcome, reason: str, log_tail: str | None = None, missing: bool = False) -> _Stop:
        """The report's verdict, to raise: ``missing`` marks every graded test missing (none ran)."""
        self.report.outcome, self.report.reason = outcome, reason
        if log_tail is not None:
            self.report.log_tail = log_tail
        if missing:
            self.report.tests = dict.fromkeys(self.task.test_ids, "missing")
        return _Stop()

    async def pristine_sources(self, diff: str) -> None:
        """A fresh copy of the task repo, and the part of ``diff`` the grader applies."""
        self.pristine = await asyncio.to_thread(PRISTINE.copy, self.task, self.repo)
        await self.filter_diff(diff)

    def _protected(self) -> set[str]:
        return hidden_paths(self.task) | set(self.task.protected_paths)

    async def filter_diff(self, diff: str) -> None:
        """The file sections of ``diff`` the grader applies (policy.py); _Stop for a patch over the size limit."""
        size = len(diff.encode("utf-8", errors="replace"))
        if size > MAX_PATCH_BYTES:
            reason = f"patch too large: {size} bytes, over the {MAX_PATCH_BYTES}-byte limit; not applied"
            raise self._finish(Outcome.UNRESOLVED, reason, missing=True)
        assert self.pristine is not None
        self.filtered = filtered = await filter_off_loop(diff, self._protected(), self.pristine.base_paths)
        self._report_paths(filtered.applied_paths, filtered.reasons)
        _set_extra(self.report, applied_diff=filtered.kept, dropped_diff=filtered.dropped)

    def _report_paths(self, applied: list[str], dropped: dict[str, str]) -> None:
        self.drop_reasons.update(dropped)
        self.report.applied_paths, self.report.dropped_paths = sorted(applied), sorted(self.drop_reasons)

    async def start_sandbox(
        self, results: ResultServer, limits: SandboxLimits, hide_paths: Sequence[Path], label: str | None
    ) -> None:
        """A fresh sandbox on the pristine repo, the verifier plugin (and a Harbor task's tests) read-only."""
        task = self.task
        ro_binds = {VERIFIER_INSIDE: results.dir}
        if task.tests_dir:
            _materialize_tests_dir(task, self.work / "tests")
            ro_binds[task.tests_dir] = self.work / "tests"
        self.box = await create_sandbox(
            self.sandbox_cfg,
            workspace=self.repo,
            sandbox_dir=self.work / "sandbox",
            label=label or f"grade-{task.instance_id}",
            hide_paths=[*hide_paths, self.work],
            ro_binds=ro_binds,
            limits=limits,
            inside_workspace=task.workdir,
            image=task.image,
            environment=task.environment,
        )

    async def run_task_setup(self, timeout: float) -> None:
        """The task's set-up, on pristine sources: a failure here is the task's, not the agent's."""
        assert self.box is not None
        if not self.task.setup.strip():
            return
        r = await self.box.exec(self.task.setup, timeout=max(timeout, _setup_room(self.task)))
        if r.returncode != 0:
            raise self._finish(Outcome.GRADER_ERROR, f"task setup failed (exit {r.returncode})", r.output[-LOG_TAIL:])

    async def apply_agent_patch(self) -> None:
        """Strict apply, no fuzz (a patch applied somewhere it was not meant to go is worse than none), then
        the patch judged by its effect on the tree (effect.py): what the policy refuses is put back."""
        assert self.box is not None and self.filtered is not None and self.pristine is not None
        if not self.filtered.kept.strip():
            return
        before = await asyncio.to_thread(effect.snapshot, self.repo)
        await self.box.write_file("/tmp/agent.patch", self.filtered.kept)
        command = f"{GIT} apply --whitespace=nowarn --binary /tmp/agent.patch"
        if hidden := [] if self.task.tests_dir else list(self.task.hidden_files):
            # Where the hidden tests go, removed in the same command (the agent could have pre-created one):
            # one process start less per grading; git's exit status and output stay the command's.
            command += f"; rc=$?; [ $rc -ne 0 ] || rm -rf -- {' '.join(map(shlex.quote, hidden))}; exit $rc"
        r = await self.box.exec(command, timeout=60, cwd=self.ws)
        self.hidden_removed = r.returncode == 0
        if r.returncode != 0:
            reason = "patch did not apply (git apply, no fuzz)"
            raise self._finish(Outcome.UNRESOLVED, reason, r.output[-LOG_TAIL:], missing=True)
        done = await asyncio.to_thread(
            effect.judge, self.repo, before, self.pristine.path, self._protected(), self.pristine.base_paths
        )
        self._report_paths(done.applied, done.dropped)
        if findings := scan(done.new_text, _pristine_reader(self.pristine.path)):
            reason = "patch reaches into the test runner or verdict: " + "; ".join(findings[:5])
            raise self._finish(Outcome.UNRESOLVED, reason, missing=True)

    async def install_hidden_tests(self, base: str) -> None:
        """In-workspace hidden tests written last, then protected from the code under test."""
        assert self.box is not None
        if self.task.tests_dir:
            return  # mounted read-only by start_sandbox
        if err := await _install_hidden_tests(self.box, self.task, base, self.ws, removed=self.hidden_removed):
            raise self._finish(Outcome.GRADER_ERROR, err)
        await asyncio.to_thread(protect_test_files, self.repo, test_files(self.task))

    def _pytest_args(self, rootdir: str, junit_inside: str) -> list[str]:
        """What the grader adds to the task's pytest command line: the verifier plugin and config, the
        rootdir, pytest's own JUnit report and the graded test files."""
        assert self.pristine is not None
        return ["-p", PLUGIN_MODULE, "-p", "no:cacheprovider", *config_args(self.task, self.pristine),
                f"--rootdir={rootdir}", f"--junitxml={junit_inside}", *test_files(self.task)]  # fmt: skip

    async def _test_run(self, r: ExecResult, read_junit: Callable[[], Awaitable[bytes]], results: ResultServer,
                        before_stream: Callable[[], Awaitable[None]] | None = None) -> _TestRun:  # fmt: skip
        """The exit code, pytest's own JUnit report (missing or garbled: the verdict says so) and the stream,
        read once ``before_stream`` made sure nothing the tests left can add to it."""
        self.report.exit_code, self.report.log_tail = r.returncode, r.output[-LOG_TAIL:]
        junit, junit_error = None, ""
        try:
            junit = parse_junit_text(await read_junit())
        except Exception as e:  # noqa: BLE001 - missing or garbled: the verdict says so
            junit_error = str(e)[:300]
        if before_stream is not None:
            await before_stream()
        await results.wait_done(5.0)
        await results.stop()
        return _TestRun(r, results.run, junit, junit_error)

    async def run_tests(self, results: ResultServer, timeout: float) -> _TestRun:
        """pytest with the verifier plugin; then the sandbox is closed before the stream is judged."""
        assert self.box is not None
        box, task = self.box, self.task
        junit_inside = f"/tmp/legorl-junit-{secrets.token_hex(8)}.xml"
        args = self._pytest_args(task.tests_dir or task.workdir, junit_inside)
        cmd = f"{task.test_command} {' '.join(shlex.quote(a) for a in args)}"
        env = {**GRADER_ENV, "PYTHONPATH": f"{VERIFIER_INSIDE}:{ENV_INSIDE}"} if task.environment else GRADER_ENV
        r = await box.exec(cmd, timeout=timeout, env=env)
        return await self._test_run(r, lambda: box.read_file(junit_inside), results, before_stream=box.close)

    async def run_tests_pooled(self, member: Member, results: ResultServer, timeout: float) -> _TestRun:
        """The same pytest command line, run by the member's zygote in a fresh forked process with
        namespaces of its own; everything it started is gone when this returns."""
        assert self.ws is not None
        junit_inside = f"/tmp/legorl-junit-{secrets.token_hex(8)}.xml"
        args = [*(pytest_args(self.task.test_command) or []), *self._pytest_args(self.task.workdir, junit_inside)]
        socket_inside = f"{VERIFIER_INSIDE}/{results.name}/{SOCKET_NAME}"
        cover = [INSIDE_CTL, f"{VERIFIER_INSIDE}/{HOST_DIR}"]
        run = await member.run(self.ws, args, {"LEGORL_VERIFIER_SOCKET": socket_inside}, timeout, junit_inside, cover)

        async def junit() -> bytes:
            if run.junit is None:
                raise FileNotFoundError(f"no JUnit report at {junit_inside}")
            return run.junit

        return await self._test_run(run.result, junit, results)

    def judge(self, tests: _TestRun) -> None:
        """The verdict: the stream, pytest's exit code and its JUnit report must agree (verdict.py)."""
        run, r, report = tests.run, tests.result, self.report
        verdict = decide(run, self.task.test_ids, exit_code=r.returncode, timed_out=r.timed_out,
                         junit=tests.junit, junit_error=tests.junit_error)  # fmt: skip
        report.outcome, report.reason, report.tests = verdict.outcome, verdict.reason, verdict.tests
        if not verdict.resolved and self.drop_reasons:
            dropped = "; ".join(f"{p}: {why}" for p, why in sorted(self.drop_reasons.items())[:5])
            report.reason += f" (not applied from the patch: {dropped})"
        report.resolved = verdict.resolved
        report.collected = len(run.collected or [])
        self.junit_xml = to_junit_xml(run.statuses(), details=run.longrepr)

    def infrastructure_failed(self, e: Exception) -> None:
        """GRADER_ERROR with the reason; UNRESOLVED when the code under test blew a sandbox limit."""
        report = self.report
        self.infra_failed = True
        report.resolved, report.outcome = False, Outcome.GRADER_ERROR
        report.reason = f"{type(e).__name__}: {e}"[:2000]
        if self.box is not None and self.box.violation:
            report.reason = f"grading sandbox killed: {self.box.violation}"
            report.outcome = Outcome.UNRESOLVED  # the code under test blew a limit
