"""Grading benchmark: CPU-seconds per graded patch, pooled zygote vs a fresh sandbox per patch, same run.

The workload: built-in tasks (one per family, ``--tasks`` of them), each graded on its gold patch, an
empty patch and every adversarial canary of ``grading/canaries.py`` (9 patches a task), ``--concurrency``
gradings at once, through ``grade()`` exactly as a rollout's would be. Two passes over the same patches:

* fresh: ``LEGORL_GRADING_ZYGOTE=0``, a fresh sandbox, interpreter and ``import pytest`` per patch;
* pooled: the default, pooled grading sandboxes whose zygote forks a fresh pytest process per patch
  (``grading/pool.py``); its members' start-up and each task's one pristine ``prepare_repo`` included.

CPU time is that of the whole grading, host and sandbox processes: this process moves itself into a cgroup
of its own in the cgroup v1 ``cpuacct`` hierarchy (separate from the ``cpu`` one that sandboxes' CPU
shares move into), which counts every descendant, killed or not; without one, ``getrusage`` of this
process and its reaped children is used and the table says so (it misses what a sandbox's kill leaves
unreaped). Verdicts of the two passes must be identical (outcome, reason, per-test statuses).

Target: at most 0.2 CPU-seconds per patch pooled. ``--write`` puts a summary in BENCHMARKS.md ("## Grading")
and the table in docs/grading.md ("## Measured").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import resource
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from legorl.grading import grade
from legorl.grading.canaries import PATCH_CANARIES, CanaryContext
from legorl.grading.pool import SWITCH, current_pool
from legorl.tasks import FAMILIES, generate_tasks, prepare_repo

TARGET = 0.2
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class CpuMeter:
    """CPU-seconds of this process and everything it starts (a cpuacct cgroup of its own when possible)."""

    def __init__(self) -> None:
        self.cgroup: Path | None = None
        if (CPUACCT / "cpuacct.usage").exists():
            try:
                cg = CPUACCT / f"legorl-bench-grading-{secrets.token_hex(3)}"
                cg.mkdir()
                (cg / "cgroup.procs").write_text(str(os.getpid()))
                self.cgroup = cg
            except OSError:
                self.cgroup = None
        self.how = "cgroup v1 cpuacct (every process)" if self.cgroup else "getrusage self + reaped children"

    def now(self) -> float:
        if self.cgroup is not None:
            return int((self.cgroup / "cpuacct.usage").read_text()) / 1e9
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    def close(self) -> None:
        if self.cgroup is not None:
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            for _ in range(50):
                try:
                    self.cgroup.rmdir()
                    break
                except OSError:  # a sandbox process still leaving
                    time.sleep(0.1)


def workload(n_tasks: int, scratch: Path) -> list[tuple]:
    tasks = generate_tasks(None, n_tasks, seed=7, split="train")
    cases = []
    for i, task in enumerate(tasks):
        ctx = CanaryContext(task, scratch / f"pristine-{i}")
        prepare_repo(task, ctx.repo)
        cases += [(task, "gold", task.patch), (task, "empty", "")]
        cases += [(task, name, make(ctx)) for name, make in PATCH_CANARIES.items()]
    return cases


def verdict(rep) -> tuple:
    return rep.outcome.value, re.sub(r"'\d{6,}'", "'<id>'", rep.reason), sorted(rep.tests.items())


async def one_pass(cases: list[tuple], pooled: bool, concurrency: int, meter: CpuMeter, work: Path) -> dict:
    os.environ[SWITCH] = "1" if pooled else "0"
    sem = asyncio.Semaphore(concurrency)

    async def one(task, diff):
        async with sem:
            return await grade(task, diff, work_dir=work, label="bench-grading")

    c0, w0, h0 = meter.now(), time.perf_counter(), time.process_time()
    reports = await asyncio.gather(*(one(t, d) for t, _, d in cases))
    cpu, wall, host = meter.now() - c0, time.perf_counter() - w0, time.process_time() - h0
    pool = current_pool()
    return {"reports": reports, "cpu": cpu, "wall": wall, "host": host, "started": pool.started,
            "test_cpu": sum(m.test_cpu_s for m in pool.live.values())}  # fmt: skip


async def run(args: argparse.Namespace, meter: CpuMeter) -> str:
    load0 = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="legorl-bench-grading-"))
    cases = workload(args.tasks, scratch)
    work = scratch / "work"
    # The pool's members start once (then serve up to 200 patches each): their start, with a first gold
    # grading each, is measured on its own; the passes below grade on warm members.
    warm_cases = [c for c in cases if c[1] == "gold"][: args.concurrency]
    warm = await one_pass(warm_cases, True, args.concurrency, meter, work)
    kinds = {"gold + empty": [c for c in cases if c[1] in ("gold", "empty")],
             f"{len(PATCH_CANARIES)} adversarial canaries": [c for c in cases if c[1] not in ("gold", "empty")]}
    passes = {}
    for kind, subset in kinds.items():  # interleaved, so that a change of load moves both paths alike
        passes[kind] = (await one_pass(subset, False, args.concurrency, meter, work),
                        await one_pass(subset, True, args.concurrency, meter, work))  # fmt: skip
    load1 = os.getloadavg()
    shutil.rmtree(scratch, ignore_errors=True)
    rows, mismatches, n_all, totals = [], [], 0, {"fresh": 0.0, "pooled": 0.0, "host": 0.0}
    ok = {"gold": True, "others": True}
    for kind, (fresh, pooled) in passes.items():
        subset, n = kinds[kind], len(kinds[kind])
        n_all += n
        totals["fresh"] += fresh["cpu"]
        totals["pooled"] += pooled["cpu"]
        totals["host"] += pooled["host"]
        for (t, name, _), a, b in zip(subset, fresh["reports"], pooled["reports"], strict=True):
            if verdict(a) != verdict(b):
                mismatches.append((t.family, name))
            ok["gold" if name == "gold" else "others"] &= b.resolved == (name == "gold")
        pf, pp = fresh["cpu"] / n, pooled["cpu"] / n
        rows.append(f"| {kind} | {n} | {pf:.3f} | **{pp:.3f}** | {pf / pp:.2f}x | {fresh['wall']:.1f} / {pooled['wall']:.1f} |")
    test_cpu = list(passes.values())[-1][1]["test_cpu"]  # cumulative over the pool's members, all passes
    pf, pp = totals["fresh"] / n_all, totals["pooled"] / n_all
    with_start = (totals["pooled"] + warm["cpu"]) / (n_all + len(warm_cases))
    rows.append(f"| all | {n_all} | {pf:.3f} | **{pp:.3f}** | {pf / pp:.2f}x | |")
    lines = [
        "| patches | n | fresh sandbox per patch (peer), CPU s / patch | pooled zygote, CPU s / patch | less | wall s (fresh / pooled) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        (f"- Pooled: **{pp:.3f} CPU-s per patch** on all {n_all} (target <= {TARGET}: "
         f"{'met' if pp <= TARGET else 'NOT met'}), {pf / pp:.1f}x less than a fresh sandbox per patch ({pf:.3f}). "
         f"Pool start: {warm['started']} member(s), {warm['cpu']:.2f} CPU-s with a first grading each; counted in, "
         f"{with_start:.3f} per patch over this run (a member serves up to 200)."),
        (f"- Where the pooled cost goes, per patch: {test_cpu / (n_all + len(warm_cases)):.3f} in pytest itself (the "
         f"forked test process and what it starts), {totals['host'] / n_all:.3f} in the driver process (diff "
         f"policy, repo copy, result stream, verdict), the rest in the sandbox: the run's namespaces and forks, "
         f"`git apply` and the hidden tests."),
        f"- Verdicts: {n_all - len(mismatches)}/{n_all} identical between the two paths"
        + (f" (differ: {mismatches[:5]})" if mismatches else "")
        + f"; every gold patch resolves: {'yes' if ok['gold'] else 'NO'}; every empty patch and canary is "
        f"unresolved: {'yes' if ok['others'] else 'NO'}.",
        (f"- Workload: {args.tasks} built-in tasks (one per family) x (gold, empty, {len(PATCH_CANARIES)} canaries "
         f"of `grading/canaries.py`), {args.concurrency} gradings at once; CPU of the whole grading: {meter.how}."),
        (f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
         f"{platform.python_version()}; load average {load0[0]:.1f} before / {load1[0]:.1f} after (shared: "
         "absolute figures move with load, the same-run ratios are the comparable numbers)."),
        f"- Reproduce: `python bench/grading.py --write` (defaults: --tasks {len(FAMILIES)} --concurrency 2).",
    ]
    by_kind = ", ".join(f"{k} {passes[k][1]['cpu'] / len(kinds[k]):.3f}" for k in kinds)
    SUMMARY[0] = (
        f"`python bench/grading.py --write` ({time.strftime('%Y-%m-%d')}, load {load0[0]:.0f}): a pooled grading "
        f"sandbox whose zygote forks a fresh pytest process per patch, **{pp:.3f} CPU-s per patch** ({by_kind}) "
        f"vs **{pf:.3f}** for a fresh sandbox per patch in the same run, **{pf / pp:.1f}x less**, over {n_all} "
        f"built-in patches (target <= {TARGET}: {'met' if pp <= TARGET else 'NOT met'}); verdicts "
        f"{n_all - len(mismatches)}/{n_all} identical. Table and method: [docs/grading.md](docs/grading.md)."
    )
    return "\n".join(lines)


SUMMARY = [""]


def _replace_section(path: Path, heading: str, body: str) -> None:
    old = path.read_text()
    section = f"{heading}\n\n{body.strip()}\n\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    new = pattern.sub(lambda _: section, old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    path.write_text(new.rstrip() + "\n")


def write_section(text: str, summary: str) -> None:
    """The summary in BENCHMARKS.md (a file kept short), the whole table in docs/grading.md."""
    _replace_section(ROOT / "BENCHMARKS.md", "## Grading", summary)
    _replace_section(ROOT / "docs" / "grading.md", "## Measured", text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=len(FAMILIES), help="built-in tasks (one per family first)")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md (## Grading)")
    args = ap.parse_args()
    meter = CpuMeter()
    try:
        text = asyncio.run(run(args, meter))
    finally:
        meter.close()
    print(text)
    if args.write:
        write_section(text, SUMMARY[0])
        print(f"\nwritten to {ROOT / 'BENCHMARKS.md'} (## Grading) and docs/grading.md (## Measured)")


if __name__ == "__main__":
    main()
