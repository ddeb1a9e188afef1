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

Target: at most 0.2 CPU-seconds per patch pooled. ``--write`` puts the table in BENCHMARKS.md ("## Grading").
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

    c0, w0 = meter.now(), time.perf_counter()
    reports = await asyncio.gather(*(one(t, d) for t, _, d in cases))
    cpu, wall = meter.now() - c0, time.perf_counter() - w0
    pool = current_pool()
    zygote_cpu = sum(m.run_cpu_s for m in pool.live.values())
    return {"reports": reports, "cpu": cpu, "wall": wall, "started": pool.started, "zygote_cpu": zygote_cpu}


async def run(args: argparse.Namespace, meter: CpuMeter) -> str:
    load0 = os.getloadavg()
    scratch = Path(tempfile.mkdtemp(prefix="legorl-bench-grading-"))
    cases = workload(args.tasks, scratch)
    fresh = await one_pass(cases, False, args.concurrency, meter, scratch / "work")
    pooled = await one_pass(cases, True, args.concurrency, meter, scratch / "work")
    load1 = os.getloadavg()
    shutil.rmtree(scratch, ignore_errors=True)
    n = len(cases)
    mismatches = [(t.family, name) for (t, name, _), a, b in zip(cases, fresh["reports"], pooled["reports"],
                                                                   strict=True) if verdict(a) != verdict(b)]  # fmt: skip
    gold_ok = all(r.resolved for (_, name, _), r in zip(cases, pooled["reports"], strict=True) if name == "gold")
    others_fail = all(not r.resolved for (_, name, _), r in zip(cases, pooled["reports"], strict=True)
                      if name != "gold")  # fmt: skip
    per_fresh, per_pooled = fresh["cpu"] / n, pooled["cpu"] / n
    lines = [
        "| grading path | patches | CPU s | CPU s / patch | wall s | vs fresh |",
        "|---|---|---|---|---|---|",
        (f"| fresh sandbox + interpreter per patch (`{SWITCH}=0`, peer) | {n} | {fresh['cpu']:.1f} | "
        f"{per_fresh:.3f} | {fresh['wall']:.1f} | 1.00x |"),
        (f"| pooled sandbox, zygote fork per patch (default) | {n} | {pooled['cpu']:.1f} | **{per_pooled:.3f}** | "
        f"{pooled['wall']:.1f} | {per_fresh / per_pooled:.2f}x less |"),
        "",
        (f"- Pooled: **{per_pooled:.3f} CPU-s per patch** (target <= {TARGET}: "
        f"{'met' if per_pooled <= TARGET else 'NOT met'}), {per_fresh / per_pooled:.1f}x less than a fresh sandbox "
        f"per patch ({per_fresh:.3f}); of it {pooled['zygote_cpu'] / n:.3f} in the forked test processes (namespaces, "
        f"pytest run), the rest host side, `git apply` and hidden tests in the sandbox, {pooled['started']} pooled "
        f"sandbox start(s) and {args.tasks} pristine `prepare_repo`."),
        f"- Verdicts: {n - len(mismatches)}/{n} identical between the two paths"
        + (f" (differ: {mismatches[:5]})" if mismatches else "")
        + f"; gold resolves: {'yes' if gold_ok else 'NO'}; empty and {len(PATCH_CANARIES)} canaries all "
        f"unresolved: {'yes' if others_fail else 'NO'}.",
        (f"- Workload: {args.tasks} built-in tasks x (gold, empty, {len(PATCH_CANARIES)} canaries), {args.concurrency} "
        f"gradings at once. CPU: {meter.how}."),
        (f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python "
        f"{platform.python_version()}; load average {load0[0]:.1f} before / {load1[0]:.1f} after (shared: "
        "absolute figures move with load, the same-run ratio is the comparable number)."),
        f"- Reproduce: `python bench/grading.py --write` (defaults: --tasks {len(FAMILIES)} --concurrency 2).",
    ]
    return "\n".join(lines)


def write_section(text: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    old = path.read_text()
    section = f"## Grading\n\n{text.strip()}\n\n"
    pattern = re.compile(r"## Grading\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    new = pattern.sub(lambda _: section, old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    path.write_text(new.rstrip() + "\n")


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
        write_section(text)
        print(f"\nwritten to {ROOT / 'BENCHMARKS.md'} (## Grading)")


if __name__ == "__main__":
    main()
