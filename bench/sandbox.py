"""Sandbox benchmark: start/teardown, per-command exec, 32 concurrent sandboxes, against a floor and a peer.

In one run, on the same machine:

* start: ``BwrapSandbox.create`` on a prepared small repo (a built-in task) until the agent
  accepts commands (workspace ready), and ``close`` (teardown), p50/p99; ``prepare_repo``
  (materialising the orphan-commit repo) is reported on its own line;
* per-command exec latency of a trivial command inside a live sandbox, through the async API
  and through the blocking ``SandboxClient`` a harness worker uses, p50/p99;
* the pool (``sandbox.pool_size``, ``sandbox/pool.py``): hand-out of a pre-started sandbox through
  ``create_sandbox`` (the prepared workspace moved in, chowned to the sandbox's uid, watchdog armed) until
  it is returned, p50/p99, with the pool refilled between hand-outs (not timed); and 32 hand-outs at once
  from a pool of 32: wall time until all are ready, next to 32 fresh starts at once in the same run;
* the floor: the same command as a bare ``bash -c`` subprocess of this process;
* the peer: mini-swe-agent's ``BubblewrapEnvironment`` (a new bwrap per command, no limits);
* 32 sandboxes started at once: wall time until all are ready, per-sandbox start p50/p99, one
  command in each at once, teardown of all;
* a noisy neighbour: exec latency of a quiet sandbox while another runs a busy loop on every core,
  against its own latency alone, with each sandbox's CPU share (``cpushare.py``) and without;
* a fork bomb under a low process limit whose command times out: what was ended, how long the
  clean-up took, and whether the next command in that sandbox succeeds;
* with ``--docker``: the container backend (``sandbox.kind: docker``, through ``create_sandbox``) on the
  engine the tests use (``DOCKER_HOST``, else podman's Docker API socket, its service started by
  ``scripts/sandbox-image.sh service`` when podman is installed): start p50/p99, exec p50/p99 interleaved
  with the bare subprocess and a live bwrap sandbox, teardown p50. Skipped, with the reason, when no engine
  or no image answers.

Targets: per-command exec within 2x of the bare subprocess; start p50 under 20 ms; pool hand-out p50
under 10 ms and 32 hand-outs at once all ready under 300 ms; the quiet
sandbox's exec p50 next to a busy neighbour at most 1.5x its p50 alone; after a fork bomb's command
times out, the next command succeeds.
``--write`` puts the table in BENCHMARKS.md, section "## Sandbox".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from legorl.config import SandboxConfig
from legorl.sandbox import SandboxLimits, create_sandbox, reap_sandboxes
from legorl.sandbox.bwrap import (
    BwrapSandbox,
    bwrap_argv,
    host_python,
    process_tree,
    sandbox_ids,
    sandbox_path_env,
)
from legorl.sandbox.client import SandboxClient
from legorl.sandbox.control import RELAY_PORT
from legorl.sandbox.cpushare import support
from legorl.sandbox.pool import pool_for
from legorl.sandbox.procs import cmdline
from legorl.tasks import generate_tasks, prepare_repo

COMMAND = "echo hi"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def row(name: str, xs: list[float], floor: float | None = None, note: str = "") -> str:
    p50, p99 = pct(xs, 50) * 1000, pct(xs, 99) * 1000
    ratio = f"{p50 / (floor * 1000):.2f}x" if floor else ""
    return f"| {name} | {len(xs)} | {p50:.2f} | {p99:.2f} | {ratio} | {note} |"


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


async def bench_start(base: Path, repo_src: Path, n: int) -> tuple[list[float], list[float], list[float]]:
    prep, starts, stops = [], [], []
    task = generate_tasks(["wrong_operator"], 1, seed=0)[0]
    for i in range(n):
        t = time.perf_counter()
        await asyncio.to_thread(prepare_repo, task, base / f"p{i}")
        prep.append(time.perf_counter() - t)
        shutil.copytree(repo_src, base / f"s{i}" / "ws", symlinks=True)
        t = time.perf_counter()
        box = await BwrapSandbox.create(workspace=base / f"s{i}" / "ws", sandbox_dir=base / f"s{i}" / "sb", label="bench")
        starts.append(time.perf_counter() - t)
        await box.exec("true")
        t = time.perf_counter()
        await box.close()
        stops.append(time.perf_counter() - t)
    return prep, starts, stops


async def bench_exec(base: Path, repo_src: Path, n: int) -> tuple[list[float], list[float], list[float]]:
    """Bare subprocess, async exec and blocking-client exec, interleaved so load drifts hit all three alike."""
    shutil.copytree(repo_src, base / "exec" / "ws", symlinks=True)
    box = await BwrapSandbox.create(workspace=base / "exec" / "ws", sandbox_dir=base / "exec" / "sb", label="bench")
    client = SandboxClient(box.control_socket)
    env = sandbox_path_env()  # the same environment as inside (its C.UTF-8 locale costs every process)
    bare, async_lat, sync_lat = [], [], []
    try:
        for i in range(10 + n):
            t = time.perf_counter()
            subprocess.run(["bash", "-c", COMMAND], capture_output=True, check=True, env=env)  # noqa: ASYNC221
            t1 = time.perf_counter()
            r = await box.exec(COMMAND)
            t2 = time.perf_counter()
            client.exec(COMMAND)  # blocking on purpose: nothing else runs on this loop
            t3 = time.perf_counter()
            assert r.output == "hi\n"
            if i >= 10:
                bare.append(t1 - t)
                async_lat.append(t2 - t1)
                sync_lat.append(t3 - t2)
    finally:
        await box.close()
    return bare, async_lat, sync_lat


def bench_start_parts(base: Path, repo_src: Path, n: int) -> tuple[list[float], list[float]]:
    """Where a start goes: bwrap with the same mounts running /bin/true, and CPython's own start."""
    (base / "parts" / "ctl").mkdir(parents=True)
    argv = bwrap_argv(workspace=repo_src, ctl_dir=base / "parts" / "ctl", label="bench", proxy_socket=None,
                      relay_port=18000, drop_to=sandbox_ids())  # fmt: skip
    bwrap_only = argv[: argv.index("--") + 1] + ["/bin/true"]
    bw, py = [], []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(bwrap_only, check=False)
        t1 = time.perf_counter()
        subprocess.run([host_python(), "-I", "-S", "-c", "pass"], check=True)
        bw.append(t1 - t)
        py.append(time.perf_counter() - t1)
    return bw, py


def bench_peer(base: Path, repo_src: Path, n: int) -> list[float] | str:
    try:
        from minisweagent.environments.extra.bubblewrap import BubblewrapEnvironment
    except ImportError as e:
        return f"mini-swe-agent not importable: {e}"
    ws = base / "peer"
    shutil.copytree(repo_src, ws, symlinks=True)
    env = BubblewrapEnvironment(cwd=str(ws), timeout=30)
    out = []
    for _ in range(5 + n):
        t = time.perf_counter()
        r = env.execute({"command": COMMAND})
        out.append(time.perf_counter() - t)
        if r["returncode"] != 0:
            return f"peer failed: {r}"
    return out[5:]


async def bench_concurrent(base: Path, repo_src: Path, k: int) -> dict[str, float | list[float]]:
    for i in range(k):
        shutil.copytree(repo_src, base / f"c{i}" / "ws", symlinks=True)

    async def start(i: int) -> tuple[BwrapSandbox, float]:
        t = time.perf_counter()
        box = await BwrapSandbox.create(workspace=base / f"c{i}" / "ws", sandbox_dir=base / f"c{i}" / "sb", label="bench")
        return box, time.perf_counter() - t

    t0 = time.perf_counter()
    started = await asyncio.gather(*(start(i) for i in range(k)))
    all_ready = time.perf_counter() - t0
    boxes = [b for b, _ in started]
    t1 = time.perf_counter()
    results = await asyncio.gather(*(b.exec(COMMAND) for b in boxes))
    exec_wall = time.perf_counter() - t1
    assert all(r.output == "hi\n" for r in results)
    t2 = time.perf_counter()
    await asyncio.gather(*(b.close() for b in boxes))
    teardown = time.perf_counter() - t2
    return {"all_ready": all_ready, "starts": [s for _, s in started], "exec_wall": exec_wall, "teardown": teardown}


def _pool_spec(root: Path, label: str) -> dict:
    """create_sandbox's backend arguments for a rollout under ``root`` (the factory's defaults)."""
    return {"workspace": root / "x" / "workspace", "sandbox_dir": root / "x", "label": label, "proxy_socket": None,
                "relay_port": RELAY_PORT, "hide_paths": (), "limits": None, "inside_workspace": "/workspace", "env": None,
                "ro_binds": None, "visible_paths": (), "sandbox_uid": None, "cpus": None}  # fmt: skip


async def bench_pool(base: Path, repo_src: Path, n: int, size: int = 4) -> dict[str, list[float]]:
    """Hand-outs from a full pool, one at a time (refilled in between, untimed), and each refill's wait."""
    root = base / "pool" / "sandboxes"
    root.mkdir(parents=True)
    cfg = SandboxConfig(pool_size=size)
    pool = pool_for(size)
    handouts, refills, firsts = [], [], []
    try:
        for i in range(n):
            t = time.perf_counter()
            assert await pool.prewarm(_pool_spec(root, "bench-pool"), size) == size, pool.stats
            refills.append(time.perf_counter() - t)
            await asyncio.sleep(0.05)  # let the last start settle (its agent imports after ready)
            shutil.copytree(repo_src, root / f"r{i}" / "workspace", symlinks=True)
            os.sync()  # the copy's writeback, not the hand-out's cost (a rename waits on a committing journal)
            hits = pool.stats.hits
            t = time.perf_counter()
            box = await create_sandbox(cfg, workspace=root / f"r{i}" / "workspace", sandbox_dir=root / f"r{i}",
                                       label="bench-pool")  # fmt: skip
            handouts.append(time.perf_counter() - t)
            assert pool.stats.hits == hits + 1, pool.stats
            t = time.perf_counter()
            r = await box.exec("git status --porcelain | wc -l")
            firsts.append(time.perf_counter() - t)
            assert r.output.strip() == "0", r.output
            await box.close()
    finally:
        await reap_sandboxes(cfg, root)
    return {"handouts": handouts, "refills": refills[1:], "firsts": firsts}


async def bench_pool_concurrent(base: Path, repo_src: Path, k: int, rounds: int = 3) -> dict:
    """``k`` hand-outs at once from a full pool of ``k``, ``rounds`` times (the median burst is reported: one
    burst's wall time on a shared, loaded machine is mostly the scheduler's luck)."""
    out = [await _pool_burst(base / f"poolk{r}" / "sandboxes", repo_src, k) for r in range(rounds)]
    out.sort(key=lambda o: o["all_ready"])
    mid = out[len(out) // 2]
    return {**mid, "bursts": [o["all_ready"] for o in out]}


async def _pool_burst(root: Path, repo_src: Path, k: int) -> dict:
    root.mkdir(parents=True)
    cfg = SandboxConfig(pool_size=k)
    pool = pool_for(k)
    try:
        t = time.perf_counter()
        assert await pool.prewarm(_pool_spec(root, "bench-poolk"), k) == k, pool.stats
        fill = time.perf_counter() - t
        await asyncio.sleep(0.2)
        for i in range(k):
            shutil.copytree(repo_src, root / f"c{i}" / "workspace", symlinks=True)
        os.sync()  # as above: the copies' writeback is not the burst's
        hits = pool.stats.hits

        async def one(i: int) -> tuple[BwrapSandbox, float]:
            t = time.perf_counter()
            box = await create_sandbox(cfg, workspace=root / f"c{i}" / "workspace", sandbox_dir=root / f"c{i}",
                                       label="bench-poolk")  # fmt: skip
            return box, time.perf_counter() - t  # type: ignore[return-value]

        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(i) for i in range(k)))
        all_ready = time.perf_counter() - t0
        assert pool.stats.hits == hits + k, pool.stats
        boxes = [b for b, _ in got]
        t1 = time.perf_counter()
        results = await asyncio.gather(*(b.exec(COMMAND) for b in boxes))
        exec_wall = time.perf_counter() - t1
        assert all(r.output == "hi\n" for r in results)
        await asyncio.gather(*(b.close() for b in boxes))
    finally:
        await reap_sandboxes(cfg, root)
    return {"all_ready": all_ready, "each": [s for _, s in got], "exec_wall": exec_wall, "fill": fill}


async def _execs(box: BwrapSandbox, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = await box.exec(COMMAND)
        out.append(time.perf_counter() - t)
        assert r.output == "hi\n"
    return out


async def _busy(box: BwrapSandbox) -> asyncio.Task:
    """A busy loop on every core in ``box`` (one command, running until cancelled), once all spin."""
    n = os.cpu_count() or 1
    task = asyncio.create_task(box.exec(" ".join(["(while :; do :; done) &"] * n) + " wait", timeout=600))
    deadline = time.monotonic() + 30
    while sum(cmdline(p)[:2] == ["bash", "-c"] for p in process_tree(box.pid)) < n + 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the busy loops did not start")
        await asyncio.sleep(0.01)
    return task


async def bench_neighbour(base: Path, repo_src: Path, n: int) -> dict[str, list[float]]:
    """Exec of a quiet sandbox alone and next to a busy one, with CPU shares and without (same run)."""
    boxes = {}
    for name, share in (("quiet", True), ("busy", True), ("quiet_plain", False), ("busy_plain", False)):
        shutil.copytree(repo_src, base / "nb" / name / "ws", symlinks=True)
        boxes[name] = await BwrapSandbox.create(workspace=base / "nb" / name / "ws", sandbox_dir=base / "nb" / name / "sb",
                                                label="bench", cpu_share=share)  # fmt: skip
    out: dict[str, list[float]] = {"alone": [], "alone_plain": [], "busy": [], "busy_plain": []}
    try:
        await _execs(boxes["quiet"], 10)
        await _execs(boxes["quiet_plain"], 10)
        half = max(1, n // 2)
        out["alone"] += await _execs(boxes["quiet"], half)
        out["alone_plain"] += await _execs(boxes["quiet_plain"], half)
        for quiet, busy, key in (("quiet", "busy", "busy"), ("quiet_plain", "busy_plain", "busy_plain")):
            spin = await _busy(boxes[busy])
            out[key] = await _execs(boxes[quiet], n)
            spin.cancel()  # the client hangs up: the agent ends the command's whole tree
            await asyncio.gather(spin, return_exceptions=True)
            while any(cmdline(p)[:2] == ["bash", "-c"] for p in process_tree(boxes[busy].pid)):
                await asyncio.sleep(0.01)
        out["alone"] += await _execs(boxes["quiet"], n - half)
        out["alone_plain"] += await _execs(boxes["quiet_plain"], n - half)
    finally:
        await asyncio.gather(*(b.close() for b in boxes.values()))
    return out


async def bench_fork_bomb(base: Path, repo_src: Path, processes: int = 64, timeout: float = 3.0) -> dict:
    """A fork bomb under a low process limit, its command timed out: clean-up time and the next command."""
    shutil.copytree(repo_src, base / "bomb" / "ws", symlinks=True)
    box = await BwrapSandbox.create(workspace=base / "bomb" / "ws", sandbox_dir=base / "bomb" / "sb", label="bench",
                                    limits=SandboxLimits(processes=processes, cpu_seconds=60))  # fmt: skip
    try:
        t = time.perf_counter()
        r = await box.exec("bomb() { bomb | bomb & }; bomb; sleep 100", timeout=timeout)
        wall = time.perf_counter() - t
        t = time.perf_counter()
        nxt = await box.exec(COMMAND)
        next_ms = (time.perf_counter() - t) * 1000
    finally:
        await box.close()
    return {"timed_out": r.timed_out, "ended": len(r.ended), "cleanup_ms": (wall - timeout) * 1000,
            "note": r.output.strip().splitlines()[-1], "next_ok": nxt.output == "hi\n" and nxt.returncode == 0,
            "next_ms": next_ms, "processes": processes, "timeout": timeout}


def docker_host() -> str:
    """The engine the tests use (tests/backends.py): DOCKER_HOST, else podman's Docker API socket."""
    if host := os.environ.get("DOCKER_HOST"):
        return host
    if os.geteuid() == 0:
        return "unix:///run/podman/podman.sock"
    return f"unix://{os.environ.get('XDG_RUNTIME_DIR', f'/run/user/{os.getuid()}')}/podman/podman.sock"


def docker_reason(host: str, image: str) -> str | None:
    """None when docker sandboxes can start on ``host`` with ``image``, else why not; starts podman's service
    as the tests do when nothing answers (the image is never built here: `make setup-sandbox-image`)."""
    from legorl.sandbox.docker import docker_unavailable

    reason = docker_unavailable(docker_host=host)
    if reason and not os.environ.get("DOCKER_HOST") and shutil.which("podman"):
        p = subprocess.run(["bash", str(ROOT / "scripts" / "sandbox-image.sh"), "service"], capture_output=True,
                           text=True, timeout=120, check=False)  # fmt: skip
        reason = docker_unavailable(docker_host=host) if p.returncode == 0 else f"{reason}; {p.stderr[-300:]}"
    return reason or docker_unavailable(docker_host=host, image=image)


async def bench_docker(base: Path, repo_src: Path, starts: int, commands: int) -> dict:
    """Container starts (workspace ready) and teardowns one at a time, then ``commands`` execs in a live
    container interleaved with the bare subprocess and a live bwrap sandbox (the same-run peers)."""
    cfg = SandboxConfig(kind="docker", docker_host=docker_host())
    root = base / "docker"
    out: dict = {"starts": [], "stops": [], "bare": [], "docker": [], "bwrap": []}
    try:
        for i in range(starts):
            shutil.copytree(repo_src, root / f"s{i}" / "ws", symlinks=True)
            t = time.perf_counter()
            box = await create_sandbox(cfg, workspace=root / f"s{i}" / "ws", sandbox_dir=root / f"s{i}" / "sb",
                                       label="bench-docker")  # fmt: skip
            out["starts"].append(time.perf_counter() - t)
            await box.exec("true")
            t = time.perf_counter()
            await box.close()
            out["stops"].append(time.perf_counter() - t)
        shutil.copytree(repo_src, root / "exec" / "ws", symlinks=True)
        shutil.copytree(repo_src, root / "bw" / "ws", symlinks=True)
        box = await create_sandbox(cfg, workspace=root / "exec" / "ws", sandbox_dir=root / "exec" / "sb",
                                   label="bench-docker")  # fmt: skip
        bw = await BwrapSandbox.create(workspace=root / "bw" / "ws", sandbox_dir=root / "bw" / "sb", label="bench")
        env = sandbox_path_env()
        try:
            for i in range(10 + commands):
                t = time.perf_counter()
                subprocess.run(["bash", "-c", COMMAND], capture_output=True, check=True, env=env)  # noqa: ASYNC221
                t1 = time.perf_counter()
                r = await box.exec(COMMAND)
                t2 = time.perf_counter()
                rb = await bw.exec(COMMAND)
                t3 = time.perf_counter()
                assert r.output == "hi\n" and rb.output == "hi\n", (r, rb)
                if i >= 10:
                    out["bare"].append(t1 - t)
                    out["docker"].append(t2 - t1)
                    out["bwrap"].append(t3 - t2)
        finally:
            await asyncio.gather(box.close(), bw.close())
    finally:
        await reap_sandboxes(cfg, root, label="bench-docker")
    version = ["docker", "version", "--format", "{{.Server.Version}}"]
    p = await asyncio.to_thread(subprocess.run, version, capture_output=True, text=True, check=False,
                                env={**os.environ, "DOCKER_HOST": cfg.docker_host or ""})  # fmt: skip
    out["engine"] = f"engine {p.stdout.strip()} at `{cfg.docker_host}`"
    return out


def docker_lines(d: dict | str, bwrap_start: list[float]) -> tuple[list[str], list[str]]:
    """The container backend's table rows and bullet (or the reason it was skipped)."""
    if isinstance(d, str):
        return [], [f"- Container backend (`--docker`): skipped: {d}"]
    floor, bw_exec = pct(d["bare"], 50), pct(d["bwrap"], 50)
    start, stop, dexec = pct(d["starts"], 50), pct(d["stops"], 50), pct(d["docker"], 50)
    # the ratio column is to this phase's own interleaved floor (bash -c between the two execs)
    rows = [
        row("docker sandbox start (workspace ready)", d["starts"], None,
            f"**{start / pct(bwrap_start, 50):.1f}x** a bwrap start; teardown p50 {stop * 1000:.0f} ms"),
        row("docker sandbox exec, async API", d["docker"], floor,
            f"**{dexec / bw_exec:.2f}x** a live bwrap's exec ({bw_exec * 1000:.2f} ms), interleaved"),
    ]  # fmt: skip
    return rows, []


def write_section(text: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    section = f"## Sandbox\n\n{text.strip()}\n\n"
    pattern = re.compile(r"## Sandbox\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    new = pattern.sub(lambda _: section, old) if pattern.search(old) else old.rstrip() + "\n\n" + section
    path.write_text(new)


async def run(args: argparse.Namespace) -> str:
    load_before = load()
    base = Path(tempfile.mkdtemp(prefix="legorl-bench-sandbox-", dir="/var/tmp"))
    try:
        task = generate_tasks(["wrong_operator"], 1, seed=0)[0]
        repo_src = base / "repo"
        prepare_repo(task, repo_src)
        n_files = sum(1 for p in repo_src.rglob("*") if p.is_file())
        prep, starts, stops = await bench_start(base / "start", repo_src, args.starts)
        bw_only, py_only = bench_start_parts(base, repo_src, min(args.starts, 20))
        bare, async_lat, sync_lat = await bench_exec(base, repo_src, args.commands)
        peer = bench_peer(base, repo_src, args.peer_commands)
        conc = await bench_concurrent(base / "conc", repo_src, args.concurrent)
        pooled = await bench_pool(base, repo_src, args.handouts)
        pconc = await bench_pool_concurrent(base, repo_src, args.concurrent)
        nb = await bench_neighbour(base, repo_src, args.neighbour_commands)
        bomb = await bench_fork_bomb(base, repo_src)
        dock: dict | str = "not asked for (`--docker`)"
        if args.docker:
            cfg = SandboxConfig(kind="docker")
            dock = await asyncio.to_thread(docker_reason, docker_host(), cfg.image) or await bench_docker(
                base, repo_src, args.docker_starts, args.docker_commands)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    floor = pct(bare, 50)
    lines = [
        "| measurement | n | p50 ms | p99 ms | p50 vs bare subprocess | note |",
        "|---|---|---|---|---|---|",
        row("bare `bash -c` subprocess (floor)", bare, floor, "host, no isolation"),
        row("legorl exec, async API", async_lat, floor, "live sandbox, control socket"),
        row("legorl exec, SandboxClient (harness worker)", sync_lat, floor, "live sandbox, blocking client"),
    ]
    if isinstance(peer, str):
        lines.append(f"| mini-swe-agent BubblewrapEnvironment (peer) | - | - | - | - | {peer} |")
    else:
        lines.append(row("mini-swe-agent BubblewrapEnvironment (peer)", peer, floor, "new bwrap per command"))
    lines += [
        row("legorl sandbox start (workspace ready)", starts, None, f"small repo, {n_files} files"),
        row("legorl sandbox teardown", stops, None, "kill + reap"),
        row(f"start, {args.concurrent} at once (each)", conc["starts"], None,  # type: ignore[arg-type]
            f"all ready after {conc['all_ready'] * 1000:.0f} ms"),
        row("pool hand-out (`create_sandbox`, `pool_size: 4`)", pooled["handouts"], None,
            "workspace moved in, chowned, watched"),
        row(f"pool hand-out, {args.concurrent} at once (each; median burst of {len(pconc['bursts'])})", pconc["each"],
            None, "all ready after " + " / ".join(f"{b * 1000:.0f}" for b in pconc["bursts"]) + " ms"),
        row("quiet sandbox exec, alone", nb["alone"], floor, "own CPU share (cgroup)"),
        row(f"quiet sandbox exec, neighbour busy on all {os.cpu_count()} cores", nb["busy"], floor,
            f"**{pct(nb['busy'], 50) / pct(nb['alone'], 50):.2f}x** its p50 alone"),
    ]  # the run without CPU shares and the fork bomb: in the bullets (the file's length)
    exec_ratio = pct(async_lat, 50) / floor
    sync_ratio = pct(sync_lat, 50) / floor
    start_p50 = pct(starts, 50) * 1000
    handout_p50, handout_p99 = pct(pooled["handouts"], 50) * 1000, pct(pooled["handouts"], 99) * 1000
    pool_all = pconc["all_ready"] * 1000
    peer_line = "" if isinstance(peer, str) else (
        f" mini-swe-agent's bubblewrap environment pays a sandbox start per command: "
        f"**{pct(peer, 50) / pct(async_lat, 50):.1f}x** slower per command than a live legorl sandbox."
    )  # fmt: skip
    bwrap_version = args.bwrap_version
    exec_met = "met" if max(exec_ratio, sync_ratio) <= 2 else "NOT met"
    nb_ratio = pct(nb["busy"], 50) / pct(nb["alone"], 50)
    plain_ratio = pct(nb["busy_plain"], 50) / pct(nb["alone_plain"], 50)
    share = support()
    notes = [
        (f"- Per-command exec: **{exec_ratio:.2f}x** the bare subprocess (async API), {sync_ratio:.2f}x through "
         f"the blocking client (target <= 2x: {exec_met}).{peer_line} Each command is `{COMMAND}`: one Unix-socket "
         "round trip to the agent, whose zygote forks `bash -c` (a child subreaper, so that a timeout ends all it "
         "started); the floor forks `bash -c` with the sandbox's environment; the three are interleaved."),
        (f"- Sandbox start p50 **{start_p50:.1f} ms** (target < 20 ms: {'met' if start_p50 < 20 else 'NOT met'}); "
         f"{args.concurrent} sandboxes at once: all ready in {conc['all_ready'] * 1000:.0f} ms, one command in "
         f"each in {conc['exec_wall'] * 1000:.0f} ms, all torn down in {conc['teardown'] * 1000:.0f} ms. Of a start: "
         f"bwrap alone with the same mounts (`/bin/true`: namespaces, ~20 mounts) p50 {pct(bw_only, 50) * 1000:.1f} ms, "
         f"a CPython start (`-I -S -c pass`, the agent's interpreter) p50 {pct(py_only, 50) * 1000:.1f} ms; before it, "
         f"`prepare_repo` (orphan commit + checks) p50 {pct(prep, 50) * 1000:.0f} ms. A small static agent binary "
         "instead of CPython would cut the start itself (the pool's refill cost)."),
        (f"- Pool (`sandbox.pool_size`): a hand-out p50 **{handout_p50:.2f} ms** (p99 {handout_p99:.1f} ms; target < 10 ms: "
         f"{'met' if handout_p50 < 10 else 'NOT met'}), **{start_p50 / handout_p50:.0f}x** faster than a fresh start "
         f"in this run; {args.concurrent} hand-outs at once: all ready in **{pool_all:.1f} ms** (median of "
         f"{len(pconc['bursts'])} bursts; target < 300 ms: "
         f"{'met' if pool_all < 300 else 'NOT met'}) against {conc['all_ready'] * 1000:.0f} ms for "
         f"{args.concurrent} fresh starts at once ({conc['all_ready'] * 1000 / pool_all:.0f}x); filling that pool "
         f"took {pconc['fill'] * 1000:.0f} ms in the background, one command in each of the {args.concurrent} took "
         f"{pconc['exec_wall'] * 1000:.0f} ms. A hand-out is renames (the workspace's entries into the pooled "
         "sandbox's bound dir, that dir to the workspace path, its control dir to the sandbox dir), a chown of "
         "the workspace to the sandbox's uid and the watchdog's entry; the first command after it (`git status`) "
         f"p50 {pct(pooled['firsts'], 50) * 1000:.0f} ms; the refill, a fresh start in the background after it "
         f"returns, p50 {pct(pooled['refills'], 50) * 1000:.0f} ms."),
        (f"- Noisy neighbour: next to a sandbox running a busy loop on every core, a quiet sandbox's exec p50 is "
         f"**{nb_ratio:.2f}x** its p50 alone with each sandbox's CPU share (target <= 1.5x: "
         f"{'met' if nb_ratio <= 1.5 else 'NOT met'}), {plain_ratio:.2f}x without (p50 "
         f"{pct(nb['busy_plain'], 50) * 1000:.2f} ms busy, {pct(nb['alone_plain'], 50) * 1000:.2f} ms alone; "
         f"{share.kind}: "
         f"{share.detail.split(':')[0]}; on a machine already loaded by other jobs, a neighbour's loops add "
         f"less and the ratios move with that load). A fork bomb's command timed out after {bomb['timeout']:g} s: "
         f"{bomb['ended']} processes ended in {bomb['cleanup_ms']:.0f} ms, and the next command "
         f"{'succeeded' if bomb['next_ok'] else 'FAILED'} in {bomb['next_ms']:.0f} ms "
         f"(target: {'met' if bomb['next_ok'] else 'NOT met'}); its reply ends with "
         f"`{bomb['note']}`."),
        (f"- Machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, bubblewrap "
         f"{bwrap_version.split()[-1]}, Python {platform.python_version()}; load average {load_before} before / "
         f"{load()} after. The machine is shared with other jobs: absolute figures move with load; ratios "
         "measured in the same run are the comparable numbers. "
         f"Reproduce: `python bench/sandbox.py --write{' --docker' if args.docker else ''}` (this run: "
         f"{args.starts} starts, {args.handouts} hand-outs, "
         f"{args.commands} commands, {args.concurrent} concurrent, {args.neighbour_commands} commands per neighbour "
         "phase"
         + (f"; `--docker`: {args.docker_starts} container starts, {args.docker_commands} commands, Docker API "
            f"{dock['engine']}" if isinstance(dock, dict) else "") + ")."),
    ]  # fmt: skip
    if args.docker:
        drows, dnotes = docker_lines(dock, starts)
        lines += drows
        notes[-1:-1] = dnotes
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", type=int, default=40, help="sequential sandbox starts")
    ap.add_argument("--commands", type=int, default=300, help="commands per exec measurement")
    ap.add_argument("--peer-commands", type=int, default=60, help="commands through the peer")
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--handouts", type=int, default=40, help="pool hand-outs, one at a time")
    ap.add_argument("--neighbour-commands", type=int, default=100, help="commands per noisy-neighbour phase")
    ap.add_argument("--docker", action="store_true", help="also the container backend (podman / DOCKER_HOST)")
    ap.add_argument("--docker-starts", type=int, default=10, help="container starts, one at a time")
    ap.add_argument("--docker-commands", type=int, default=100, help="commands per container exec measurement")
    ap.add_argument("--write", action="store_true", help="write the results into BENCHMARKS.md (## Sandbox)")
    args = ap.parse_args()
    if shutil.which("bwrap") is None:
        sys.exit("bubblewrap (bwrap) is not installed")
    args.bwrap_version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True, check=False).stdout
    text = asyncio.run(run(args))
    print(text)
    if args.write:
        write_section(text)
        print(f"\nwritten to {ROOT / 'BENCHMARKS.md'} (## Sandbox)")


if __name__ == "__main__":
    main()
