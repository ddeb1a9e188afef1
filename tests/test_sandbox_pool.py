"""The pool of pre-started bubblewrap sandboxes (sandbox.pool_size, sandbox/pool.py): a handed-out sandbox
shows exactly its own workspace and nothing a previous user left, is used once, keeps every guarantee of a
fresh one (isolation, limits, watchdog, process-tree kill, CPU share, reaping), a request with other
settings starts fresh, the pool refills in the background within its bound and closes without leaks."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import run_processes, wait_until_async

from legorl.config import SandboxConfig
from legorl.sandbox import SandboxError, SandboxLimits, create_sandbox, reap_sandboxes
from legorl.sandbox.bwrap import process_tree
from legorl.sandbox.control import RELAY_PORT
from legorl.sandbox.cpushare import support
from legorl.sandbox.pool import POOL_DIR, SandboxPool, current_pool, pool_for
from legorl.sandbox.procs import alive, cmdline

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
ROOT = os.geteuid() == 0


def sandboxes(root: Path) -> list[int]:
    """The sandboxes (outer bwrap processes) whose command line names `root`."""
    pids = {int(line.split(":")[0]) for line in run_processes(root, kinds=("bwrap",))}
    pids = {p for p in pids if (cmd := cmdline(p)) and os.path.basename(cmd[0]) == "bwrap"}
    return sorted(p for p in pids if _ppid(p) not in pids)


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def spec(root: Path, name: str = "x", **kw) -> dict:
    """create_sandbox's backend arguments (the factory's defaults) for the rollout `name` under `root`."""
    base = {"workspace": root / name / "workspace", "sandbox_dir": root / name, "label": "pool-test", "proxy_socket": None,
                "relay_port": RELAY_PORT, "hide_paths": (), "limits": None, "inside_workspace": "/workspace", "env": None,
                "ro_binds": None, "visible_paths": (), "sandbox_uid": None, "cpus": None}  # fmt: skip
    return {**base, **kw}


def workspace(root: Path, name: str, files: dict[str, str]) -> Path:
    ws = root / name / "workspace"
    ws.mkdir(parents=True)
    for rel, text in files.items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    return ws


async def warm(cfg: SandboxConfig, root: Path, n: int, **kw) -> SandboxPool:
    pool = pool_for(cfg.pool_size)
    assert await pool.prewarm(spec(root, **kw), n) == n, pool.stats
    return pool


async def handed_out(cfg: SandboxConfig, root: Path, name: str, files: dict[str, str], **kw):
    """A sandbox that must come from the pool (a hit)."""
    ws = workspace(root, name, files)
    pool = current_pool()
    assert pool is not None
    hits = pool.stats.hits
    box = await create_sandbox(cfg, workspace=ws, sandbox_dir=root / name, label="pool-test", **kw)
    assert pool.stats.hits == hits + 1, pool.stats
    return box


def test_handed_out_sandbox_shows_exactly_its_own_workspace(tmp_path: Path) -> None:
    """Two rollouts' workspaces handed to two pooled sandboxes: each sees its own files and writes where the
    host looks, neither sees the other's, the pool's slots or anything left by a user before it."""
    vis = tmp_path / "vis"  # the run dir in a visible path, hidden like a run's: the worst case of a layout
    root = vis / "sandboxes"
    root.mkdir(parents=True)
    cfg = SandboxConfig(pool_size=3)
    kw = {"hide_paths": [vis], "visible_paths": [vis]}

    async def main() -> None:
        await warm(cfg, root, 3, **kw)
        a = await handed_out(cfg, root, "a", {"a.txt": "A-ONLY\n", "pkg/mod.py": "x = 1\n"}, **kw)
        b = await handed_out(cfg, root, "b", {"b.txt": "B-ONLY\n"}, **kw)
        try:
            assert a.workspace == (root / "a" / "workspace").resolve()
            assert a.control_socket == (root / "a" / "ctl" / "control.sock").resolve()
            label = json.loads((root / "a" / "label.json").read_text())
            assert label["bwrap_pid"] == a.pid and label["ctl"] in cmdline(a.pid)  # what reap_orphans checks
            r = await a.exec("pwd; ls -A; cat a.txt pkg/mod.py; echo new > out.txt")
            assert r.output.split("\n")[:5] == ["/workspace", "a.txt", "pkg", "A-ONLY", "x = 1"], r.output
            # /tmp: its own, empty but for what is bound there: the visible dir when the test's tmp dir is
            # below /tmp, the interpreter when the checkout is
            bound = (vis, Path(sys.prefix).resolve())
            shown = sorted({p.relative_to("/tmp").parts[0] for p in bound if p.is_relative_to("/tmp")})
            assert (await a.exec("ls -A /tmp /dev/shm")).output.split() == ["/dev/shm:", "/tmp:", *shown]
            assert (root / "a" / "workspace" / "out.txt").read_text() == "new\n"  # writes land where the host looks
            (root / "a" / "workspace" / "host.txt").write_text("from host\n")
            assert (await a.exec("cat host.txt")).output == "from host\n"
            assert (await b.exec("ls -A")).output == "b.txt\n"
            r = await b.exec("grep -rls A-ONLY / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr "
                             f"--exclude-dir=lib --exclude-dir=etc --exclude-dir={Path(sys.prefix).name}; true")
            assert r.output == "", r.output  # the other rollout's files are nowhere
            r = await b.exec(f"find {vis} -mindepth 1; ls {root}/{POOL_DIR} {root}/a 2>&1 | grep -c 'No such'")
            assert r.output == "2\n", r.output  # the hidden run dir shows nothing: no slot, no other rollout
            if ROOT:  # a root driver's sandbox runs as its own uid, which owns its workspace (as a fresh start's)
                r = await a.exec("id -u; stat -c %u . a.txt pkg/mod.py")
                uid, *owners = r.output.split()
                assert uid != "0" and owners == [uid] * 3, r.output
                assert (await b.exec("id -u")).output.strip() != uid  # each sandbox its own uid
        finally:
            await a.close()
            await b.close()
            await reap_sandboxes(cfg, root)

    asyncio.run(main())


def test_pooled_sandboxes_are_used_once_and_refilled_within_the_bound(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    root.mkdir()
    cfg = SandboxConfig(pool_size=2)

    async def main() -> None:
        pool = await warm(cfg, root, 2)
        assert len(sandboxes(root)) == 2
        pids = []
        for i in range(4):
            box = await handed_out(cfg, root, f"r{i}", {"f": str(i)})
            pids.append(box.pid)
            assert (await box.exec("cat f")).output == str(i)
            await box.close()
            assert not alive(box.pid) or await wait_until_async(lambda b=box: not alive(b.pid), 10)
            await wait_until_async(lambda: pool.waiting() == 2, 60)  # refilled in the background
            assert len(sandboxes(root)) <= 2  # never more than the bound waiting
        assert len(set(pids)) == 4  # a new sandbox for every hand-out: none came back
        await reap_sandboxes(cfg, root)
        assert sandboxes(root) == [] and not (root / POOL_DIR).exists()

    asyncio.run(main())


def test_other_settings_start_fresh_and_a_repeated_kind_gets_pooled(tmp_path: Path) -> None:
    """Limits, read-only binds (a task environment) and the proxy socket (network) are part of what a pooled
    sandbox was started with: a request that differs starts fresh, with its own settings."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    cfg = SandboxConfig(pool_size=2)
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / "marker").write_text("ENV\n")

    async def main() -> None:
        pool = await warm(cfg, root, 2)
        for i, (kw, check, want) in enumerate([
            ({"limits": SandboxLimits(processes=77)}, "ulimit -u", "77"),
            ({"ro_binds": {"/opt/extra": env_dir}}, "cat /opt/extra/marker", "ENV"),
            ({"env": {"FOO": "bar"}}, "echo $FOO", "bar"),
            ({"inside_workspace": "/src/repo"}, "pwd", "/src/repo"),
        ]):  # fmt: skip
            ws = workspace(root, f"m{i}", {"f": "x"})
            misses, hits = pool.stats.misses, pool.stats.hits
            box = await create_sandbox(cfg, workspace=ws, sandbox_dir=root / f"m{i}", label="pool-test", **kw)
            try:
                assert (pool.stats.misses, pool.stats.hits) == (misses + 1, hits), (kw, pool.stats)
                assert (await box.exec(check)).output.strip() == want, kw
            finally:
                await box.close()
        assert pool.waiting() == 2  # the waiting ones stay for their own kind
        box = await handed_out(cfg, root, "same", {"f": "x"})
        await box.close()
        # a kind asked for again and again gets pooled: the pool makes room for it
        for i in range(4):
            ws = workspace(root, f"p{i}", {"f": "x"})
            box = await create_sandbox(cfg, workspace=ws, sandbox_dir=root / f"p{i}", label="pool-test",
                                       limits=SandboxLimits(processes=77))
            await box.close()
        await wait_until_async(lambda: pool.waiting(spec(root, limits=SandboxLimits(processes=77))) == 2, 60)
        box = await handed_out(cfg, root, "p-hit", {"f": "x"}, limits=SandboxLimits(processes=77))
        assert (await box.exec("ulimit -u")).output.strip() == "77"
        await box.close()
        await reap_sandboxes(cfg, root)

    asyncio.run(main())


def test_a_one_off_kind_is_never_pooled_and_pool_size_0_is_off(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    root.mkdir()

    async def main() -> None:
        for i in range(3):  # every request its own kind (as a grading with its own result dir)
            ws = workspace(root, f"g{i}", {"f": "x"})
            box = await create_sandbox(SandboxConfig(pool_size=4), workspace=ws, sandbox_dir=root / f"g{i}",
                                       label=f"grade-{i}")  # fmt: skip
            await box.close()
        pool = current_pool()
        assert pool is not None and pool.stats.started == 0 and pool.stats.misses == 3
        loop_pool = pool
        for i in range(4):
            ws = workspace(root, f"off{i}", {"f": "x"})
            box = await create_sandbox(SandboxConfig(pool_size=0), workspace=ws, sandbox_dir=root / f"off{i}",
                                       label="off")  # fmt: skip
            await box.close()
        assert loop_pool.stats.misses == 3 and not (root / POOL_DIR).exists()  # 0: never asked the pool

    asyncio.run(main())
    assert run_processes(root, kinds=("bwrap",)) == []


def test_the_end_of_the_loop_closes_the_pool(tmp_path: Path) -> None:
    """asyncio.run's end (no reap_sandboxes) closes what waits: no bwrap survives its loop."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    cfg = SandboxConfig(pool_size=3)

    async def main() -> list[int]:
        await warm(cfg, root, 3)
        box = await handed_out(cfg, root, "r", {"f": "x"})
        await box.close()
        return sandboxes(root)

    pids = asyncio.run(main())
    assert len(pids) >= 2
    assert not [p for p in pids if alive(p)]
    assert run_processes(root, kinds=("bwrap",)) == []


def test_handed_out_sandbox_keeps_limits_watchdog_kill_and_cpu_share(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    root.mkdir()
    cfg = SandboxConfig(pool_size=2)
    limits = SandboxLimits(processes=64, workspace_mb=4, cpu_seconds=30)

    async def main() -> None:
        await warm(cfg, root, 2, limits=limits)
        box = await handed_out(cfg, root, "w", {"f": "x"}, limits=limits)
        try:
            assert (await box.exec("ulimit -u; ulimit -t")).output.split() == ["64", "30"]
            if support().kind != "nice":  # its own cgroup, holding its processes
                assert box.cpu_share is not None and box.cpu_share.path is not None
                procs = (box.cpu_share.path / "cgroup.procs").read_text().split()
                assert str(box.pid) in procs or any(str(p) in procs for p in process_tree(box.pid))
            r = await box.exec("(sleep 4321 &) ; setsid sleep 4321 & sleep 30", timeout=1)
            assert r.timed_out and "sleep" in r.ended
            assert not [p for p in process_tree(box.pid) if "4321" in cmdline(p)]
            with pytest.raises(SandboxError, match="workspace size limit exceeded"):
                await box.exec("head -c 8M /dev/zero > big; sleep 30", timeout=40)
        finally:
            await box.close()
        # the lifetime counts from the hand-out, not from the pooled start
        await warm(cfg, root, 1, limits=SandboxLimits(lifetime_s=2))
        await asyncio.sleep(2.5)
        box = await handed_out(cfg, root, "life", {"f": "x"}, limits=SandboxLimits(lifetime_s=2))
        try:
            assert (await box.exec("echo alive")).output == "alive\n"
            with pytest.raises(SandboxError, match="lifetime"):
                await box.exec("sleep 30", timeout=40)
        finally:
            await box.close()
            await reap_sandboxes(cfg, root)

    asyncio.run(main())


def test_adversarial_escapes_from_a_handed_out_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The adversarial suite's escape probes (network, host files, writes, signals, survivors), run in a
    sandbox handed out by the pool."""
    import test_adversarial as adv

    cfg = SandboxConfig(pool_size=1)
    used = []

    async def pooled(cfg_: SandboxConfig, **kw):
        pool = pool_for(cfg.pool_size)
        keys = {k: kw[k] for k in ("workspace", "sandbox_dir", "label", "hide_paths") if k in kw}
        assert await pool.prewarm(spec(Path(kw["sandbox_dir"]).parent, **keys), 1) == 1, pool.stats
        hits = pool.stats.hits
        box = await create_sandbox(cfg, **kw)
        used.append(pool.stats.hits == hits + 1)
        return box

    monkeypatch.setattr(adv, "create_sandbox", pooled)
    adv.test_escapes_network_files_writes_signals_and_survival(tmp_path, cfg)
    assert used == [True]
    assert sandboxes(tmp_path) == []  # the refill started after the hand-out ended with the loop


DRIVER = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    from legorl.config import SandboxConfig
    from legorl.sandbox import create_sandbox
    from legorl.sandbox.bwrap import process_tree
    from legorl.sandbox.pool import pool_for

    async def main():
        root = Path(sys.argv[1])
        cfg = SandboxConfig(pool_size=2)
        spec = dict(workspace=root / "a" / "workspace", sandbox_dir=root / "a", label="run-pool", proxy_socket=None,
                    relay_port=18000, hide_paths=(), limits=None, inside_workspace="/workspace", env=None,
                    ro_binds=None, visible_paths=(), sandbox_uid=None, cpus=None)
        root.mkdir(parents=True)
        pool = pool_for(2)
        assert await pool.prewarm(spec, 2) == 2, pool.stats
        (root / "a" / "workspace").mkdir(parents=True)
        box = await create_sandbox(cfg, workspace=root / "a" / "workspace", sandbox_dir=root / "a", label="run-pool")
        assert pool.stats.hits == 1, pool.stats
        await box.exec("setsid sleep 3000 >/dev/null 2>&1 &")
        assert await pool.prewarm(spec, 2) == 2, pool.stats
        print(" ".join(map(str, process_tree(box.pid))), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
    """
)


def test_pooled_sandboxes_of_a_sigkilled_driver_die_with_it(tmp_path: Path) -> None:
    root = tmp_path / "sandboxes"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        handed = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
        waiting = sandboxes(root)
        assert len(handed) >= 4 and len(waiting) == 3, (handed, waiting)  # one handed out, two waiting
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

        async def gone() -> bool:
            return await wait_until_async(lambda: not any(alive(p) for p in handed + waiting), 20, 0.05)

        assert asyncio.run(gone()), "sandboxes outlived their killed driver"
        assert asyncio.run(reap_sandboxes(None, root, "run-pool")) == []
    finally:
        proc.kill()
        proc.wait()


def test_rollouts_run_in_handed_out_sandboxes(tokenizer, tmp_path: Path) -> None:
    """run_episode through create_sandbox with the pool on: once the rollouts' kind is pooled, they run in
    handed-out sandboxes and resolve their task like fresh ones (mini-swe-agent, scripted teacher, grading)."""
    from legorl.config import HarnessConfig
    from legorl.engine import ScriptedEngine
    from legorl.harness.mini_swe_agent import MiniSweAgentHarness
    from legorl.proxy.server import Proxy
    from legorl.records import Outcome
    from legorl.rollout.episode import EpisodeContext, run_episode, scripted
    from legorl.rollout.teacher import teacher_script
    from legorl.store import Store
    from legorl.tasks import builtin_splits

    async def main():
        store = Store(tmp_path / "store.sqlite")
        engine = ScriptedEngine(tokenizer)
        proxy = Proxy(engine, tokenizer, on_call=store.add_call)
        await proxy.start(unix_socket=tmp_path / "s" / "proxy.sock")
        harness = MiniSweAgentHarness(HarnessConfig(step_limit=8), command_timeout=20, log_dir=tmp_path / "logs")
        await harness.start()
        task = builtin_splits(1, 0, seed=5)[0][0]
        ctx = EpisodeContext(proxy=proxy, harnesses={harness.name: harness}, store=store, run_dir=tmp_path,
                             label="pooled-run", agent_timeout=120, grading_timeout=60, hide_paths=[tmp_path],
                             engine_for=scripted(engine, lambda t, h: teacher_script(t, run_tests=True, harness=h)),
                             sandbox=SandboxConfig(pool_size=2))  # fmt: skip
        out = []
        try:
            for i in range(5):
                hits = current_pool().stats.hits if current_pool() else 0
                rollout = await run_episode(ctx, task, step=0, group_id=f"g{i}", sample_index=0)
                out.append((rollout, current_pool().stats.hits - hits))
                if i >= 2:  # the kind is pooled: let the background start finish before the next rollout
                    await wait_until_async(lambda: current_pool().waiting() >= 1, 60)
        finally:
            await harness.close()
            await proxy.stop()
            await reap_sandboxes(ctx.sandbox, tmp_path / "sandboxes", "pooled-run")
        return out

    out = asyncio.run(main())
    assert [hit for _, hit in out] == [0, 0, 0, 1, 1]  # pooled from the third request on, in the background
    for rollout, _ in out:
        assert rollout.outcome == Outcome.RESOLVED and rollout.reward == 1.0, rollout.outcome_reason
    assert sandboxes(tmp_path) == []


def test_relay_reaches_the_proxy_from_a_handed_out_sandbox(tmp_path: Path) -> None:
    """The proxy socket bound at the pooled start is the one the rollout uses; nothing else is reachable."""
    root = tmp_path / "sandboxes"
    root.mkdir()
    sock = tmp_path / "proxy.sock"
    cfg = SandboxConfig(pool_size=1)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"proxy:" + await reader.readline())
        await writer.drain()
        writer.close()

    async def main() -> str:
        server = await asyncio.start_unix_server(echo, path=str(sock))
        try:
            await warm(cfg, root, 1, proxy_socket=sock)
            box = await handed_out(cfg, root, "r", {"f": "x"}, proxy_socket=sock)
            try:
                probe = (f"import socket; s = socket.create_connection(('127.0.0.1', {box.relay_port}), timeout=5); "
                         "s.sendall(b'hello\\n'); print(s.recv(100).decode().strip())")
                r = await box.exec(f'python3 -c "{probe}"; python3 -c "import socket; '
                                   "socket.create_connection(('1.1.1.1', 80), timeout=2)\" 2>/dev/null || echo no-net")
                return r.output
            finally:
                await box.close()
                await reap_sandboxes(cfg, root)
        finally:
            server.close()

    assert asyncio.run(main()).split() == ["proxy:hello", "no-net"]
