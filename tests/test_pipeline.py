"""The whole job at toy size: teacher demos -> SFT -> eval -> RL step -> eval, every stage recorded."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from legorl.config import load_config
from legorl.models import ModelSpec, load_model, load_or_build, load_tokenizer
from legorl.models.chat_template import chat_template
from legorl.pipeline import run_job
from legorl.store import Store


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory, cache_dir):
    run_dir = tmp_path_factory.mktemp("toy-run")
    cfg = load_config(None, [
        f"run.cache_dir={cache_dir}", "run.steps=1", "model.hidden_size=64", "model.num_layers=2",
        "model.intermediate_size=128", "sampling.max_tokens=48", "harness.step_limit=4",
        "tasks.n_train=2", "tasks.n_heldout=1", "rollout.tasks_per_step=1", "rollout.group_size=2",
        "sft.enabled=true", "sft.demos=2", "sft.epochs=1.5", "sft.batch_sequences=1", "sft.lr_schedule=cosine",
        "eval.before_training=true", "rollout.prioritize=true", "sft.check_edits=true", "sft.recovery_demos=1.0",
        "eval.after_training=true", "monitor.loggers=[tensorboard,mlflow]",
        # RL's cap is not SFT's (test_sft_clips_at_its_own_cap_not_rls); it holds this run's RL updates near zero,
        # which no test of this run measures
        "trainer.max_grad_norm=1e-9", "sft.max_grad_norm=null",
    ])
    summary = asyncio.run(run_job(cfg, run_dir))
    return run_dir, summary


def test_every_stage_produced_records(toy_run):
    run_dir, _ = toy_run
    on_disk = json.loads((run_dir / "summary.json").read_text())
    assert on_disk["steps"] == 1 and on_disk["wall_time_s"] > 0
    phases = on_disk["phase_times_s"]  # where the wall time went
    assert list(phases) == ["demonstrations", "sft", "eval_before_rl", "rl", "eval_after_rl"]
    assert all(t > 0 for t in phases.values()) and sum(phases.values()) <= on_disk["wall_time_s"]
    assert on_disk["sft"]["sft/demos_resolved"] == 2  # the teacher solved both through mini-swe-agent
    # 1.5 epochs of 2 sequences in batches of 1 are 3 updates; cosine over them, the last at 1/4 of the lr
    assert on_disk["sft"]["sft/slips"] == 2  # the slipped turns were left out of the loss
    assert on_disk["sft"]["sft/sequences"] == 2 and on_disk["sft"]["sft/updates"] == 3
    assert on_disk["sft"]["sft/last_lr"] == pytest.approx(0.25e-3)
    assert on_disk["heldout_pass_at_1_before_rl"] is not None
    assert on_disk["heldout_pass_at_1_after_rl"] is not None
    # why the held-out rollouts failed: one kind each, the shares summing to 1
    kinds = {k: v for k, v in on_disk["after_rl"].items() if k.startswith("eval/heldout/failures/")}
    assert len(kinds) == 7 and sum(kinds.values()) == pytest.approx(1.0)
    assert kinds["eval/heldout/failures/resolved"] == pytest.approx(on_disk["heldout_pass_at_1_after_rl"])
    # the output's reasoning share and tool-call share over the held-out cohort, and how much of it was covered
    after = on_disk["after_rl"]
    assert after["eval/heldout/mini-swe-agent/behaviour/reasoning_share"] == 0.0  # the tiny model has no markers
    assert 0 <= after["eval/heldout/mini-swe-agent/behaviour/tool_call_share"] <= 1
    assert after["eval/heldout/cohort_coverage"] == 1.0

    store = Store(run_dir / "store.sqlite")
    splits = {r.split for r in store.rollouts()}
    assert {"demo", "train", "eval-heldout"} <= splits
    for demo in store.rollouts(split="demo"):  # both toy tasks slip: edit backwards, see no change, fix
        texts = [c.completion_text for c in store.calls_for(demo.id)]
        assert len(texts) == 4 and texts[2].startswith("That changed nothing") and "git diff --stat" in texts[1]
    train = store.rollouts(split="train")
    assert len(train) == 2 and all(r.outcome is not None for r in train)
    assert store.last_step() == 0

    tok = load_tokenizer(run_dir / "tokenizer")
    report = store.report(decode=lambda ids: tok.decode(ids, skip_special_tokens=False))
    assert report["steps"] == 1 and report["llm_calls"] > 0
    assert report["fidelity"]["violations"] == 0
    assert "train/logprob_pearson" in report["last_step"]


def test_rl_starts_with_sft_second_moments_and_a_fresh_first_moment(toy_run):
    run_dir, _ = toy_run
    state = torch.load(run_dir / "checkpoints" / "sft" / "trainer_state.pt", weights_only=True)
    moments = list(state["optimizer"]["state"].values())
    assert moments, "the SFT checkpoint kept no optimizer state"
    assert all(float(m["exp_avg"].abs().sum()) == 0.0 for m in moments)
    assert sum(float(m["exp_avg_sq"].sum()) for m in moments) > 0.0


def test_sft_clips_at_its_own_cap_not_rls(toy_run):
    """trainer.max_grad_norm 1e-9 is RL's: had SFT clipped at it, Adam's eps would have held every update near 0."""
    run_dir, _ = toy_run
    cfg = load_config(run_dir / "config.json")
    init, _ = load_or_build(None, ModelSpec.from_config(cfg.model), Path(cfg.run.cache_dir).expanduser())
    sft, _ = load_model(run_dir / "checkpoints" / "sft")
    before, after = init.state_dict(), sft.state_dict()
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4  # 3 Adam updates at lr 1e-3; clipped at 1e-9 they moved 2e-5 at most


def test_every_checkpoint_is_a_model_directory(toy_run):
    run_dir, _ = toy_run
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "latest")
    assert model.config.model_type == "qwen3"
    # The warm start and each step's checkpoint load with their tokenizer (`legorl eval --model DIR`).
    for name in ("sft", "step-00000", "latest"):
        _, tok = load_model(run_dir / "checkpoints" / name)
        assert tok.decode(tok.encode("def f(x):")) == "def f(x):", name


def test_report_and_export_cli(toy_run):
    import subprocess
    import sys

    run_dir, _ = toy_run
    out = subprocess.run([sys.executable, "-m", "legorl.cli", "report", str(run_dir), "--json"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    rep = json.loads(out)
    assert rep["steps"] == 1 and rep["fidelity"]["violations"] == 0 and rep["rollouts"]["total"] > 0
    subprocess.run([sys.executable, "-m", "legorl.cli", "export", str(run_dir), "--format", "jsonl"],
                   check=True, timeout=120, capture_output=True)
    lines = (run_dir / "calls.jsonl").read_text().splitlines()
    assert len(lines) == rep["llm_calls"]
    first = json.loads(lines[0])
    assert len(first["completion_ids"]) == len(first["completion_logprobs"])


def test_a_finished_run_continues_to_more_steps(toy_run, tmp_path):
    """`legorl train --resume COPY run.steps=N` extends a finished run: no new demos or SFT, the
    before-RL evaluation kept, RL resumed after its last step, and the after-RL evaluation redone."""
    run_dir, summary = toy_run
    copy = tmp_path / "continued"
    shutil.copytree(run_dir, copy)
    # as a run started before model.tools_first, when the built-in template wrote the tools first: its config
    # says nothing of the layout, its saved tokenizer keeps the one it trained with
    started = load_tokenizer(copy / "tokenizer")
    started.chat_template = chat_template(tools_first=True)
    started.save_pretrained(copy / "tokenizer")
    cfg = load_config(copy / "config.json", ["run.steps=3", "eval.every=1"])
    assert not cfg.model.tools_first
    continued = asyncio.run(run_job(cfg, copy, resume=True))
    for kept in (copy / "tokenizer", copy / "checkpoints" / "latest", copy / "checkpoints" / "step-00002"):
        assert load_tokenizer(kept).chat_template == chat_template(tools_first=True), kept  # one layout a run

    assert continued["steps"] == 3
    assert continued["sft"] == summary["sft"] and continued["before_rl"] == summary["before_rl"]
    assert continued["heldout_pass_at_1_after_rl"] is not None
    store = Store(copy / "store.sqlite")
    assert store.last_step() == 2
    assert len(store.rollouts(split="demo")) == 2  # the teacher was not run again
    eval_steps = {r.step for r in store.rollouts(split="eval-heldout")}
    assert eval_steps == {-1, 1, 3}  # before RL, after the first run's step and after step 1 again, at the end
    # every evaluation reached TensorBoard at the count of RL updates it measured, keys as in summary.json
    assert _tensorboard(copy, "eval/heldout/pass_at_1") == [0, 1, 2, 3]
    assert set(continued["after_rl"]) <= set(_tensorboard_tags(copy))


def _tensorboard_tags(run_dir) -> list[str]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer().AddRunsFromDirectory(str(run_dir / "tensorboard"))
    mux.Reload()
    return sorted({t for run in mux.Runs().values() for t in run["scalars"]})


def _tensorboard(run_dir, tag: str) -> list[int]:
    """The steps at which ``tag`` was logged, over every event file of the run (a resumed run adds one)."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer().AddRunsFromDirectory(str(run_dir / "tensorboard"))
    mux.Reload()
    return sorted(e.step for run, tags in mux.Runs().items() if tag in tags["scalars"] for e in mux.Scalars(run, tag))


def test_every_evaluation_reaches_the_loggers(toy_run):
    """Before RL at 0 and after RL at run.steps, in TensorBoard and MLflow, with summary.json's keys."""
    from mlflow.tracking import MlflowClient

    run_dir, summary = toy_run
    assert _tensorboard(run_dir, "eval/heldout/pass_at_1") == [0, 1]
    assert set(summary["before_rl"]) <= set(_tensorboard_tags(run_dir))
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("legorl").experiment_id])
    history = client.get_metric_history(run.info.run_id, "eval/heldout/pass_at_1")
    assert sorted((m.step, m.value) for m in history) == [(0, summary["before_rl"]["eval/heldout/pass_at_1"]),
                                                          (1, summary["after_rl"]["eval/heldout/pass_at_1"])]
