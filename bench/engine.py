"""Engine throughput on multi-turn agent sessions: the embedded engine vs sequential HF `generate`.

One run measures, on the same model and the same synthetic workload (N concurrent sessions of T
turns; turn 1 has a P-token prompt, every later prompt is the previous prompt + completion + U
new tokens, exactly what the proxy's token bridge sends; every turn samples exactly M tokens):

  engine            LocalEngine (continuous batching, slot KV cache, prefix reuse)
  engine, no reuse  the same engine with the prefix cache off
  engine, split     the same engine with `split_steps` (each large step as two halves in two threads)
  HF generate       the peer: `model.generate` one call at a time (batch 1), the whole prompt every turn

It prints a table of generated tokens/s and the ratios, and the share of prefill tokens the
prefix cache saved. `--write` puts the table in BENCHMARKS.md, section "## Engine".

    .venv/bin/python bench/engine.py                    # 32 sessions x 5 turns, 512-token first prompt
    .venv/bin/python bench/engine.py --sessions 8 --turns 3 --write

The peer runs sequentially, so its tokens/s does not depend on how many sessions it runs: it
runs `--peer-sessions` of them (default 4) to keep the benchmark short.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from legorl.engine import LocalEngine
from legorl.models import ModelSpec, build_model, build_tokenizer
from legorl.records import SamplingParams


@dataclass
class Row:
    name: str
    sessions: int
    generated: int
    seconds: float
    cpu: float  # process CPU seconds over the same window (every thread: engine worker and event loop)
    prompt_tokens: int = 0
    computed: int = 0
    reused: int = 0

    @property
    def tps(self) -> float:
        return self.generated / self.seconds

    @property
    def per_cpu(self) -> float:
        return self.generated / self.cpu


def turn_tokens(session: int, turn: int, n: int, vocab: int, group: int = 1) -> list[int]:
    """Synthetic tokens of a session's turn; with ``group`` > 1 the first prompt (turn 0) is shared by
    ``group`` consecutive sessions, like the samples of a GRPO group that start from the same task."""
    if turn == 0:
        session -= session % group
    g = torch.Generator().manual_seed(1000 * session + turn)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


async def run_engine(model, tok, args, prefix: bool, group: int = 1, split: bool = False) -> Row:
    eng = LocalEngine(
        model,
        tok,
        max_batch=args.sessions,
        stop_token_ids=[],
        prefix_cache_mb=args.prefix_cache_mb if prefix else 0,
        split_steps=split,
    )
    vocab = len(tok)

    async def session(s: int) -> int:
        prompt, made = turn_tokens(s, 0, args.prompt_tokens, vocab, group), 0
        for t in range(args.turns):
            sp = SamplingParams(
                temperature=1.0, max_tokens=args.max_tokens, seed=s * 100 + t, stop_token_ids=[]
            )
            res = await eng.generate(prompt, sp, rollout_id=f"s{s}")
            made += len(res.completion_ids)
            prompt = prompt + res.completion_ids + turn_tokens(s, t + 1, args.turn_tokens, vocab)
        return made

    t0, c0 = time.perf_counter(), time.process_time()
    made = await asyncio.gather(*[session(s) for s in range(args.sessions)])
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = eng.stats()
    await eng.close()
    name = "engine (prefix reuse)" if prefix else "engine, prefix reuse off"
    if group > 1:
        name = f"engine (prefix reuse), GRPO groups of {group}"
    if split:
        name += ", both cores (`split_steps`)"
    return Row(
        name,
        args.sessions,
        sum(made),
        dt,
        cpu,
        st["prompt_tokens"],
        st["prefill_tokens_computed"],
        st["prefill_tokens_reused"],
    )


def run_peer(model, tok, args) -> Row:
    vocab, made, prompt_tokens = len(tok), 0, 0
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        for s in range(args.peer_sessions):
            prompt = turn_tokens(s, 0, args.prompt_tokens, vocab)
            for t in range(args.turns):
                torch.manual_seed(s * 100 + t)
                out = model.generate(
                    torch.tensor([prompt]),
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens,
                    eos_token_id=None,
                    pad_token_id=tok.pad_token_id,
                )
                completion = out[0, len(prompt) :].tolist()
                made += len(completion)
                prompt_tokens += len(prompt)
                prompt = prompt + completion + turn_tokens(s, t + 1, args.turn_tokens, vocab)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return Row(
        "HF generate, sequential (peer)", args.peer_sessions, made, dt, cpu, prompt_tokens, prompt_tokens, 0
    )


def table(rows: list[Row], peer: Row) -> str:
    lines = [
        (
            "| run | sessions | generated tokens | wall s | tokens/s | vs peer | CPU s | tokens/CPU-s "
            "| vs peer (CPU) | prefill computed | prefill reused |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.sessions} | {r.generated} | {r.seconds:.1f} | {r.tps:.0f} | "
            f"{r.tps / peer.tps:.1f}x | {r.cpu:.1f} | {r.per_cpu:.0f} | {r.per_cpu / peer.per_cpu:.1f}x | "
            f"{r.computed} | {r.reused} |"
        )
    return "\n".join(lines)


def write_section(text: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"## Engine\n\n{text.strip()}\n\n"
    pattern = re.compile(r"## Engine\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    new = pattern.sub(lambda _: section, old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    path.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512, help="first prompt of a session")
    ap.add_argument("--turn-tokens", type=int, default=100, help="new tokens (tool output, user) per turn")
    ap.add_argument("--max-tokens", type=int, default=64, help="sampled tokens per turn")
    ap.add_argument("--peer-sessions", type=int, default=4)
    ap.add_argument(
        "--group-size", type=int, default=8, help="extra run: sessions sharing their first prompt"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads (same for every run)")
    ap.add_argument("--prefix-cache-mb", type=float, default=1024)
    ap.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md (## Engine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = ModelSpec(max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as d:
        tok = build_tokenizer(Path(d))
    model = build_model(spec, tok)
    params = sum(p.numel() for p in model.parameters())
    load_before = os.getloadavg()
    print(
        f"model: tiny Qwen3 {params / 1e6:.1f} M params (hidden {spec.hidden_size}, {spec.num_layers} layers, "
        f"vocab {len(tok)}); {args.sessions} sessions x {args.turns} turns, first prompt {args.prompt_tokens} "
        f"tokens, +{args.turn_tokens} per turn, {args.max_tokens} sampled per turn; torch threads {args.threads}",
        flush=True,
    )
    fast = asyncio.run(run_engine(model, tok, args, prefix=True))
    print(f"  {fast.name}: {fast.tps:.0f} tok/s", flush=True)
    plain = asyncio.run(run_engine(model, tok, args, prefix=False))
    print(f"  {plain.name}: {plain.tps:.0f} tok/s", flush=True)
    grouped = asyncio.run(run_engine(model, tok, args, prefix=True, group=args.group_size))
    print(f"  {grouped.name}: {grouped.tps:.0f} tok/s", flush=True)
    split = asyncio.run(run_engine(model, tok, args, prefix=True, split=True))
    print(f"  {split.name}: {split.tps:.0f} tok/s", flush=True)
    peer = run_peer(model, tok, args)
    print(f"  {peer.name}: {peer.tps:.0f} tok/s", flush=True)
    load_after = os.getloadavg()
    saved = fast.reused / max(1, fast.prompt_tokens)
    # Tokens no cache can save: every session's first prompt, and each later turn's new tokens plus the
    # last sampled token (sampled, never fed).
    must = args.sessions * (args.prompt_tokens + (args.turns - 1) * (args.turn_tokens + 1))
    best = 1 - must / max(1, fast.prompt_tokens)
    cmd = "python bench/engine.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            table([fast, plain, grouped, split, peer], peer),
            "",
            (
                f"- Prefill tokens saved by prefix reuse: **{saved:.1%}** ({fast.reused} of {fast.prompt_tokens} prompt "
                f"tokens reused) over {args.turns}-turn independent sessions (target >= 80%); the most any cache "
                f"can save on this workload is {best:.1%} (each session's own first prompt and each turn's new tokens "
                f"must be computed). With the first prompt shared by GRPO groups of {args.group_size}: "
                f"**{grouped.reused / max(1, grouped.prompt_tokens):.1%}**."
            ),
            (
                f"- Engine: **{fast.tps:.0f} tokens/s**, **{fast.tps / peer.tps:.1f}x** sequential HF `generate` "
                f"(issue 24 targets: >= 5,000 tokens/s and >= 30x); per CPU-second (process CPU time, which "
                f"other jobs on the machine move much less than wall time): {fast.per_cpu:.0f} vs "
                f"{peer.per_cpu:.0f} tokens, **{fast.per_cpu / peer.per_cpu:.1f}x**. Prefix reuse alone: "
                f"{fast.tps / plain.tps:.1f}x over the same engine without it. With `engine.split_steps` (a large "
                f"step as two halves in two threads, using the second core): **{split.tps:.0f} tokens/s**, "
                f"**{split.tps / peer.tps:.1f}x**, at {split.per_cpu:.0f} tokens per CPU-second. What bounds it: "
                "docs/experiments.md (engine, 2026-12-02 and 2026-12-03)."
            ),
            (
                f"- Workload: tiny Qwen3 ({params / 1e6:.1f} M params, hidden {spec.hidden_size}, {spec.num_layers} layers, "
                f"fp32, CPU), {args.sessions} concurrent sessions x {args.turns} turns, first prompt {args.prompt_tokens} "
                f"tokens, +{args.turn_tokens} new tokens per turn, {args.max_tokens} sampled tokens per turn (temperature "
                f"1, no stop); the peer runs {args.peer_sessions} of the sessions one call at a time (its rate does not "
                f"depend on the count)."
            ),
            (
                f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} torch "
                f"thread(s); load average {load_before[0]:.1f} before / {load_after[0]:.1f} after (other jobs share the "
                "CPU: absolute figures move with load; the runs execute one after another, so a load change "
                "between them moves the ratios too -- rerun on a quiet machine for stable figures)."
            ),
            f"- Reproduce: `{cmd.strip()}`",
        ]
    )
    print()
    print(text)
    if args.write:
        write_section(text)
        print("\nwritten to BENCHMARKS.md (## Engine)")


if __name__ == "__main__":
    main()
