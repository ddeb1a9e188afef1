"""Asynchronous RL (`rollout.mode: async`): weight updates that reach the engine mid-generation, per-token
weight versions, the staleness filter, and a whole run whose next steps sample while the trainer trains."""

from __future__ import annotations

import asyncio
import copy
import json
import sqlite3

import pytest
import torch
from helpers import wait_until_async
from test_engine import greedy, no_stop_engine, prompts, recompute

from legorl.config import load_config
from legorl.engine import LocalEngine, token_logprobs
from legorl.models import ModelSpec, build_model
from legorl.monitor.analytics import overview
from legorl.monitor.db import RunDB
from legorl.pipeline import run_job, staleness_filter
from legorl.records import LLMCall, Outcome, Rollout
from legorl.rollout.outcomes import capture_problem
from legorl.store import Store
from legorl.train.losses import is_correction
from legorl.train.sequences import build_sequences

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def two_models(tok):
    """The served model (the engine loads updates into it) and the new weights' model."""
    return build_model(ModelSpec(num_layers=1, seed=2), tok), build_model(ModelSpec(num_layers=1, seed=3), tok)


async def decoding(eng: LocalEngine, prompt: list[int], max_tokens: int, generated: int) -> asyncio.Task:
    """A greedy generation of `max_tokens`, returned once the engine has generated `generated` tokens."""
    task = asyncio.create_task(eng.generate(prompt, greedy(max_tokens)))
    assert await wait_until_async(lambda: eng.stats()["generated_tokens"] >= generated, timeout=60)
    return task


def test_an_in_flight_update_reaches_a_generation_mid_way(tok, tmp_path) -> None:
    """The update does not wait for the generation: the tokens after it come from the new weights, each stamped
    with its version; a request started after it is served by the new weights alone (no KV of the old ones)."""
    served, new = two_models(tok)
    old = copy.deepcopy(served)
    p = prompts(tok, 1)[0]

    async def go(eng: LocalEngine):
        before = await eng.generate(p, greedy(300))  # the old weights' greedy answer, its KV now cached
        inflight = await decoding(eng, p, 300, generated=310)
        version = await eng.update_weights(new.state_dict(), in_flight=True)
        running = not inflight.done()
        after = await eng.generate(p, greedy(8))  # beside the still-running old-KV row
        return before, await inflight, version, running, after

    before, mixed, version, running, after = asyncio.run(_with(no_stop_engine(served, tok), go))
    assert version == 1 and running, "the update waited for the generation to finish"
    versions = mixed.token_versions
    assert versions is not None and len(versions) == len(mixed.completion_ids) == 300
    switch = versions.index(1)
    assert 0 < switch < 300 and versions == [0] * switch + [1] * (300 - switch)
    assert mixed.weight_version == 0  # the version of its first (oldest) token
    # up to the update: exactly the old weights' tokens and logprobs
    assert mixed.completion_ids[:switch] == before.completion_ids[:switch]
    assert mixed.logprobs[:switch] == pytest.approx(before.logprobs[:switch], abs=1e-4)
    # after it: exactly what the new weights give over the old weights' KV of the earlier positions (the
    # feed of token `switch` ran under the new weights): recomputed with the old model's cache handed on
    ids = p + mixed.completion_ids
    cut = len(p) + switch - 1
    with torch.no_grad():
        cache = old(torch.tensor([ids[:cut]]), use_cache=True).past_key_values
        logits = new(torch.tensor([ids[cut:-1]]), past_key_values=cache).logits[0]
    hybrid = token_logprobs(logits, torch.tensor(mixed.completion_ids[switch:]), 0.0, 1.0)
    assert torch.allclose(hybrid, torch.tensor(mixed.logprobs[switch:]), atol=1e-5)
    # a request after the update: the new weights over its whole prompt (nothing cached or copied from old KV)
    assert after.weight_version == 1 and after.token_versions is None
    assert torch.allclose(recompute(new, p, after, 0.0), torch.tensor(after.logprobs), atol=1e-4)

    # the trainer (at the new weights) corrects by exactly behaviour -> current: weights exp(cur - behaviour)
    call = LLMCall(rollout_id="r", index=0, wire_format="openai_chat", request={}, prompt_ids=p,
                   completion_ids=mixed.completion_ids, completion_logprobs=mixed.logprobs, finish_reason="length",
                   weight_version=0, completion_text="", token_versions=versions)
    [seq] = build_sequences("r", [call], 1.0)
    mask = torch.tensor([seq.loss_mask], dtype=torch.bool)
    behaviour = torch.tensor([seq.rollout_logprobs])
    assert behaviour[mask].tolist() == pytest.approx(mixed.logprobs, abs=0)  # carried over untouched
    cur = torch.zeros_like(behaviour)
    cur[0, len(p):] = recompute(new, p, mixed, 0.0)
    corr = is_correction(cur, behaviour, mask, "tis", cap=2.0)
    direct = torch.exp(cur[mask].double() - behaviour[mask].double()).clamp(max=2.0)
    assert torch.allclose(corr.weight[mask].double(), direct, atol=1e-6)
    assert not torch.allclose(direct[switch:], torch.ones(300 - switch, dtype=torch.float64), atol=1e-3)


def test_a_draining_update_still_keeps_one_version_per_generation(tok) -> None:
    served, new = two_models(tok)
    p = prompts(tok, 1)[0]

    async def go(eng: LocalEngine):
        inflight = await decoding(eng, p, 200, generated=5)
        await eng.update_weights(new.state_dict())
        return await inflight

    res = asyncio.run(_with(no_stop_engine(served, tok), go))
    assert res.token_versions is None and res.weight_version == 0 and len(res.completion_ids) == 200


async def _with(engine, fn):
    try:
        return await fn(engine)
    finally:
        await engine.close()


def _rollout(rid: str, task: str, versions: list[list[int]], reward: float | None = 1.0) -> Rollout:
    calls = [LLMCall(rollout_id=rid, index=i, wire_format="openai_chat", request={}, prompt_ids=[1],
                     completion_ids=[5] * len(v), completion_logprobs=[-0.1] * len(v), finish_reason="stop",
                     weight_version=v[0], completion_text="", token_versions=v if len(set(v)) > 1 else None)
             for i, v in enumerate(versions)]
    return Rollout(id=rid, step=3, task_id=task, group_id="g", sample_index=0, harness="mini-swe-agent",
                   outcome=Outcome.RESOLVED if reward else Outcome.UNRESOLVED, reward=reward, calls=calls)


def test_the_staleness_filter_drops_by_the_oldest_token_and_counts_per_family() -> None:
    rollouts = [
        _rollout("fresh", "a1", [[5, 5], [5]]),
        _rollout("one", "a2", [[4, 4, 5], [5]]),  # crossed an update mid-call: its oldest token is 1 behind
        _rollout("two", "b1", [[3], [4, 4]]),  # 2 behind: dropped at max_staleness 1
        _rollout("masked", "b2", [[2]], reward=None),  # masked anyway: not counted as dropped
    ]
    kept, m = staleness_filter(rollouts, version=5, max_staleness=1, families={"a1": "x", "a2": "x", "b1": "y", "b2": "y"})
    assert [r.id for r in kept] == ["fresh", "one", "masked"]
    assert m["async/dropped"] == 1 and m["async/calls_across_update"] == 1
    assert (m["async/staleness/0"], m["async/staleness/1"], m["async/staleness/2"], m["async/staleness/3"]) == (
        1, 1, 1, 1)
    assert m["async/dropped_share/x"] == 0 and m["async/dropped_share/y"] == 0.5


def test_a_rollout_may_span_versions_only_when_asynchronous_and_only_forward() -> None:
    forward = _rollout("r", "t", [[4, 4, 5], [5, 6]]).calls
    assert "span weight versions [4, 5, 6]" in capture_problem(forward, 2)  # synchronous: one version
    assert capture_problem(forward, 2, one_version=False) == ""
    backward = _rollout("r", "t", [[5, 5], [4]]).calls
    assert "go back" in capture_problem(backward, 2, one_version=False)


def test_token_versions_survive_the_store(tmp_path) -> None:
    store = Store(tmp_path / "s.sqlite")
    r = _rollout("r", "t", [[7, 7, 8], [8]])
    for c in r.calls:
        store.add_call(c)
    got = store.calls_for("r")
    assert got[0].token_versions == [7, 7, 8] and got[1].token_versions is None
    assert got[0].versions() == [7, 7, 8] and got[1].versions() == [8]


def test_the_machines_busy_share_is_busy_over_total_ticks() -> None:
    from legorl.pipeline import machine_busy_share, machine_cpu_ticks

    assert machine_busy_share((10, 100), (40, 160)) == {"time/machine_busy_share": 0.5}
    assert machine_busy_share(None, (40, 160)) == {} and machine_busy_share((10, 100), (10, 100)) == {}
    busy, total = machine_cpu_ticks()
    assert 0 < busy < total


def test_an_async_run_samples_ahead_and_trains_within_the_staleness_bound(tmp_path, cache_dir, monkeypatch) -> None:
    import threading

    import torch

    from legorl.train.trainer import Trainer

    threads: list[tuple[str, int]] = []  # every step on the trainer's one thread (glibc keeps a freed peak per thread)
    step_fn = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self, seqs: threads.append(
        (threading.current_thread().name, torch.get_num_threads())) or step_fn(self, seqs))
    main_threads = torch.get_num_threads()
    run_dir = tmp_path / "async"
    cfg = load_config(None, [
        f"run.cache_dir={cache_dir}", "run.steps=4", "model.hidden_size=64", "model.num_layers=2",
        "model.intermediate_size=128", "sampling.max_tokens=48", "harness.step_limit=4", "tasks.n_train=8",
        "tasks.n_heldout=1", "rollout.tasks_per_step=2", "rollout.group_size=2", "rollout.concurrency=8",
        "rollout.mode=async", "rollout.max_staleness=1", "sft.enabled=false", "eval.before_training=false",
        "eval.after_training=false", "eval.every=2", "trainer.torch_threads=1",
    ])
    summary = asyncio.run(run_job(cfg, run_dir))
    assert summary["steps"] == 4
    # trainer.torch_threads holds on the trainer's thread only: the engine's and the main thread's keep theirs
    assert len(threads) == 4 and set(threads) == {("legorl-trainer_0", 1)}, threads
    assert torch.get_num_threads() == main_threads
    con = sqlite3.connect(run_dir / "store.sqlite")
    metrics = [json.loads(r[0]) for r in con.execute("SELECT metrics_json FROM steps ORDER BY step")]
    assert [m["weight_version"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:  # every trained rollout within the bound; none needed dropping
        lags = {int(k.rsplit("/", 1)[1]) for k in m if k.startswith("async/staleness/")}
        assert lags and max(lags) <= 1 and m["async/dropped"] == 0
        assert m["time/wait_s"] <= m["time/step_s"]
        assert 0 < m["time/machine_busy_share"] <= 1  # the whole machine's CPU over the step (/proc/stat)
    # steps 1..3 began sampling before the step before them had trained: some of their tokens are 1 version old
    assert any(m.get("async/staleness/1", 0) > 0 for m in metrics[1:])
    # each rollout trained at most once, and only in the step it was sampled for
    trained = con.execute("SELECT t.step, r.step FROM trained_samples t JOIN rollouts r ON r.id = t.rollout_id"
                          ).fetchall()
    assert trained and all(a == b for a, b in trained)
    ids = [r[0] for r in con.execute("SELECT rollout_id FROM trained_samples")]
    assert len(ids) == len(set(ids))
    assert con.execute("SELECT COUNT(*) FROM rollouts WHERE outcome IS NULL").fetchone()[0] == 0
    # a rollout an update reached mid-way is a whole capture, not masked (its versions only move forward)
    assert con.execute("SELECT COUNT(*) FROM rollouts WHERE outcome = 'invalid_capture'").fetchone()[0] == 0
    assert "eval/heldout/pass_at_1" in metrics[1]  # the evaluation between steps ran beside the next batch

    # the dashboard's overview: staleness per step, dropped shares per family, the trainer's wait in the time split
    charts = {c["id"]: c for c in overview(RunDB(run_dir))["charts"]}
    names = {s["name"] for s in charts["staleness"]["series"]}
    assert {"0 behind", "1 behind", "dropped"} <= names
    assert charts["dropped_by_family"]["series"] and charts["staleness"]["x"] == [0, 1, 2, 3]
    assert "waiting for rollouts" in {s["name"] for s in charts["time"]["series"]}
    # the progress file the banner reads: the lag of the last batch trained
    lag = json.loads((run_dir / "progress.json").read_text())["lag"]
    last = {int(k.rsplit("/", 1)[1]): v for k, v in metrics[-1].items() if k.startswith("async/staleness/")}
    assert lag["ahead"] == 1 and lag["max"] == max(last) and lag["dropped"] == 0
    assert lag["mean"] == sum(k * v for k, v in last.items()) / sum(last.values())


def test_requests_that_arrive_with_an_update_are_all_served(tok) -> None:
    """Requests queued while an update is applied (asynchronous RL keeps them coming) wait for the next step; none
    is lost (one was, and its harness waited for it until the agent timed out)."""
    served, new = two_models(tok)
    p = prompts(tok, 1)[0]

    async def go(eng: LocalEngine):
        long = await decoding(eng, p, 200, generated=5)
        results = []
        for version in range(1, 6):  # updates with requests queued behind them, in flight and draining
            update = asyncio.create_task(eng.update_weights(new.state_dict(), in_flight=version % 2 == 1))
            burst = [asyncio.create_task(eng.generate(p, greedy(4))) for _ in range(6)]
            results += await asyncio.wait_for(asyncio.gather(update, *burst), timeout=120)
        return results, await long

    results, _ = asyncio.run(_with(no_stop_engine(served, tok), go))
    assert len(results) == 5 * 7  # every update and every request came back
