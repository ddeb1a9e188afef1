"""Prompt tokens per model call of each harness, with its defaults and with the shortened configuration.

Each harness plays the scripted teacher's episodes (read the function, fix the line, finish) on
built-in tasks through the proxy, as `make demo` does; the figures are the recorded prompt
lengths (the built-in tokenizer): the first call of each episode and the median over all calls, and
the prefix the first calls of different tasks share (what the trainer forwards once for a micro-batch:
`trainer.shared_prefix`; a harness that writes the task's state early in its prompt shares little).
The shortened configurations are those of configs/demo-<harness>.yaml.

    .venv/bin/python bench/harness_prompts.py [--episodes 4] [--harness claude-code]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from pathlib import Path

from legorl.config import load_config
from legorl.pipeline import Driver

ROOT = Path(__file__).resolve().parents[1]


async def measure(config: Path | None, overrides: list[str], episodes: int) -> tuple[list[int], list[int], int]:
    """Prompt lengths of `episodes` teacher episodes (each a different task): first calls, every call, and
    the tokens all first calls share."""
    cfg = load_config(config, ["monitor.dashboard=false", "tasks.n_train=8", "tasks.n_heldout=0", "sft.demos=0",
                               *overrides])
    with tempfile.TemporaryDirectory() as run_dir:
        async with Driver(cfg, Path(run_dir)) as driver:
            demos = await driver.collect_demos(episodes)
    firsts = [r.calls[0].prompt_ids for r in demos if r.calls]
    every = [len(c.prompt_ids) for r in demos for c in r.calls]
    return [len(p) for p in firsts], every, len(os.path.commonprefix(firsts))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=4)
    ap.add_argument("--harness", action="append", help="only this harness (repeatable); default: all")
    args = ap.parse_args()
    claude, codex = ROOT / "configs" / "demo-claude-code.yaml", ROOT / "configs" / "demo-codex.yaml"
    cases = [
        ("mini-swe-agent", "legorl's default", None, []),
        ("claude-code", "its defaults", None, ["harness.name=claude-code"]),
        ("claude-code", "shortened, without --bare", claude, ["harness.extra_args=[]"]),  # what --bare removes
        ("claude-code", "shortened (demo config)", claude, []),
        ("codex", "its defaults", None, ["harness.name=codex"]),
        ("codex", "shortened (demo config)", codex, []),
        ("opencode", "its defaults", None, ["harness.name=opencode"]),
        ("opencode", "shortened (demo config)", ROOT / "configs" / "demo-opencode.yaml", []),
        ("openhands", "its defaults", None, ["harness.name=openhands"]),
        ("openhands", "shortened (demo config)", ROOT / "configs" / "demo-openhands.yaml", []),
        ("gemini-cli", "its defaults", None, ["harness.name=gemini-cli"]),
        ("gemini-cli", "shortened (demo config)", ROOT / "configs" / "demo-gemini-cli.yaml", []),
        ("qwen-code", "its defaults", None, ["harness.name=qwen-code"]),
        ("qwen-code", "shortened (demo config)", ROOT / "configs" / "demo-qwen-code.yaml", []),
    ]
    cases = [c for c in cases if not args.harness or c[0] in args.harness]
    print(f"| harness | configuration | first call (median of {args.episodes}) | median per call | calls "
          "| shared by the tasks' first calls |")
    print("|---|---|---:|---:|---:|---:|")
    for name, label, config, overrides in cases:
        first, every, shared = asyncio.run(measure(config, overrides, args.episodes))
        print(f"| {name} | {label} | {statistics.median(first):,.0f} | {statistics.median(every):,.0f} | "
              f"{len(every)} | {shared:,} |", flush=True)


if __name__ == "__main__":
    main()
