"""Transfer between harnesses: a policy trained through harness A, evaluated through harness B.

For each finished run (one per training harness: `make demo HARNESS=A`), its warm start
(`checkpoints/sft`) and its RL result (`checkpoints/latest`) are evaluated on the held-out tasks
through every harness B, with B's demo config (its prompt switches). The table's cell (A, B) is
held-out pass@1 "after SFT -> after RL", so the diagonal is each run's own lift and the rest is
what RL through A did to B.

    .venv/bin/python bench/transfer.py mini-swe-agent=runs/A claude-code=runs/B codex=runs/C [--samples 1]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from legorl.config import load_config
from legorl.pipeline import Driver

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"mini-swe-agent": "demo.yaml", "claude-code": "demo-claude-code.yaml", "codex": "demo-codex.yaml"}


async def pass_at_1(checkpoint: Path, harness: str, samples: int, n_heldout: int | None) -> float:
    overrides = [f"model.path={checkpoint.resolve()}", f"eval.samples={samples}", "monitor.dashboard=false",
                 "sft.enabled=false"]
    if n_heldout:
        overrides.append(f"tasks.n_heldout={n_heldout}")
    cfg = load_config(ROOT / "configs" / CONFIGS[harness], overrides)
    with tempfile.TemporaryDirectory() as run_dir:
        async with Driver(cfg, Path(run_dir)) as driver:
            m = await driver.evaluate(step=0)
    return m["eval/heldout/pass_at_1"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", help="HARNESS=RUN_DIR: the run that trained through HARNESS")
    ap.add_argument("--samples", type=int, default=1, help="samples per held-out task")
    ap.add_argument("--heldout", type=int, default=None, help="held-out tasks (default: the demo configs')")
    args = ap.parse_args()
    runs = dict(item.split("=", 1) for item in args.runs)
    unknown = set(runs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown harness {sorted(unknown)}: choose from {sorted(CONFIGS)}")
    names = list(CONFIGS)
    print("| trained through \\ evaluated through | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for trained, run_dir in runs.items():
        cells = []
        for evaluated in names:
            sft, rl = (asyncio.run(pass_at_1(Path(run_dir) / "checkpoints" / c, evaluated, args.samples, args.heldout))
                       for c in ("sft", "latest"))
            cells.append(f"{sft:.3f} -> {rl:.3f}")
        print(f"| {trained} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
