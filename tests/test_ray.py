"""The Ray backend: a local Ray cluster started here, 2 rollout workers, the toy job for 2 RL steps.

The rollouts (proxy + sandbox + mini-swe-agent) run on the Ray actors; the driver keeps the
store, the trainer and the engine, served to the workers over HTTP. The records must be those
of the embedded path: every rollout with its outcome and calls, fidelity intact, calls stamped
with the weight version they were sampled under, and nothing left running afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3

import pytest
from helpers import run_processes, surviving_processes, wait_until_async

from legorl.config import load_config
from legorl.models import load_tokenizer
from legorl.pipeline import Driver, run_job
from legorl.records import Outcome
from legorl.store import Store

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'legorl[ray]' (make test does)")

pytestmark = pytest.mark.e2e




TOY = ["model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128", "sampling.max_tokens=48",
       "harness.step_limit=3", "tasks.n_heldout=1", "rollout.tasks_per_step=1", "rollout.group_size=2",
       "ray.address=local", "ray.workers=2"]


@pytest.fixture(scope="module")
def ray_cluster():
    """The test's own local cluster: 2 CPUs, one per rollout worker; drivers join it (ray.init done)."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_run(ray_cluster, tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("ray-run")
    cfg = load_config(None, [f"run.cache_dir={cache_dir}", *TOY, "run.steps=2", "tasks.n_train=2",
                             "sft.enabled=true", "sft.demos=2", "sft.epochs=1"])
    summary = asyncio.run(run_job(cfg, run_dir))
    return run_dir, summary, run_processes(run_dir)


def test_two_steps_on_two_workers(ray_run):
    run_dir, summary, _ = ray_run
    assert summary["steps"] == 2
    assert json.loads((run_dir / "summary.json").read_text())["sft"]["sft/demos_resolved"] == 2

    store = Store(run_dir / "store.sqlite")
    assert store.step_numbers() == [0, 1]
    train = store.rollouts(split="train", with_calls=True)
    demos = store.rollouts(split="demo")
    assert len(train) == 4 and len(demos) == 2
    assert all(r.outcome is not None for r in train + demos)
    # Both workers ran rollouts (the driver sends each to the least busy one).
    assert {r.timings.get("ray_worker") for r in train + demos} == {0.0, 1.0}
    for r in demos:  # the teacher was plugged into the workers' proxies: its tokens are not the policy's
        assert store.calls_for(r.id) and not any(c.sampled_from_policy for c in store.calls_for(r.id))


def test_weight_versions_reach_the_workers(ray_run):
    """Each step's calls carry the version the driver's engine had when it ran: after the SFT sync 1,
    after step 0's update 2. The workers learn it when the driver resumes them after an update."""
    run_dir, _, _ = ray_run
    store = Store(run_dir / "store.sqlite")
    for step, version in ((0, 1), (1, 2)):
        rollouts = store.rollouts(step=step, split="train", with_calls=True)
        assert rollouts and all(r.weight_version_start == version for r in rollouts)
        assert {c.weight_version for r in rollouts for c in r.calls} <= {version}
    assert store.step_metrics(1)["weight_version"] == 3.0


def test_records_keep_their_fidelity(ray_run):
    run_dir, _, _ = ray_run
    store = Store(run_dir / "store.sqlite")
    tok = load_tokenizer(run_dir / "tokenizer")
    report = store.report(decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert report["steps"] == 2 and report["llm_calls"] > 0
    assert report["fidelity"]["violations"] == 0
    assert report["integrity"]["untraceable_samples"] == 0 and report["integrity"]["trained_from_masked"] == 0
    assert "pending" not in report["rollouts"]
    assert "train/logprob_pearson" in report["last_step"]


def test_nothing_left_running(ray_run):
    run_dir, _, leftovers = ray_run
    assert leftovers == []
    assert not list((run_dir / "workers").glob("w*/sandboxes/*"))  # each worker removed its sandboxes


def test_a_dead_worker_costs_a_retry_not_the_step(ray_cluster, tmp_path, cache_dir):
    """SIGKILL a worker in the middle of an episode: that rollout is a sandbox_error (masked), run again
    on the other worker, and the step completes; the dead worker's sandbox and harness die with it."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [f"run.cache_dir={cache_dir}", *TOY, "run.steps=1", "tasks.n_train=2",
                             "rollout.retry_backoff=0.1", "monitor.dashboard=false"])

    async def main() -> None:
        async with Driver(cfg, run_dir) as driver:
            training = asyncio.create_task(driver.train())
            boxes = run_dir / "workers" / "w0" / "sandboxes"

            def in_episode() -> bool:  # worker 0 is in an episode
                assert not training.done(), "the step ended before worker 0 ran an episode"
                return boxes.is_dir() and any(boxes.iterdir())

            assert await wait_until_async(in_episode, timeout=600, interval=0.02)
            os.kill(driver.cluster.workers[0].info["pid"], signal.SIGKILL)
            await training

    asyncio.run(main())
    store = Store(run_dir / "store.sqlite")
    assert store.step_numbers() == [0]
    rollouts = store.rollouts(split="train")
    lost = [r for r in rollouts if r.outcome == Outcome.SANDBOX_ERROR]
    assert len(lost) == 1 and "worker" in lost[0].outcome_reason and lost[0].reward is None
    done = [r for r in rollouts if r.id != lost[0].id]
    assert len(done) == 2 and all(r.reward is not None for r in done)
    assert {r.timings.get("ray_worker") for r in done} == {1.0}  # the retry ran on the living worker
    assert store.step_metrics(0)["rollouts/retries"] == 1.0
    assert surviving_processes(run_dir) == []  # the kernel delivers the parent-death signals


def test_asynchronous_rl_on_two_workers(ray_cluster, tmp_path, cache_dir):
    """rollout.mode async with Ray: the next step's groups sample on the workers while the driver trains; the
    workers' proxies drain only for each reload, and every call keeps the version it was served under."""
    run_dir = tmp_path / "async"
    cfg = load_config(None, [f"run.cache_dir={cache_dir}", *TOY, "run.steps=3", "tasks.n_train=4",
                             "rollout.mode=async", "rollout.max_staleness=1"])
    summary = asyncio.run(run_job(cfg, run_dir))
    assert summary["steps"] == 3
    store = Store(run_dir / "store.sqlite")
    for step in range(3):
        m = store.step_metrics(step)
        assert m["weight_version"] == step + 1 and m["async/dropped"] == 0
        assert max(int(k.rsplit("/", 1)[1]) for k in m if k.startswith("async/staleness/")) <= 1
        for r in store.rollouts(step=step, split="train", with_calls=True):  # within the bound, one version a call
            assert all(step - 1 <= c.weight_version <= step and c.token_versions is None for c in r.calls)
    trained = [r[0] for r in sqlite3.connect(run_dir / "store.sqlite").execute("SELECT rollout_id FROM trained_samples")]
    assert len(trained) == len(set(trained))
    assert run_processes(run_dir) == []
