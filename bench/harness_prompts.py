"""Prompt tokens per model call of each harness, with its defaults and with the shortened configuration.

Each harness plays the scripted teacher's episodes (read the function, fix the line, finish) on
built-in tasks through the proxy, as `make demo` does; the figures are the recorded prompt
lengths (the built-in tokenizer): the first call of each episode and the median over all calls.
The shortened configurations are those of configs/demo-claude-code.yaml and configs/demo-codex.yaml.

    .venv/bin/python bench/harness_prompts.py [--episodes 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import yaml

from legorl.config import load_config
from legorl.pipeline import Driver

ROOT = Path(__file__).resolve().parents[1]


def shortened(name: str) -> list[str]:
    """The harness switches of the demo config for `name`, as dotted overrides."""
    harness = yaml.safe_load((ROOT / "configs" / f"demo-{name}.yaml").read_text())["harness"]
    return [f"harness.{k}={yaml.safe_dump(v, default_flow_style=True, width=1 << 20).strip().removesuffix('...').strip()}"
            for k, v in harness.items() if k in ("system_prompt", "append_system_prompt", "tools", "codex_config")]


async def measure(overrides: list[str], episodes: int) -> tuple[list[int], list[int]]:
    cfg = load_config(None, ["sft.enabled=true", "monitor.dashboard=false", "tasks.n_train=8", "tasks.n_heldout=0",
                             *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        async with Driver(cfg, Path(run_dir)) as driver:
            demos = await driver.collect_demos(episodes)
    first = [len(r.calls[0].prompt_ids) for r in demos if r.calls]
    every = [len(c.prompt_ids) for r in demos for c in r.calls]
    return first, every


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=4)
    args = ap.parse_args()
    cases = [("mini-swe-agent", "legorl's default", ["harness.name=mini-swe-agent"])]
    for name in ("claude-code", "codex"):
        cases.append((name, "its defaults", [f"harness.name={name}"]))
        cases.append((name, "shortened (demo config)", [f"harness.name={name}", *shortened(name)]))
    print(f"| harness | configuration | first call (median of {args.episodes}) | median per call | calls |")
    print("|---|---|---:|---:|---:|")
    for name, label, overrides in cases:
        first, every = asyncio.run(measure(overrides, args.episodes))
        print(f"| {name} | {label} | {statistics.median(first):,.0f} | {statistics.median(every):,.0f} | "
              f"{len(every)} |", flush=True)


if __name__ == "__main__":
    main()
