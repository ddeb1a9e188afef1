"""From the streamed results, pytest's exit code and its own JUnit report to one verdict.

Resolved only when every check agrees:

1. the verifier plugin reported (else ``grader_error``: the test command is not pytest, or
   pytest could not start on pristine sources);
2. the run did not time out, the session finished and the stream ended normally;
3. nothing tampered with the runner (the verifier's audit hook and identity check saw no write
   to pytest, pluggy or the plugin) or the stream (no duplicate or out-of-order results, no second
   connection, no plugin registered once repository code could run);
4. at least one test was collected, and every FAIL_TO_PASS / PASS_TO_PASS test has an explicit
   pass for setup, call and teardown (an id without ``[...]`` covers all its parametrizations);
5. pytest's exit code is the one it reported before any other hook ran, and is 0 exactly when
   no result failed;
6. pytest's own JUnit report, written in-process, agrees on every graded test.
"""

from __future__ import annotations

from dataclasses import dataclass

from legorl.grading.junit import junit_key
from legorl.grading.stream import StreamedRun
from legorl.records import Outcome


@dataclass
class Verdict:
    outcome: Outcome
    reason: str
    tests: dict[str, str]  # graded id -> status

    @property
    def resolved(self) -> bool:
        return self.outcome == Outcome.RESOLVED


def graded_statuses(run: StreamedRun, test_ids: list[str]) -> dict[str, str]:
    statuses = run.statuses()
    out: dict[str, str] = {}
    for tid in test_ids:
        if tid in statuses:
            out[tid] = statuses[tid]
            continue
        params = [s for n, s in statuses.items() if "[" not in tid and n.startswith(tid + "[")]
        if not params:
            out[tid] = "missing"
        else:
            out[tid] = next((s for s in params if s != "passed"), "passed")
    return out


def _junit_status(junit: dict[tuple[str, str], str], tid: str) -> str | None:
    try:
        key = junit_key(tid)
    except ValueError:
        return None
    if key in junit:
        return junit[key]
    params = [s for (c, n), s in junit.items() if c == key[0] and "[" not in key[1] and n.startswith(key[1] + "[")]
    if params:
        return next((s for s in params if s != "passed"), "passed")
    return None


def decide(
    run: StreamedRun,
    test_ids: list[str],
    *,
    exit_code: int | None,
    timed_out: bool,
    junit: dict[tuple[str, str], str] | None,
    junit_error: str = "",
) -> Verdict:
    def unresolved(reason: str, tests: dict[str, str]) -> Verdict:
        return Verdict(Outcome.UNRESOLVED, reason, tests)

    if not run.started:
        return Verdict(
            Outcome.GRADER_ERROR,
            "the verifier plugin never reported: the test command must run pytest (and pytest must start)",
            dict.fromkeys(test_ids, "missing"),
        )
    tests = graded_statuses(run, test_ids)
    if not test_ids:
        return Verdict(Outcome.GRADER_ERROR, "task lists no FAIL_TO_PASS/PASS_TO_PASS tests", tests)
    if timed_out:
        return unresolved("tests timed out", tests)
    if run.tampering:
        return unresolved("the code under test patched the test runner: " + "; ".join(run.tampering[:5]), tests)
    if run.anomalies:
        return unresolved("result stream tampered with: " + "; ".join(run.anomalies[:5]), tests)
    if run.collected is None:
        errors = "; ".join(f"{k}: {v.splitlines()[-1] if v else ''}" for k, v in list(run.collect_errors.items())[:3])
        return unresolved("the test session ended before collection finished" + (f" ({errors})" if errors else ""), tests)
    if not run.collected:
        errors = list(run.collect_errors)[:3]
        return unresolved("no tests collected" + (f" (collection errors in {errors})" if errors else ""), tests)
    if run.exitstatus is None or not run.ended:
        return unresolved("the test session ended abnormally (no session finish)", tests)
    if exit_code != run.exitstatus:
        return unresolved(f"exit status rewritten: pytest reported {run.exitstatus}, the process exited {exit_code}", tests)
    if (run.exitstatus == 0) == run.any_failure():
        return unresolved(
            f"exit status {run.exitstatus} inconsistent with the results "
            f"({'some' if run.any_failure() else 'no'} failures)",
            tests,
        )
    if bad := [t for t, s in tests.items() if s != "passed"]:
        return unresolved(f"{len(bad)} of {len(test_ids)} graded tests not passed: {bad[:5]}", tests)
    if junit is None:
        return unresolved(f"pytest's own JUnit report is unusable: {junit_error or 'missing'}", tests)
    disagree = [t for t in test_ids if _junit_status(junit, t) != "passed"]
    if disagree:
        return unresolved(f"pytest's JUnit report disagrees with the streamed results on {disagree[:5]}", tests)
    return Verdict(Outcome.RESOLVED, "", tests)
