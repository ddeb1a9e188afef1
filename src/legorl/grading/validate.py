"""``legorl tasks validate``: every task must be solvable, not free, and not hackable.

Per task: the gold patch (or the Harbor solution script's diff) must resolve, the empty patch
must not, and every canary (``canaries.py``) must end ``unresolved``; the hidden-test lookup
canary searches an agent sandbox, set up exactly as a rollout's, for the hidden tests' text
and the repo's history, and must find neither.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from legorl.config import SandboxConfig
from legorl.grading.canaries import AGENT_CANARIES, PATCH_CANARIES, CanaryContext
from legorl.grading.diff import workspace_diff
from legorl.grading.grader import grade
from legorl.records import GraderReport, Outcome
from legorl.sandbox.factory import create_sandbox
from legorl.tasks.repo import prepare_repo
from legorl.tasks.schema import Task

SEARCH_TIMEOUT_S = 120


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class TaskValidation:
    task_id: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def hidden_markers(task: Task, repo: Path, limit: int = 3) -> list[str]:
    """Distinctive lines of the hidden tests that do not occur in the agent's repo."""
    candidates: list[str] = []
    for content in task.hidden_files.values():
        candidates += content.splitlines()
    for line in task.test_patch.splitlines():
        if line.startswith("+") and not line.startswith("+++"):
            candidates.append(line[1:])
    candidates = sorted({c.strip() for c in candidates if len(c.strip()) >= 16}, key=len, reverse=True)
    tree = ""
    for p in repo.rglob("*"):
        if p.is_file() and ".git" not in p.relative_to(repo).parts:
            try:
                tree += p.read_text(errors="ignore") + "\n"
            except OSError:
                pass
    return [c for c in candidates if c not in tree][:limit]


def _search_script() -> str:
    """Looks for the lines in /tmp/.markers (written apart, so no command line carries them)."""
    import sys

    skip = ["/proc", "/sys", "/dev", "/usr", "/etc", str(Path(sys.base_prefix).resolve()), str(Path(sys.prefix))]
    prune = " -o ".join(f"-path {shlex.quote(s)}" for s in skip)
    return f"""
found=""
hits=$(find / \\( {prune} -o -path /tmp/.markers \\) -prune -o -type f -size -8M -print0 2>/dev/null \\
       | xargs -0 -r grep -lIF -f /tmp/.markers 2>/dev/null | head -n 5)
[ -n "$hits" ] && found="$found files:$hits"
objs=$(git -c safe.directory='*' cat-file --batch-all-objects --batch 2>/dev/null | grep -cF -f /tmp/.markers)
[ "${{objs:-0}}" != "0" ] && found="$found git-objects:$objs"
n=$(git -c safe.directory='*' rev-list --all --reflog 2>/dev/null | wc -l)
[ "$n" != "1" ] && found="$found commits:$n"
env | grep -qF -f /tmp/.markers && found="$found environment"
cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' '\\n' | grep -qF -f /tmp/.markers && found="$found cmdlines"
echo "FOUND:${{found:-nothing}}"
"""


async def hidden_test_lookup(
    task: Task, work: Path, hide_paths: list[Path], visible_paths: tuple[Path, ...] = (),
    sandbox: SandboxConfig | None = None,
) -> Check:
    """Run a search for the hidden tests inside an agent sandbox prepared like a rollout's
    (``visible_paths``: extra host dirs the rollouts' sandboxes show, e.g. toolchains)."""
    ws = work / "lookup-ws"
    await asyncio.to_thread(prepare_repo, task, ws)
    markers = hidden_markers(task, ws)
    if not markers:
        return Check("hidden_test_lookup", True, "no distinctive hidden-test lines to look for")
    box = await create_sandbox(
        sandbox, workspace=ws, sandbox_dir=work / "lookup-sb", label=f"validate-{task.instance_id}",
        hide_paths=hide_paths, inside_workspace=task.workdir, visible_paths=visible_paths, image=task.image,
        environment=task.environment,
    )  # fmt: skip
    try:
        await box.write_file("/tmp/.markers", "\n".join(markers) + "\n")
        r = await box.exec(_search_script(), timeout=SEARCH_TIMEOUT_S)
    finally:
        await box.close()
    found = next((x for x in r.output.splitlines() if x.startswith("FOUND:")), "FOUND:?")[6:]
    if r.timed_out or found == "?":
        return Check("hidden_test_lookup", False, f"search did not finish (exit {r.returncode}): {r.output[-200:]}")
    return Check("hidden_test_lookup", found == "nothing", "not found" if found == "nothing" else f"found: {found}")


async def solution_diff(task: Task, work: Path, hide_paths: list[Path], timeout: float = 600,
                        sandbox: SandboxConfig | None = None) -> str:
    """Run a Harbor/terminal-bench solution script in an agent sandbox; its workspace diff is the gold patch."""
    ws = work / "solution-ws"
    base = await asyncio.to_thread(prepare_repo, task, ws)
    box = await create_sandbox(
        sandbox, workspace=ws, sandbox_dir=work / "solution-sb", label=f"validate-{task.instance_id}",
        hide_paths=hide_paths, inside_workspace=task.workdir, image=task.image, environment=task.environment,
    )  # fmt: skip
    try:
        await box.write_file("/tmp/solve.sh", task.solution_script)
        r = await box.exec("bash /tmp/solve.sh", timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"solution script failed (exit {r.returncode}): {r.output[-300:]}")
        return await workspace_diff(box, base)
    finally:
        await box.close()


def _verdict(report: GraderReport, want: Outcome) -> tuple[bool, str]:
    ok = report.outcome == want
    return ok, (f"{report.outcome.value}" + (f": {report.reason}" if report.reason else ""))[:300]


async def validate_task(
    task: Task,
    work_dir: Path,
    *,
    timeout: float = 120,
    hide_paths: list[Path] | None = None,
    canaries: tuple[str, ...] | None = None,
    concurrency: int = 2,
    sandbox: SandboxConfig | None = None,
) -> TaskValidation:
    """``sandbox``: the backend every check's sandboxes are made with (default bwrap)."""
    out = TaskValidation(task.instance_id)
    work = Path(tempfile.mkdtemp(prefix="validate-", dir=work_dir))
    hide = [*(hide_paths or []), work]
    names = canaries if canaries is not None else (*PATCH_CANARIES, *AGENT_CANARIES)
    try:
        pristine = work / "pristine"
        await asyncio.to_thread(prepare_repo, task, pristine)
        ctx = CanaryContext(task, pristine)
        gold = task.patch
        if not gold and task.solution_script:
            gold = await solution_diff(task, work, hide, sandbox=sandbox)
        jobs: list[tuple[str, Callable[[], Awaitable[Check]]]] = []

        def graded(name: str, diff: str, want: Outcome) -> Callable[[], Awaitable[Check]]:
            async def run() -> Check:
                rep = await grade(task, diff, work_dir=work, timeout=timeout, hide_paths=hide,
                                  label=f"validate-{task.instance_id}", sandbox=sandbox)  # fmt: skip
                ok, detail = _verdict(rep, want)
                return Check(name, ok, detail)

            return run

        if gold:
            jobs.append(("gold", graded("gold", gold, Outcome.RESOLVED)))
        else:
            out.checks.append(Check("gold", False, "task has neither a gold patch nor a solution script"))
        jobs.append(("empty", graded("empty", "", Outcome.UNRESOLVED)))
        for name in names:
            if name in PATCH_CANARIES:
                jobs.append((name, graded(name, PATCH_CANARIES[name](ctx), Outcome.UNRESOLVED)))
            elif name == "hidden_test_lookup":
                jobs.append((name, lambda: hidden_test_lookup(task, work, hide, sandbox=sandbox)))
            else:
                raise ValueError(f"unknown canary {name!r}")
        sem = asyncio.Semaphore(concurrency)

        async def guarded(name: str, job: Callable[[], Awaitable[Check]]) -> Check:
            async with sem:
                try:
                    return await job()
                except Exception as e:  # noqa: BLE001 - one broken check is reported, not fatal
                    return Check(name, False, f"{type(e).__name__}: {e}"[:300])

        out.checks += await asyncio.gather(*(guarded(n, j) for n, j in jobs))
    except Exception as e:  # noqa: BLE001 - e.g. the repo cannot be prepared: the task fails validation
        out.checks.append(Check("prepare", False, f"{type(e).__name__}: {e}"[:300]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


async def validate_tasks(
    tasks: list[Task],
    work_dir: Path,
    *,
    timeout: float = 120,
    hide_paths: list[Path] | None = None,
    canaries: tuple[str, ...] | None = None,
    concurrency: int = 2,
    on_result: Callable[[TaskValidation], None] | None = None,
    sandbox: SandboxConfig | None = None,
) -> list[TaskValidation]:
    results = []
    for task in tasks:
        res = await validate_task(
            task, work_dir, timeout=timeout, hide_paths=hide_paths, canaries=canaries, concurrency=concurrency,
            sandbox=sandbox,
        )
        if on_result is not None:
            on_result(res)
        results.append(res)
    return results
