"""Tamper-resistant grading in a fresh sandbox.

Pristine sources (a fresh prepare_repo copy) + only the source part of the agent's
diff + the hidden tests written last; the verdict comes from a JUnit report written
into a verifier-owned dir and parsed on the host. Resolved iff every FAIL_TO_PASS and
PASS_TO_PASS test is reported as explicitly passed. Infrastructure failures become
GRADER_ERROR, never an exception and never a silent 0.
"""

from __future__ import annotations

import secrets
import shlex
import shutil
from pathlib import Path

from legorl.grading.junit import JUnitError, junit_key, parse_junit
from legorl.grading.policy import filter_diff, patch_paths
from legorl.records import GraderReport, Outcome
from legorl.sandbox.bwrap import BwrapSandbox
from legorl.tasks.repo import prepare_repo
from legorl.tasks.schema import Task

GIT = "git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c safe.directory='*'"
VERIFIER_INSIDE = "/run/verifier"
LOG_TAIL = 2000
# No plugin autoload: installed plugins stay out of the verdict (and cost seconds per run);
# a task that needs one names it in its test_command (`-p asyncio`).
GRADER_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTEST_ADDOPTS": "", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def _test_files(task: Task) -> list[str]:
    """Files holding the graded tests, so unrelated broken test files cannot sink the run."""
    files = []
    for tid in task.test_ids:
        path = tid.split("::")[0]
        if path.endswith(".py") and path not in files:
            files.append(path)
    return files


async def _install_hidden_tests(box: BwrapSandbox, task: Task, base: str) -> str | None:
    """Write the hidden tests over whatever is there; returns an error message on failure."""
    for rel, content in task.hidden_files.items():
        # Remove first: the agent could have pre-created the file (or a symlink) there.
        await box.exec(f"rm -rf -- {shlex.quote(rel)}", timeout=30)
        await box.write_file(f"/workspace/{rel}", content)
    if task.test_patch:
        for rel in sorted(patch_paths(task.test_patch)):
            q = shlex.quote(rel)
            # Restore from the base commit (not HEAD); files the patch adds are removed.
            await box.exec(
                f"rm -rf -- {q}; {GIT} cat-file -e {base}:{q} 2>/dev/null && {GIT} checkout {base} -- {q} || true",
                timeout=30,
            )
        await box.write_file("/tmp/hidden_tests.patch", task.test_patch)
        r = await box.exec(f"{GIT} apply --whitespace=nowarn /tmp/hidden_tests.patch", timeout=60)
        if r.returncode != 0:
            return f"hidden test patch did not apply: {r.output[-500:]}"
    return None


async def grade(
    task: Task,
    diff: str,
    *,
    work_dir: Path,
    timeout: float = 60,
    hide_paths: list[Path] | tuple[Path, ...] = (),
    keep: bool = False,
    memory_mb: int | None = None,
) -> GraderReport:
    """Grade ``diff`` for ``task``. Never raises; ``work_dir`` must be a private host dir.

    ``timeout`` bounds the test command; ``memory_mb`` caps the grader sandbox's address space;
    ``keep`` leaves the work dir (repo, JUnit report, bwrap log) for debugging.
    """
    work = Path(work_dir) / f"grade-{secrets.token_hex(6)}"
    box: BwrapSandbox | None = None
    report = GraderReport(resolved=False, outcome=Outcome.GRADER_ERROR)
    try:
        base = prepare_repo(task, work / "repo")
        kept, report.applied_paths, report.dropped_paths = filter_diff(
            diff, protected=set(task.hidden_files) | patch_paths(task.test_patch)
        )
        verifier = work / "verifier"
        verifier.mkdir()
        box = await BwrapSandbox.create(
            workspace=work / "repo",
            sandbox_dir=work / "sandbox",
            label=f"grade-{task.instance_id}",
            hide_paths=[*hide_paths],
            extra_binds={VERIFIER_INSIDE: verifier},
            memory_mb=memory_mb,
        )
        if task.setup.strip():  # on pristine sources: a failure here is the task's, not the agent's
            r = await box.exec(task.setup, timeout=max(timeout, 120))
            if r.returncode != 0:
                report.reason, report.log_tail = (
                    f"task setup failed (exit {r.returncode})",
                    r.output[-LOG_TAIL:],
                )
                return report
        if kept.strip():
            await box.write_file("/tmp/agent.patch", kept)
            # Strict apply, no fuzz: a patch applied somewhere it was not meant to go is worse than none.
            r = await box.exec(f"{GIT} apply --whitespace=nowarn --binary /tmp/agent.patch", timeout=60)
            if r.returncode != 0:
                report.outcome, report.reason = Outcome.UNRESOLVED, "patch did not apply"
                report.log_tail = r.output[-LOG_TAIL:]
                return report
        if err := await _install_hidden_tests(box, task, base):
            report.reason = err
            return report
        junit_name = f"junit-{secrets.token_hex(8)}.xml"
        args = ["-p", "no:cacheprovider", f"--junitxml={VERIFIER_INSIDE}/{junit_name}", *_test_files(task)]
        cmd = f"{task.test_command} {' '.join(shlex.quote(a) for a in args)}"
        r = await box.exec(cmd, timeout=timeout, env=GRADER_ENV)
        report.exit_code, report.log_tail = r.returncode, r.output[-LOG_TAIL:]
        # Close first: nothing the tests left running can rewrite the report while we read it.
        await box.close()
        try:
            results = parse_junit(verifier / junit_name)
        except JUnitError as e:
            report.tests = dict.fromkeys(task.test_ids, "missing")
            report.outcome = Outcome.UNRESOLVED
            report.reason = ("tests timed out; " if r.timed_out else "") + str(e)
            return report
        report.collected = len(results)
        report.tests = {tid: results.get(junit_key(tid), "missing") for tid in task.test_ids}
        bad = [tid for tid, status in report.tests.items() if status != "passed"]
        report.resolved = bool(task.test_ids) and report.collected > 0 and not bad
        report.outcome = Outcome.RESOLVED if report.resolved else Outcome.UNRESOLVED
        if r.timed_out:
            report.reason = "tests timed out"
        elif bad:
            report.reason = f"{len(bad)} of {len(task.test_ids)} graded tests not passed: {bad[:5]}"
        elif not task.test_ids:
            report.reason = "task lists no FAIL_TO_PASS/PASS_TO_PASS tests"
        return report
    except Exception as e:  # noqa: BLE001 - any infra failure becomes a typed GRADER_ERROR, never a 0
        report.resolved, report.outcome = False, Outcome.GRADER_ERROR
        report.reason = f"{type(e).__name__}: {e}"[:2000]
        return report
    finally:
        if box is not None:
            await box.close()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
