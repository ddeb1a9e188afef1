"""Rollouts that survive: chaos mode end to end, and SIGKILL of the driver followed by --resume."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import surviving_processes, wait_until

ROOT = Path(__file__).resolve().parents[1]
TOY = ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128", "sampling.max_tokens=32",
       "harness.step_limit=2", "tasks.n_train=6", "tasks.n_heldout=1"]


def legorl(*args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "legorl.cli", *args], capture_output=True, text=True, check=check, **kw)


def report(run_dir: Path) -> dict:
    p = legorl("report", str(run_dir), "--json", timeout=120, check=True)
    return json.loads(p.stdout)




def test_chaos_run_completes_and_never_trains_on_failures(tmp_path, cache_dir):
    run_dir = tmp_path / "chaos"
    p = legorl("train", "--config", str(ROOT / "configs/chaos.yaml"), "--run-dir", str(run_dir),
               f"run.cache_dir={cache_dir}", *TOY, "rollout.agent_timeout=20", "rollout.group_size=6",
               "faults.harness_crash=0.3", "faults.no_model_calls=0.3", "faults.grader_crash=0.3",
               "faults.disk_full=0.2", "faults.engine_exception=0.2", timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = report(run_dir)
    assert rep["steps"] == 2
    assert rep["fidelity"]["violations"] == 0
    assert rep["integrity"]["untraceable_samples"] == 0 and rep["integrity"]["trained_from_masked"] == 0
    assert rep["faults"].get("harness_crash") and rep["faults"].get("no_model_calls")
    # a rollout hit by exactly one fault ends in that fault's outcome (or was cancelled as a straggler)
    expected = {"harness_crash": "agent_crash", "no_model_calls": "no_model_calls", "harness_hang": "agent_timeout",
                "disk_full": "sandbox_error", "grader_crash": "grader_error"}
    con = sqlite3.connect(run_dir / "store.sqlite")
    checked = 0
    for outcome, reason in con.execute("SELECT outcome, outcome_reason FROM rollouts WHERE outcome_reason "
                                       "LIKE '%[injected:%'"):
        faults = [f.strip() for f in reason.rsplit("[injected:", 1)[1].rstrip("]").split(",")]
        if len(faults) == 1 and faults[0] in expected and not reason.startswith("cancelled"):
            assert outcome == expected[faults[0]], (faults, outcome, reason)
            checked += 1
    # Rollout ids carry a random suffix, so each run draws other faults: with 36 rollouts (group_size 6) fewer
    # than 3 hit by exactly one fault happens ~0.1 % of runs (Monte Carlo); with the config's 18 it was ~10 %.
    assert checked >= 3
    # masked outcomes never carry a reward
    bad = con.execute("SELECT COUNT(*) FROM rollouts WHERE outcome NOT IN ('resolved', 'unresolved', 'max_turns')"
                      " AND reward IS NOT NULL").fetchone()[0]
    assert bad == 0
    assert not surviving_processes(run_dir)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_mid_step_then_resume(tmp_path, cache_dir, mode):
    """Asynchronous: the next step's rollouts are in flight while a step trains; the kill leaves both kinds."""
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "legorl.cli", "train", "--config", str(ROOT / "configs/smoke.yaml"),
           "--run-dir", str(run_dir), f"run.cache_dir={cache_dir}", *TOY, "run.steps=3",
           "rollout.tasks_per_step=2", "rollout.group_size=2", f"rollout.mode={mode}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = run_dir / "store.sqlite"

    def mid_step() -> int | str | None:
        """Steps done once step 0 is done and step 1's rollouts are in flight; "exited" if the run ended."""
        if proc.poll() is not None:
            return "exited"
        if not db.exists():
            return None
        try:
            con = sqlite3.connect(db, timeout=5)
            steps = con.execute("SELECT COUNT(*) FROM steps").fetchone()[0]
            live = con.execute("SELECT COUNT(*) FROM rollouts WHERE outcome IS NULL AND step >= 1").fetchone()[0]
            con.close()
        except sqlite3.Error:
            return None
        return steps if steps >= 1 and live > 0 else None

    # a fast machine runs a toy step's rollouts in well under a second: poll often
    killed_during = wait_until(mid_step, timeout=600, interval=0.02)
    if isinstance(killed_during, int):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    if not isinstance(killed_during, int):
        pytest.fail(f"the run finished or stalled before it could be killed mid-step ({killed_during})")
    # sandboxes and workers exit when the pipes the driver held close
    assert not surviving_processes(run_dir), "processes of the killed run survived"

    p = legorl("train", "--resume", str(run_dir), timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = report(run_dir)
    assert rep["steps"] == 3
    con = sqlite3.connect(db)
    assert [r[0] for r in con.execute("SELECT step FROM steps ORDER BY step")] == [0, 1, 2]
    versions = [json.loads(r[0])["weight_version"] for r in con.execute("SELECT metrics_json FROM steps ORDER BY step")]
    assert versions == sorted(versions) and len(set(versions)) == 3  # continuous, no step done twice
    assert con.execute("SELECT COUNT(*) FROM rollouts WHERE outcome IS NULL").fetchone()[0] == 0
    trained_steps = [r[0] for r in con.execute("SELECT DISTINCT step FROM trained_samples ORDER BY step")]
    assert set(trained_steps) <= {0, 1, 2}
    trained = [r[0] for r in con.execute("SELECT rollout_id FROM trained_samples")]
    assert len(trained) == len(set(trained))  # no sample trained twice
    # every rollout the killed run sampled for a redone step is kept, marked superseded, never trained
    superseded = {r[0] for r in con.execute("SELECT id FROM rollouts WHERE split = 'superseded'")}
    assert not superseded & set(trained)
    assert rep["integrity"]["trained_from_masked"] == 0 and rep["integrity"]["untraceable_samples"] == 0
    assert not surviving_processes(run_dir)


def test_fault_wrapper_passes_the_restored_weight_version_to_the_engine(tokenizer):
    import asyncio

    from legorl.config import FaultsConfig
    from legorl.engine import ScriptedEngine
    from legorl.rollout.faults import FaultyEngine

    engine = ScriptedEngine(tokenizer)
    wrapped = FaultyEngine(engine, FaultsConfig(engine_exception=0.5), "r1")
    assert asyncio.run(wrapped.update_weights({}, 7)) == 7  # what --resume does to keep version stamps continuous
    assert engine.weight_version == 7 and wrapped.weight_version == 7


def test_engine_faults_are_named_on_the_rollout_they_hit():
    """A rollout hit by an engine fault and an episode fault must name both (else its outcome looks wrong):
    each rollout's wrapper keeps the faults its calls met."""
    import asyncio

    from legorl.config import FaultsConfig
    from legorl.records import GenerationResult, SamplingParams
    from legorl.rollout.faults import FaultyEngine, InjectedFault

    class Engine:
        async def generate(self, prompt_ids, params, *, rollout_id=""):
            return GenerationResult(completion_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="stop", weight_version=0)

    wrapped = FaultyEngine(Engine(), FaultsConfig(engine_exception=1.0), "r1")
    with pytest.raises(InjectedFault):
        asyncio.run(wrapped.generate([1], SamplingParams(), rollout_id="r1"))
    assert wrapped.hits == {"engine_exception"}
    assert FaultyEngine(Engine(), FaultsConfig(engine_exception=1.0), "r2").hits == set()
    malformed = FaultyEngine(Engine(), FaultsConfig(engine_malformed=1.0), "r3")
    asyncio.run(malformed.generate([1], SamplingParams(), rollout_id="r3"))
    assert malformed.hits == {"engine_malformed"}
