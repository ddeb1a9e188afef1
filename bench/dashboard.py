"""Dashboard server time on a large synthetic store: overview and rollouts-table endpoints.

    .venv/bin/python bench/dashboard.py                       # 100k rollouts, ~1M calls
    .venv/bin/python bench/dashboard.py --steps 100 --reps 20 # quick look
    .venv/bin/python bench/dashboard.py --update-benchmarks   # also rewrite "## Dashboard" in BENCHMARKS.md

Each request goes through the whole ASGI app in-process (FastAPI TestClient: routing, handler, SQLite,
JSON encoding); no network. "cold" clears the app's result cache before every request, as when a live
run commits between two polls; "warm" is a repeat on an unchanged store. The floor is /api/health on
the same app (framework overhead), measured in the same run; the target is under 200 ms per endpoint.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_MS = 200.0

QUERIES = {
    "overview": "/api/overview",
    "rollouts: first page": "/api/rollouts",
    "rollouts: failed, page 1": "/api/rollouts?outcome=failed",
    "rollouts: one step": "/api/rollouts?step=500&split=train",
    "rollouts: task substring": "/api/rollouts?task=0042",
    "rollouts: harness + reward, sorted by reward": "/api/rollouts?harness=codex&reward_min=1&sort=reward&order=asc",
    "rollouts: page 1000 of 2000": "/api/rollouts?page=1000&per_page=50",
    "task grid (the last 120 steps)": "/api/tasks?split=train",
    "progress (phase, time left)": "/api/progress",
    "resolved config": "/api/config",
}
COMPARE = "/api/compare"  # the run beside two more of its size: target < 500 ms
COMPARE_TARGET_MS = 500.0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def measure(client, app_db, path: str, reps: int, cold: bool) -> list[float]:
    out = []
    for _ in range(reps):
        if cold:
            app_db._cache.clear()
        t = time.perf_counter()
        r = client.get(path)
        out.append((time.perf_counter() - t) * 1000)
        if r.status_code != 200:
            raise SystemExit(f"{path}: HTTP {r.status_code} {r.text[:200]}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--rollouts-per-step", type=int, default=100)
    ap.add_argument("--calls-per-rollout", type=int, default=10, help="mean (each rollout has 1..2*mean-1)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dir", type=Path, default=None, help="where to build the store (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true", help="measure the store already in --dir")
    ap.add_argument("--update-benchmarks", action="store_true", help="rewrite the '## Dashboard' section")
    args = ap.parse_args()

    from fastapi.testclient import TestClient

    from legorl.monitor.server import create_app
    from legorl.monitor.synthetic import SyntheticSpec, build_synthetic_store

    load_before = os.getloadavg()
    run = args.dir or Path(tempfile.mkdtemp(prefix="legorl-bench-dashboard-"))
    spec = SyntheticSpec(steps=args.steps, rollouts_per_step=args.rollouts_per_step,
                         group_size=4, calls_per_rollout=args.calls_per_rollout, tasks=2000, eval_every=0,
                         full_history=False)
    t0 = time.perf_counter()
    if (run / "store.sqlite").exists() and args.reuse:
        import sqlite3

        with sqlite3.connect(run / "store.sqlite") as c:
            counts = {"rollouts": c.execute("SELECT COUNT(*) FROM rollouts").fetchone()[0],
                      "calls": c.execute("SELECT MAX(id) FROM llm_calls").fetchone()[0],
                      "steps": c.execute("SELECT COUNT(*) FROM steps").fetchone()[0]}
    else:
        counts = build_synthetic_store(run / "store.sqlite", spec)
    build_s = time.perf_counter() - t0
    size_mb = (run / "store.sqlite").stat().st_size / 2**20
    print(f"store: {counts['rollouts']:,} rollouts, {counts['calls']:,} calls, {counts['steps']} steps, "
          f"{size_mb:.0f} MiB, built in {build_s:.1f} s -> {run}", flush=True)
    import json

    from legorl.config import Config
    from legorl.monitor.progress import RunProgress

    (run / "config.json").write_text(json.dumps(Config().model_dump()))
    progress = RunProgress(run, args.steps, ["eval_before_rl", "rl", "eval_after_rl"])
    progress.enter("rl", {"eval_before_rl": 120.0})
    t0 = time.perf_counter()
    app = create_app(run)  # adds the dashboard's indexes
    index_s = time.perf_counter() - t0
    client = TestClient(app, base_url="http://127.0.0.1")  # the dashboard answers loopback names only
    db = app.state.db
    for path in QUERIES.values():  # warm the page cache and the threadpool once
        client.get(path)
    floor = measure(client, db, "/api/health", args.reps, cold=False)
    rows = []
    for name, path in QUERIES.items():
        cold = measure(client, db, path, args.reps, cold=True)
        warm = measure(client, db, path, args.reps, cold=False)
        rows.append((name, path, statistics.median(cold), pct(cold, 99), statistics.median(warm), pct(warm, 99)))
        print(f"{name:48s} cold p50 {rows[-1][2]:7.1f} ms  p99 {rows[-1][3]:7.1f} ms   warm p50 {rows[-1][4]:6.1f} ms",
              flush=True)
    f50 = statistics.median(floor)
    print(f"{'floor: /api/health':48s}      p50 {f50:7.1f} ms")
    # three runs of this size side by side (this store under three names: each its own reader and caches)
    twins = [run.parent / f"{run.name}-twin{i}" for i in (1, 2)]
    for twin in twins:
        if not twin.exists():
            twin.symlink_to(run, target_is_directory=True)
    cmp_app = create_app(run, compare_with=twins)
    cmp_client = TestClient(cmp_app, base_url="http://127.0.0.1")
    cmp_client.get(COMPARE)
    cold = measure(cmp_client, cmp_app.state.db, COMPARE, max(5, args.reps // 5), cold=True)
    compare_row = (statistics.median(cold), pct(cold, 99))
    print(f"{'compare: 3 runs (/api/compare)':48s} cold p50 {compare_row[0]:7.1f} ms  p99 {compare_row[1]:7.1f} ms  "
          f"target < {COMPARE_TARGET_MS:.0f} ms: {'met' if compare_row[1] < COMPARE_TARGET_MS else 'NOT met'}")
    worst = max(r[3] for r in rows)
    verdict = "met" if worst < TARGET_MS else "NOT met"
    print(f"target < {TARGET_MS:.0f} ms: {verdict} (worst cold p99 {worst:.1f} ms)")
    load = (load_before, os.getloadavg())
    if args.update_benchmarks:
        write_section(counts, size_mb, build_s, index_s, rows, f50, args, verdict, worst, load, compare_row)


def write_section(counts, size_mb, build_s, index_s, rows, f50, args, verdict, worst, load, compare_row) -> None:
    cpu = platform.processor() or platform.machine()
    lines = [
        "## Dashboard",
        "",
        ("Server time of the dashboard's JSON endpoints on a synthetic store with the real schema "
        f"({counts['rollouts']:,} rollouts, {counts['calls']:,} LLM calls, {counts['steps']} steps, "
        f"{size_mb:.0f} MiB; built with executemany in {build_s:.0f} s, the dashboard's indexes added in "
        f"{index_s:.1f} s on first open). Each request runs the whole ASGI app in-process (FastAPI TestClient): "
        "routing, handler, SQLite, JSON. *cold* clears the app's result cache before every request (a live run "
        "commits between polls); *warm* repeats on an unchanged store. "
        f"{args.reps} requests each. Target: under {TARGET_MS:.0f} ms per endpoint: **{verdict}** "
        f"(worst cold p99 {worst:.0f} ms)."),
        "",
        "| endpoint | cold p50 (ms) | cold p99 (ms) | warm p50 (ms) | cold p50 / floor |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, path, c50, c99, w50, _ in rows:
        lines.append(f"| {name} (`{path}`) | {c50:.1f} | {c99:.1f} | {w50:.1f} | {c50 / f50:.1f}x |")
    lines += [
        f"| floor: `/api/health` (framework overhead) | {f50:.1f} | | | 1.0x |",
        "",
        (f"Three such runs side by side (`{COMPARE}`, the store under three names, each with its own reader and "
         f"caches): cold p50 **{compare_row[0]:.0f} ms**, p99 {compare_row[1]:.0f} ms; target under "
         f"{COMPARE_TARGET_MS:.0f} ms: **{'met' if compare_row[1] < COMPARE_TARGET_MS else 'NOT met'}**."),
        "",
        (f"Machine: {platform.system()} {cpu}, {os.cpu_count()} cores, Python {platform.python_version()}; "
         "shared with other jobs running at the same time (load average "
         f"{' / '.join(f'{x:.1f}' for x in load[0])} before, {' / '.join(f'{x:.1f}' for x in load[1])} after): "
         "absolute figures move with load, ratios to the floor measured in the same run are the stable part."),
        "",
        ("Reproduce: `.venv/bin/python bench/dashboard.py --update-benchmarks` "
        f"(defaults: --steps {args.steps} --rollouts-per-step {args.rollouts_per_step} "
        f"--calls-per-rollout {args.calls_per_rollout} --reps {args.reps})."),
        "",
    ]
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    section = "\n".join(lines) + "\n"  # a blank line before the next section
    pattern = re.compile(r"^## Dashboard\n.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)
    text = pattern.sub(section, text) if pattern.search(text) else text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
    print(f"wrote the '## Dashboard' section of {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
