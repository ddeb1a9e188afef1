"""RL served by a real vLLM that the run starts itself (`engine.kind: vllm`, `engine.serve: true`): the toy job
end to end, weights reloaded by the server after SFT and every step, and no server left behind, also when the
driver is killed with -9. vLLM's environment as in tests/vllm_real.py (skips without one, fails under
LEGORL_REQUIRE_VLLM=1)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import wait_until
from vllm_real import REQUIRED

from legorl.engine.vllm_server import vllm_python

ROOT = Path(__file__).resolve().parents[1]
TOY = ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128",
       "model.max_position_embeddings=2048", "sampling.max_tokens=32", "harness.step_limit=3", "tasks.n_train=6",
       "tasks.n_heldout=2", "rollout.tasks_per_step=2", "rollout.group_size=2", "run.checkpoint_every=0",
       "engine.kind=vllm", "engine.serve=true", "engine.serve_eager=true"]


@pytest.fixture(autouse=True)
def needs_vllm() -> None:
    python = vllm_python()
    if python is None or not python.is_file():
        reason = "no vLLM environment (.venv/vllm: `make setup-test`; or LEGORL_VLLM_PYTHON)"
        if REQUIRED:
            pytest.fail(f"{reason} (LEGORL_REQUIRE_VLLM=1: `make test` must test against a real vLLM)")
        pytest.skip(reason)


def servers_of(run_dir: Path) -> list[int]:
    """Live vLLM processes serving this run's model (the API server; its engine process, a child of it)."""
    model = str(run_dir / "engine" / "initial").encode()
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if model in cmdline and b"vllm" in cmdline:
                pids.append(int(d.name))
    return [p for p in pids if p != os.getpid()]


def calls_made(run_dir: Path) -> int:
    try:
        return sqlite3.connect(run_dir / "store.sqlite").execute("SELECT COUNT(*) FROM llm_calls").fetchone()[0]
    except sqlite3.Error:  # not created yet
        return 0


def train(run_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """configs/smoke.yaml served by vLLM (its engine section is the embedded engine's)."""
    cfg = yaml.safe_load((ROOT / "configs/smoke.yaml").read_text())
    cfg["engine"] = {}
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return [sys.executable, "-m", "legorl.cli", "train", "--config", str(path), "--run-dir", str(run_dir),
            f"run.cache_dir={cache_dir}", *TOY, *extra]


def test_the_toy_job_served_by_vllm_it_starts_itself(tmp_path, cache_dir) -> None:
    run_dir = tmp_path / "run"
    p = subprocess.run(train(run_dir, cache_dir, "run.steps=2", "sft.enabled=true", "sft.demos=2",
                             "sft.epochs=1", "eval.before_training=true", "eval.after_training=true"),
                       check=False, capture_output=True, text=True, timeout=1500)
    log = run_dir / "logs" / "vllm-server.log"
    assert p.returncode == 0, p.stderr[-3000:] + (log.read_text()[-2000:] if log.exists() else "")
    assert "vLLM ready at http://127.0.0.1:" in p.stderr
    con = sqlite3.connect(run_dir / "store.sqlite")
    metrics = [json.loads(r[0]) for r in con.execute("SELECT metrics_json FROM steps ORDER BY step")]
    # SFT's update is version 1; each RL step's reload the next, stamped on every call made after it
    assert [m["weight_version"] for m in metrics] == [2, 3]
    versions = {r[0] for r in con.execute("SELECT DISTINCT weight_version FROM llm_calls c JOIN rollouts r "
                                          "ON r.id = c.rollout_id WHERE r.split = 'train'")}
    assert versions == {1, 2}
    for m in metrics:  # the sampler's (vLLM's) logprobs and the fp32 trainer's agree
        if not m.get("train/skipped"):
            assert m["train/logprob_pearson"] > 0.999, m["train/logprob_pearson"]
    assert sorted(p.name for p in (run_dir / "engine" / "weights").iterdir()) == ["v1", "v2", "v3"]
    rep = subprocess.run([sys.executable, "-m", "legorl.cli", "report", str(run_dir), "--json"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert json.loads(rep.stdout)["fidelity"]["violations"] == 0
    assert not servers_of(run_dir), "the run's vLLM server outlived it"


def test_a_killed_run_takes_its_vllm_server_with_it(tmp_path, cache_dir) -> None:
    run_dir = tmp_path / "killed"
    proc = subprocess.Popen(train(run_dir, cache_dir, "run.steps=50", "sft.enabled=false"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: (run_dir / "store.sqlite").exists() and calls_made(run_dir) > 0,
                          timeout=900, interval=1.0), "the run never made a model call"
        assert servers_of(run_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert wait_until(lambda: not servers_of(run_dir), timeout=120, interval=1.0), \
            f"vLLM processes {servers_of(run_dir)} survived the run killed with -9"
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in servers_of(run_dir):
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
