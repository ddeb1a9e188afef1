"""Runaway work in a real bubblewrap sandbox is ended: a command's timeout or cancellation ends everything it
started (background jobs, double forks, `setsid` daemons) and only that; a fork bomb leaves the sandbox usable;
an exhausted process budget ends the rollout as a typed `sandbox_error`; each sandbox has its own CPU share."""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
from pathlib import Path

import pytest
from helpers import run_mini_episode, wait_until_async

from legorl.config import HarnessConfig
from legorl.records import Outcome
from legorl.rollout.outcomes import EpisodeFacts, decide
from legorl.rollout.teacher import _turn
from legorl.sandbox import SandboxError, SandboxLimits, cpushare
from legorl.sandbox.bwrap import BwrapSandbox, process_tree
from legorl.sandbox.procs import alive, cmdline
from legorl.tasks import builtin_splits

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

# Fills the sandbox's process budget once `go` exists in the workspace, and keeps it full (takes every slot
# that frees up); says so in `full`. Started as a daemon by a command that returns at once, it outlives it.
FILLER = """import os, time
while not os.path.exists('go'):
    time.sleep(0.01)
while True:
    try:
        if os.fork() == 0:
            time.sleep(1000)
            os._exit(0)
    except OSError:
        open('full', 'w').close()
"""
START_FILLER = f"printf '%s' {shlex.quote(FILLER)} > /tmp/filler.py && (setsid python3 /tmp/filler.py >/dev/null 2>&1 &); echo started"


async def make(tmp: Path, name: str = "box", **kw) -> BwrapSandbox:
    ws = tmp / name / "ws"
    ws.mkdir(parents=True, exist_ok=True)
    return await BwrapSandbox.create(workspace=ws, sandbox_dir=tmp / name / "sb", label="runaway", **kw)


def tree_with(box: BwrapSandbox, marker: str) -> list[int]:
    """Processes of the sandbox whose command line contains `marker`."""
    return [p for p in process_tree(box.pid) if marker in " ".join(cmdline(p))]


def nice_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def test_background_child_is_ended_with_its_timed_out_command(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path)
        try:
            r = await box.exec("echo started; (sleep 100 &); sleep 100", timeout=1)
            assert r.timed_out and r.returncode == -1 and r.output.startswith("started\n"), r
            assert r.ended.count("sleep") == 2, r.ended
            assert "[legorl] timed out after 1 s; ended" in r.output and "sleep" in r.output.splitlines()[-1]
            r = await box.exec("pgrep -x sleep || echo no-sleep")
            assert r.output == "no-sleep\n"
            assert (await box.exec("echo ok")).output == "ok\n"
        finally:
            await box.close()

    asyncio.run(main())


def test_setsid_daemons_and_double_forks_are_ended(tmp_path: Path) -> None:
    double_fork = ("import os, time\n"
                   "if os.fork() == 0:\n"
                   "    os.setsid()\n"
                   "    if os.fork() == 0:\n"
                   "        open('/tmp/d3', 'w').close()\n"
                   "        os.execvp('sleep', ['sleep', '103'])\n")
    command = ("setsid sh -c 'touch /tmp/d1; exec sleep 101' >/dev/null 2>&1 & "
               "(setsid sh -c 'sleep 102 & touch /tmp/d2; wait' >/dev/null 2>&1 &); "
               f"python3 -c {shlex.quote(double_fork)}; "
               "until [ -e /tmp/d1 ] && [ -e /tmp/d2 ] && [ -e /tmp/d3 ]; do sleep 0.01; done; echo all-started; "
               "sleep 104")

    async def main() -> None:
        box = await make(tmp_path)
        try:
            r = await box.exec(command, timeout=8)
            assert r.timed_out and "all-started" in r.output, r  # the daemons ran before the timeout
            assert r.ended.count("sleep") == 4, r.ended  # 101 to 104, wherever they were reparented
            r = await box.exec("pgrep -f 'sleep 10[1-4]' || echo none-left")
            assert r.output == "none-left\n"
            assert not tree_with(box, "sleep 10")
        finally:
            await box.close()

    asyncio.run(main())


def test_fork_bomb_under_a_low_process_limit_then_next_command_succeeds(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path, limits=SandboxLimits(processes=48, cpu_seconds=20))
        try:
            r = await box.exec("bomb() { bomb | bomb & }; bomb; sleep 100", timeout=2)
            assert r.timed_out and len(r.ended) > 20, r.ended
            assert "the sandbox's process limit of 48 was reached: fork bomb?" in r.output
            r = await box.exec("echo ok")
            assert r.returncode == 0 and r.output == "ok\n", r
            assert not box.violation
        finally:
            await box.close()

    asyncio.run(main())


def test_a_timeout_ends_only_its_own_command(tmp_path: Path) -> None:
    """Commands run concurrently in one sandbox: one timing out leaves the others' processes alone, whether
    they still run or were left behind by an earlier command that finished."""
    async def main() -> None:
        box = await make(tmp_path)
        try:
            r = await box.exec("setsid sleep 333 >/dev/null 2>&1 & echo left-running")
            assert r.output == "left-running\n"
            other = asyncio.create_task(box.exec(
                "setsid sleep 222 >/dev/null 2>&1 & while [ ! -e /tmp/go ]; do sleep 0.02; done; echo other-done",
                timeout=60))
            assert await wait_until_async(lambda: tree_with(box, "sleep 222"), timeout=30)
            r = await box.exec("sleep 111 & sleep 112", timeout=1)
            assert r.timed_out and r.ended.count("sleep") == 2 and set(r.ended) <= {"bash", "sleep"}, r.ended
            assert tree_with(box, "sleep 222") and tree_with(box, "sleep 333") and not tree_with(box, "sleep 11")
            await box.exec(": > /tmp/go")
            r = await other
            assert r.output == "other-done\n" and not r.timed_out and r.ended == []
        finally:
            await box.close()

    asyncio.run(main())


def test_exhausted_process_budget_is_detected_and_the_sandbox_killed(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path, limits=SandboxLimits(processes=32))
        try:
            assert (await box.exec(START_FILLER)).output == "started\n"
            ws = tmp_path / "box" / "ws"
            (ws / "go").write_text("")  # from the host: no command of the sandbox runs while it fills
            assert await wait_until_async(lambda: (ws / "full").exists(), timeout=30)
            with pytest.raises(SandboxError, match="killed: process limit exhausted: fork bomb"):
                await box.exec("echo hi")
            assert box.violation.startswith("process limit exhausted: fork bomb? ")
            assert "of 32 processes and threads" in box.violation and "python3" in box.violation
            with pytest.raises(SandboxError, match="process limit exhausted"):  # every later request, at once
                await box.read_file("/tmp/go")
            assert await wait_until_async(lambda: not alive(box.pid), timeout=10)  # the watchdog ended it
        finally:
            await box.close()
        outcome, reason = decide(EpisodeFacts(harness=None, sandbox_error=box.violation), [], None)
        assert outcome == Outcome.SANDBOX_ERROR and reason.startswith("process limit exhausted: fork bomb?")

    asyncio.run(main())


def test_guard_cancels_the_harness_once_the_sandbox_is_killed(tmp_path: Path) -> None:
    async def main() -> None:
        box = await make(tmp_path)
        cancelled = asyncio.Event()

        async def harness() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

        try:
            run = asyncio.create_task(box.guard(harness()))
            await asyncio.sleep(0)  # the harness starts
            assert box.watch is not None
            box.watch.kill("process limit exhausted: fork bomb? (by hand)")  # as the watchdog thread would
            with pytest.raises(SandboxError, match="by hand"):
                await run
            assert cancelled.is_set()
            assert await box.guard(asyncio.sleep(0, "done")) == "done"  # already violated, but work that ends wins
        finally:
            await box.close()

    asyncio.run(main())


def test_rollout_with_an_exhausted_process_budget_ends_as_sandbox_error(tokenizer, tmp_path: Path) -> None:
    """mini-swe-agent plays a script that fills the sandbox's process budget: the rollout ends as a typed
    sandbox_error with the reason (masked), not as a string of failed commands graded as a failure."""
    turns = [_turn("Start a helper.", ": > go; " + START_FILLER)] + [_turn("Go on.", "echo hi")] * 10

    r = run_mini_episode(tokenizer, tmp_path, builtin_splits(1, 0, seed=3)[0][0], HarnessConfig(step_limit=12),
                         command_timeout=30, label="runaway", agent_timeout=120, grading_timeout=60,
                         script_for=lambda t, h: turns, limits=SandboxLimits(processes=32))
    assert r.outcome == Outcome.SANDBOX_ERROR, (r.outcome, r.outcome_reason)
    assert r.outcome_reason.startswith("process limit exhausted: fork bomb?"), r.outcome_reason
    assert r.reward is None and r.report is None


def test_each_sandbox_has_its_own_cpu_share_and_a_busy_one_is_held_to_it(tmp_path: Path) -> None:
    """A busy loop on every core in one sandbox while another runs commands. Deterministic checks only: the
    busy processes are in their sandbox's cgroup, weighted like one process next to the host's (or, without a
    cgroup, niced);
    cancelling the busy command ends its loops."""
    n = os.cpu_count() or 1
    support = cpushare.support()

    async def main() -> None:
        busy, quiet = await make(tmp_path, "busy"), await make(tmp_path, "quiet", cpus=0.5)
        try:
            loops = " ".join(["(while :; do :; done) &"] * n)
            task = asyncio.create_task(busy.exec(f"{loops} wait", timeout=120))

            def spinning() -> list[int]:
                return [p for p in process_tree(busy.pid) if cmdline(p)[:2] == ["bash", "-c"] and p != busy.pid]

            assert await wait_until_async(lambda: len(spinning()) >= n + 1, timeout=30)
            for _ in range(5):
                assert (await quiet.exec("echo hi")).output == "hi\n"
            for box in (busy, quiet):
                assert box.cpu_share is not None and box.cpu_share.kind == support.kind
            if support.root is not None:
                paths = {box.cpu_share.path for box in (busy, quiet)}
                assert len(paths) == 2 and all(p.parent == support.root and p.name.startswith("legorl-") for p in paths)
                procs = (busy.cpu_share.path / "cgroup.procs").read_text().split()
                assert {str(p) for p in spinning()} <= set(procs)
                weight = "cpu.shares" if support.kind == "cgroup1" else "cpu.weight"
                one = cpushare.V1_SHARES if support.kind == "cgroup1" else cpushare.V2_WEIGHT
                assert int((busy.cpu_share.path / weight).read_text()) == one  # like one process, side by side
                if support.kind == "cgroup1":  # a task's limits.cpus caps its sandbox outright
                    assert (quiet.cpu_share.path / "cpu.cfs_quota_us").read_text().split() == ["50000"]
                else:
                    assert (quiet.cpu_share.path / "cpu.max").read_text().split() == ["50000", "100000"]
            else:
                assert all(nice_of(p) >= cpushare.NICE for p in spinning())
            task.cancel()  # the client hangs up: the command's whole tree is ended
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await wait_until_async(lambda: not spinning(), timeout=30)
            assert (await busy.exec("echo still-usable")).output == "still-usable\n"
            paths = [box.cpu_share.path for box in (busy, quiet)]
        finally:
            await busy.close()
            await quiet.close()
        assert not any(p is not None and p.exists() for p in paths)  # removed at close

    asyncio.run(main())


def test_without_a_cgroup_the_sandbox_runs_niced_and_doctor_says_so(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from legorl.cli import app

    fallback = cpushare.Support("nice", None, "no cpu controller in any mounted cgroup hierarchy")
    monkeypatch.setattr(cpushare, "support", lambda: fallback)

    async def main() -> None:
        box = await make(tmp_path)
        try:
            assert box.cpu_share is not None and box.cpu_share.kind == "nice"
            r = await box.exec("nice; renice -n 0 -p $$ >/dev/null 2>&1 || echo cannot-raise")
            assert r.output.split() == [str(cpushare.NICE), "cannot-raise"], r.output
        finally:
            await box.close()

    asyncio.run(main())
    out = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "400"}).output
    line = next(x for x in out.splitlines() if "sandbox CPU share" in x)
    assert "absent" in line and f"nice {cpushare.NICE}" in line and "no cpu controller" in line
