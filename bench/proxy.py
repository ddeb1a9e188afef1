"""Proxy overhead: added latency per call (p50/p99) and calls/s with 64 concurrent sessions.

Three paths, one run, the same fast deterministic engine behind each, all over loopback HTTP:

* engine  -- an OpenAI-compatible engine server: render the chat template, tokenize (the same
             segment-cached encoder the proxy uses), "generate" (a fixed 12-token reply), decode;
* legorl  -- legorl's proxy with that engine in-process: token bridge, tool-call parsing, sessions,
             SDK-retry dedup and every call recorded to a SQLite store before answering;
* litellm -- LiteLLM's proxy (one worker) forwarding to the engine server.

Added latency = a path's per-call latency minus the engine server's (p50 of each, sequential calls
on multi-turn sessions); throughput = calls/s with 64 sessions calling concurrently. Every process
(client included) shares this machine's cores, so throughput figures are for this machine only.

    .venv/bin/python bench/proxy.py            # prints the table
    .venv/bin/python bench/proxy.py --write    # and updates the "## Proxy" section of BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a coding agent working in a repository. Use the bash tool to inspect files, run tests and "
          "edit code; one command per turn. When the task is done, say so. ") * 3
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the repository and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
REPLY = "Running the next command to check the tests."
MODEL = "bench-model"


# ---- the engine (shared by the engine server and legorl's proxy) ----------------------------------

def fixed_engine(tokenizer: Any) -> Any:
    from legorl.records import GenerationResult

    ids = tokenizer.encode(REPLY, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]

    class FixedEngine:
        weight_version = 0

        async def generate(self, prompt_ids: list[int], params: Any, *, rollout_id: str = "") -> Any:
            return GenerationResult(list(ids), [0.0] * len(ids), "stop", 0)

        def max_context(self) -> int:
            return 1 << 20

        async def update_weights(self, state_dict: Any) -> int:
            return 0

        async def close(self) -> None:
            return None

    return FixedEngine()


def load_tokenizer(cache: Path) -> Any:
    from legorl.models import build_tokenizer

    return build_tokenizer(cache, 4096)


async def serve_engine(port: int, cache: Path) -> None:
    """A minimal OpenAI-compatible engine server (what a harness would call without the proxy)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from legorl.proxy.bridge import CachedEncoder, template_messages

    tok = load_tokenizer(cache)
    engine = fixed_engine(tok)
    enc = CachedEncoder(tok)

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        text = tok.apply_chat_template(template_messages(body["messages"]), tools=body.get("tools"),
                                       add_generation_prompt=True, tokenize=False)
        ids = enc.encode(text)
        r = await engine.generate(ids, None)
        out = tok.decode(r.completion_ids, skip_special_tokens=True)
        answer = {"id": "chatcmpl-x", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": None,
                               "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": len(ids), "completion_tokens": len(r.completion_ids),
                            "total_tokens": len(ids) + len(r.completion_ids)}}
        return Response(json.dumps(answer), media_type="application/json")

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                        lifespan="off", backlog=2048)).serve()


async def serve_legorl(port: int, cache: Path, store_path: Path) -> None:
    from legorl.proxy.server import Proxy, SamplingOverride
    from legorl.store import Store

    tok = load_tokenizer(cache)
    store = Store(store_path)
    proxy = Proxy(fixed_engine(tok), tok, sampling=SamplingOverride(max_tokens=64), model_name=MODEL,
                  on_call=store.add_call, accept_new_sessions=True)
    await proxy.start("127.0.0.1", port)
    await asyncio.Event().wait()


# ---- a minimal HTTP/1.1 client (keep-alive), so the client costs little next to the servers ---------

class Conn:
    def __init__(self, port: int, headers: dict[str, str]):
        self.port = port
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 24)
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{self.extra}\r\n")
        self.writer.write(head.encode() + body)
        assert self.reader is not None
        status = int((await self.reader.readline()).split()[1])
        length, chunked = None, False
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            if k.lower() == "content-length":
                length = int(v)
            elif k.lower() == "transfer-encoding" and "chunked" in v:
                chunked = True
        if chunked:
            data = b""
            while (size := int((await self.reader.readline()).strip(), 16)) > 0:
                data += await self.reader.readexactly(size)
                await self.reader.readline()
            await self.reader.readline()
            return status, data
        return status, await self.reader.readexactly(length or 0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def session(port: int, path: str, headers: dict[str, str], turns: int, lat: list[float]) -> None:
    conn = Conn(port, headers)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "The test test_parse fails; fix it."}]
    try:
        for t in range(turns):
            body = json.dumps({"model": MODEL, "messages": msgs, "tools": TOOLS, "temperature": 0.7}).encode()
            t0 = time.perf_counter()
            status, data = await conn.post(path, body)
            lat.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"{path}: HTTP {status}: {data[:300]!r}")
            reply = json.loads(data)["choices"][0]["message"]
            msgs = msgs + [{"role": "assistant", "content": reply["content"]},
                           {"role": "user", "content": f"<returncode>0</returncode>\n<output>step {t} ok</output>"}]
    finally:
        conn.close()


async def latency_round(port: int, path_of: Any, headers: dict[str, str], tag: str, sessions: int,
                        turns: int, lat: list[float]) -> None:
    for i in range(sessions):  # sequential: one call in flight
        await session(port, path_of(f"{tag}-{i}"), headers, turns, lat)


async def throughput(port: int, path_of: Any, headers: dict[str, str], tag: str, concurrency: int,
                     turns: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(session(port, path_of(f"{tag}-{i}"), headers, turns, lat) for i in range(concurrency)))
    return len(lat) / (time.perf_counter() - t0), lat


def cpu_per_call(cache: Path, n_sessions: int, turns: int) -> dict[str, float]:
    """CPU time per call of the work itself, in this process, without HTTP (steadier than wall time
    on a shared machine): the engine server's handler vs legorl's call path (bridge, engine, parse,
    record to SQLite, answer)."""
    from legorl.proxy.bridge import CachedEncoder, template_messages
    from legorl.proxy.core import CallCore, SamplingOverride
    from legorl.proxy.openai_chat import OpenAIChat
    from legorl.proxy.sessions import Session
    from legorl.proxy.toolcalls import TaggedJsonParser
    from legorl.store import Store

    tok = load_tokenizer(cache)
    engine = fixed_engine(tok)
    enc = CachedEncoder(tok)
    store = Store(Path(tempfile.mkdtemp(prefix="legorl-bench-cpu-")) / "store.sqlite")
    core = CallCore(engine, tok, sampling=SamplingOverride(max_tokens=64), parser=TaggedJsonParser(),
                    model_name=MODEL, on_call=store.add_call)
    fmt = OpenAIChat(tok)

    async def engine_side(raw: bytes) -> str:
        body = json.loads(raw)
        text = tok.apply_chat_template(template_messages(body["messages"]), tools=body.get("tools"),
                                       add_generation_prompt=True, tokenize=False)
        r = await engine.generate(enc.encode(text), None)
        out = tok.decode(r.completion_ids, skip_special_tokens=True)
        json.dumps({"choices": [{"message": {"role": "assistant", "content": out}}]})
        return out

    async def legorl_side(raw: bytes, sess: Session) -> str:
        req = fmt.parse(json.loads(raw))
        comp = await core.complete(sess, req)
        comp.id = "x"
        json.dumps(fmt.answer(comp, req))
        return comp.choices[0].content or ""

    async def run(which: str) -> float:
        t0 = time.process_time()
        for i in range(n_sessions):
            sess = Session(token=f"{which}{i}", rollout_id=f"{which}{i}")
            msgs: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "The test test_parse fails; fix it."}]
            for t in range(turns):
                raw = json.dumps({"model": MODEL, "messages": msgs, "tools": TOOLS}).encode()
                out = await (engine_side(raw) if which == "engine" else legorl_side(raw, sess))
                msgs = msgs + [{"role": "assistant", "content": out}, {"role": "user", "content": f"step {t} ok"}]
        return (time.process_time() - t0) / (n_sessions * turns) * 1e3

    async def main() -> dict[str, float]:
        await run("engine")
        await run("legorl")  # warm-up (template compile, caches, first-use checks)
        e = min([await run("engine") for _ in range(3)])
        lg = min([await run("legorl") for _ in range(3)])
        return {"engine_cpu_ms": e, "legorl_cpu_ms": lg}

    return asyncio.run(main())


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"{what} did not open port {port} in {timeout:.0f}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_litellm(port: int, engine_port: int, tmp: Path) -> subprocess.Popen | None:
    exe = shutil.which("litellm", path=str(Path(sys.executable).parent)) or shutil.which("litellm")
    if exe is None:
        return None
    cfg = tmp / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{engine_port}/v1\n"
        "      api_key: unused\n"
        "general_settings:\n"
        "  master_key: sk-bench\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: true\n")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    return subprocess.Popen([exe, "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "litellm.log", "w"), start_new_session=True)


def stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def write_section(text: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    start = old.find("\n## Proxy\n")
    if start < 0:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        nxt = old.find("\n## ", start + 1)
        new = old[: start + 1] + text + (old[nxt:] if nxt >= 0 else "")
    path.write_text(new.rstrip("\n") + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=240, help="sequential calls per path (latency)")
    ap.add_argument("--turns", type=int, default=8, help="calls per session (each extends the last)")
    ap.add_argument("--concurrency", type=int, default=64, help="concurrent sessions (throughput)")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--write", action="store_true", help="update the '## Proxy' section of BENCHMARKS.md")
    ap.add_argument("--serve", choices=["engine", "legorl"], help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, default=ROOT / ".pytest_cache" / "legorl")
    ap.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve == "engine":
        asyncio.run(serve_engine(a.port, a.cache))
        return
    if a.serve == "legorl":
        asyncio.run(serve_legorl(a.port, a.cache, a.store))
        return

    load_tokenizer(a.cache)  # build once before the servers start
    load_start = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="legorl-bench-proxy-"))
    ports = {"engine": free_port(), "legorl": free_port(), "litellm": free_port()}
    me = [sys.executable, str(Path(__file__).resolve()), "--cache", str(a.cache)]
    procs: dict[str, subprocess.Popen | None] = {
        "engine": subprocess.Popen([*me, "--serve", "engine", "--port", str(ports["engine"])], start_new_session=True),
        "legorl": subprocess.Popen([*me, "--serve", "legorl", "--port", str(ports["legorl"]),
                                    "--store", str(tmp / "store.sqlite")], start_new_session=True),
    }
    if not a.no_litellm:
        procs["litellm"] = start_litellm(ports["litellm"], ports["engine"], tmp)
    results: dict[str, dict[str, float]] = {}
    try:
        for name, proc in procs.items():
            if proc is not None:
                wait_port(ports[name], proc, name)
        paths = {
            "engine": (lambda s: "/v1/chat/completions", {}),
            "legorl": (lambda s: f"/s/{s}/v1/chat/completions", {}),
            "litellm": (lambda s: "/v1/chat/completions", {"Authorization": "Bearer sk-bench"}),
        }
        live = [n for n, p in procs.items() if p is not None]
        lat: dict[str, list[float]] = {n: [] for n in live}
        rounds = 6
        per_round = max(1, a.calls // (rounds * a.turns))
        for n in live:  # warm-up
            asyncio.run(latency_round(ports[n], paths[n][0], paths[n][1], f"{n}-warm", 2, a.turns, []))
        for r in range(rounds):  # interleaved, so load changes on a shared machine hit every path alike
            for n in live:
                asyncio.run(latency_round(ports[n], paths[n][0], paths[n][1], f"{n}-seq{r}", per_round, a.turns,
                                          lat[n]))
        rates: dict[str, list[float]] = {n: [] for n in live}
        conc_lat: dict[str, list[float]] = {n: [] for n in live}
        for r in range(2):
            for n in live:
                rate, cl = asyncio.run(throughput(ports[n], paths[n][0], paths[n][1], f"{n}-par{r}", a.concurrency,
                                                  a.turns))
                rates[n].append(rate)
                conc_lat[n] += cl
        for n in live:
            q = statistics.quantiles(lat[n], n=100)
            results[n] = {"p50_ms": statistics.median(lat[n]) * 1e3, "p99_ms": q[98] * 1e3,
                          "calls_per_s": statistics.mean(rates[n]),
                          "p50_ms_at_concurrency": statistics.median(conc_lat[n]) * 1e3}
            print(n, json.dumps({k: round(v, 3) for k, v in results[n].items()}), flush=True)
    finally:
        for proc in procs.values():
            stop(proc)
    cpu = cpu_per_call(a.cache, 8, a.turns)
    print("cpu", json.dumps({k: round(v, 3) for k, v in cpu.items()}), flush=True)
    base = results["engine"]
    rows = []
    for name in ("engine", "legorl", "litellm"):
        if name not in results:
            continue
        r = results[name]
        added50 = r["p50_ms"] - base["p50_ms"]
        added99 = r["p99_ms"] - base["p99_ms"]
        rows.append((name, r, added50, added99))
    lines = ["| path | p50 ms | p99 ms | added p50 ms | added p99 ms | calls/s (64 sessions) |",
             "|---|---|---|---|---|---|"]
    for name, r, a50, a99 in rows:
        added = ("—", "—") if name == "engine" else (f"{a50:.2f}", f"{a99:.2f}")
        lines.append(f"| {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {added[0]} | {added[1]} | "
                     f"{r['calls_per_s']:.0f} |")
    ratio = ""
    if "litellm" in results and "legorl" in results:
        a_l = results["legorl"]["p50_ms"] - base["p50_ms"]
        a_t = results["litellm"]["p50_ms"] - base["p50_ms"]
        ratio = (f"\nlegorl's added p50 is {a_l:.2f} ms, {a_l / a_t:.3f}× LiteLLM's ({a_t:.2f} ms); "
                 f"throughput {results['legorl']['calls_per_s'] / results['litellm']['calls_per_s']:.1f}× "
                 "LiteLLM's.\n")
    added_cpu = cpu["legorl_cpu_ms"] - cpu["engine_cpu_ms"]
    lines.append("")
    lines.append(f"CPU per call without HTTP (in one process, best of 3): engine server work "
                 f"{cpu['engine_cpu_ms']:.2f} ms, legorl's call path {cpu['legorl_cpu_ms']:.2f} ms: "
                 f"**{added_cpu:.2f} ms added per call**.")
    table = "\n".join(lines)
    print(table + ratio)
    if a.write:
        from importlib.metadata import version

        machine = (f"{platform.machine()}, {os.cpu_count()} cores, shared with other work while measured "
                   f"(load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end)")
        write_section(
            "## Proxy\n\n"
            f"`bench/proxy.py`: {a.calls} sequential calls per path ({a.turns}-turn sessions, each call extending "
            f"the last) for latency, {a.concurrency} concurrent sessions for throughput; a fixed 12-token "
            "engine reply so the proxy's own cost dominates. Added latency = path p50/p99 minus the engine "
            "server's. legorl records every call to SQLite before answering.\n\n"
            f"{table}\n{ratio}\n"
            f"Machine: {machine}; litellm {version('litellm')} (one worker). Figures move with the machine's "
            "load; compare ratios within one run.\n\n"
            "Reproduce: `.venv/bin/pip install 'litellm[proxy]' && .venv/bin/python bench/proxy.py --write`\n")


if __name__ == "__main__":
    main()
