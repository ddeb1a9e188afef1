"""Real-task benchmark: `legorl tasks synth` over the bundled packages, every kept task validated.

    python bench/synth.py --n 20 --out runs/bench-synth

runs ``legorl tasks synth --bundled --out OUT --n N --seed S`` (niced; validation on, so every
task counted passed gold / empty / all canaries) and reports, from ``OUT/synth-report.json``:
tasks kept per package, what was rejected and why, minutes mining and validating, and validated
tasks per minute of wall time. Targets (issue 23): at least 200 validated tasks from at least 10
packages. ``--report`` re-reads an existing OUT without running anything; ``--only-new`` mines only
the packages OUT has no tasks of yet (the rate is over those).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGORL = [str(Path(sys.executable).with_name("legorl"))]


def run(args: argparse.Namespace) -> float:
    chosen = [x for p in args.package for x in ("--package", p)] if args.package else ["--bundled"]
    cmd = ["nice", "-n", "10", *LEGORL, "tasks", "synth", *chosen, "--out", str(args.out), "--n", str(args.n),
           "--seed", str(args.seed), "--heldout-fraction", str(args.heldout_fraction),
           *(["--only-new"] if args.only_new else [])]  # fmt: skip
    print("$", "legorl", " ".join(cmd[4:]), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=False, env={**os.environ, "COLUMNS": "160"})
    return time.monotonic() - t0


def report(out: Path, wall_s: float | None) -> dict:
    rep = json.loads((out / "synth-report.json").read_text())
    pk = rep["packages"]
    # Rate over what this run mined (--only-new leaves earlier packages' entries as they were).
    ran = [p for p in pk if p["package"] in rep.get("this_run", [p["package"] for p in pk])]
    wall = wall_s if wall_s is not None else sum(p["seconds"] + p.get("validate_s", 0.0) for p in ran)
    validated = rep["kept"] if rep.get("validated") else 0
    validated_run = sum(p["kept"] for p in ran) if rep.get("validated") else 0
    mining = sum(p["seconds"] for p in ran)
    validating = sum(p.get("validate_s", 0.0) for p in ran)
    print(f"\n{'package':24s} {'kept':>5s} {'tried':>6s} {'mine min':>9s} {'val min':>8s}  rejected")
    for p in pk:
        rej = ", ".join(f"{k} {v}" for k, v in p["rejected"].items()) or "-"
        print(f"{p['package']:24s}{'*' if p in ran else ' '}{p['kept']:5d} {p['tried']:6d} {p['seconds'] / 60:9.1f} "
              f"{p.get('validate_s', 0) / 60:8.1f}  {rej}{'  ERROR ' + p['error'][:60] if p['error'] else ''}")  # fmt: skip
    for spec, err in rep.get("errors", {}).items():
        print(f"{spec:24s} ERROR {err[:100]}")
    n_pk = sum(1 for p in pk if p["kept"])
    summary = {
        "validated_tasks": validated,
        "packages_with_tasks": n_pk,
        "mined_this_run": [p["package"] for p in ran],
        "validated_this_run": validated_run,
        "wall_min": round(wall / 60, 1),
        "mining_min": round(mining / 60, 1),
        "validating_min": round(validating / 60, 1),
        "validated_per_min": round(validated_run / (wall / 60), 2) if wall else 0.0,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(summary, indent=2))
    ok = validated >= 200 and n_pk >= 10
    print(f"target (>= 200 validated tasks from >= 10 packages): {'met' if ok else 'NOT met'}")
    (out / "bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20, help="tasks per package")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-fraction", type=float, default=0.2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-synth")
    ap.add_argument("--package", action="append", help="instead of the bundled list (repeatable)")
    ap.add_argument("--report", action="store_true", help="only summarise an existing OUT")
    ap.add_argument("--only-new", action="store_true",
                    help="mine only packages without tasks in OUT (rate over those; `*` in the table)")
    args = ap.parse_args()
    wall = None if args.report else run(args)
    report(args.out, wall)


if __name__ == "__main__":
    main()
