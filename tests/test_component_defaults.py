"""One default per setting: components built from their config sections carry exactly the YAML's
settings, and a component built from Python with no arguments equals one built from `Config()`."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import pydantic
import pytest
import yaml
from helpers import tiny_qwen3

from legorl.config import Config, EngineConfig, load_config
from legorl.engine.cli import serve_command
from legorl.engine.local import LocalEngine
from legorl.models import ModelSpec
from legorl.pipeline import make_trainer
from legorl.rollout.scheduler import GroupRunner
from legorl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def trainer_settings(tr: Trainer) -> dict:
    """Everything a Trainer's updates depend on, apart from the model."""
    group = tr.optimizer.param_groups[0]
    return {
        "config": tr.config.model_dump(),
        "optimizer": {k: group[k] for k in ("lr", "betas", "weight_decay", "eps")},
        "schedule": tr.schedule.to_dict(),
        "sampling": (tr.temperature, tr.top_p, tr.top_k),
        **{k: getattr(tr, k) for k in ("base_lr", "max_grad_norm", "clip_low", "clip_high", "tis_cap", "is_mode",
                                       "token_mask", "seq_mask", "kl_coef", "entropy_coef", "ppo_epochs",
                                       "mini_batches", "routing_replay", "micro_batch_tokens", "loss_agg",
                                       "autocast_dtype", "shared_prefix", "pad_id")},
        "reference_model": tr.ref_model is not None,
    }


def yaml_twin(cfg: Config, tmp_path: Path) -> Config:
    """`cfg` written to a YAML file and loaded back the way `legorl train --config` loads it."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    return load_config(path)


def test_trainer_python_defaults_are_the_config_defaults() -> None:
    cfg = Config()
    bare = Trainer(tiny_qwen3())
    sections = Trainer(tiny_qwen3(), cfg.trainer, sampling=cfg.sampling)
    assert trainer_settings(bare) == trainer_settings(sections)
    assert bare.config == cfg.trainer and bare.base_lr == cfg.trainer.lr == 1e-4


def test_trainer_from_default_config_and_from_its_yaml(tmp_path: Path) -> None:
    cfg = Config()
    twin = yaml_twin(cfg, tmp_path)
    from_python, from_yaml = make_trainer(cfg, tiny_qwen3(), 0), make_trainer(twin, tiny_qwen3(), 0)
    assert trainer_settings(from_python) == trainer_settings(from_yaml)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_run_trainer_carries_exactly_the_yaml_settings(path: Path) -> None:
    cfg = load_config(path)
    tr = make_trainer(cfg, tiny_qwen3(), pad_id=0)
    assert tr.config == cfg.trainer
    settings = trainer_settings(tr)
    assert settings["optimizer"]["lr"] == settings["base_lr"] == cfg.trainer.lr
    assert settings["optimizer"]["weight_decay"] == cfg.trainer.weight_decay
    assert settings["sampling"] == (cfg.sampling.temperature or 1.0, cfg.sampling.top_p, cfg.sampling.top_k)
    assert settings["schedule"] == {"kind": cfg.trainer.lr_schedule, "warmup_steps": cfg.trainer.warmup_steps,
                                    "total_steps": cfg.run.steps, "min_lr_ratio": cfg.trainer.min_lr_ratio}
    for key in ("max_grad_norm", "clip_low", "clip_high", "tis_cap", "is_mode", "token_mask", "seq_mask", "kl_coef",
                "entropy_coef", "ppo_epochs", "mini_batches", "routing_replay", "micro_batch_tokens", "loss_agg"):
        assert settings[key] == getattr(cfg.trainer, key), key


def test_demo_trainer_settings() -> None:
    """The demo's trainer as its learning was measured (BENCHMARKS.md): configs/demo.yaml's values."""
    tr = make_trainer(load_config(ROOT / "configs/demo.yaml"), tiny_qwen3(), pad_id=0)
    s = trainer_settings(tr)
    assert s["optimizer"] == {"lr": 3e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, "eps": 1e-8}
    assert s["schedule"] == {"kind": "constant", "warmup_steps": 0, "total_steps": 24, "min_lr_ratio": 0.0}
    assert s["sampling"] == (1.0, 1.0, 0)
    assert (s["loss_agg"], s["max_grad_norm"], s["clip_low"], s["clip_high"], s["tis_cap"], s["is_mode"]) == (
        "seq-mean-token-mean", 1.0, 0.2, 0.28, 2.0, "tis")
    assert (s["ppo_epochs"], s["mini_batches"], s["micro_batch_tokens"], s["kl_coef"], s["entropy_coef"]) == (
        1, 1, 4096, 0.1, 0.0)
    assert s["shared_prefix"] and s["routing_replay"] == "off" and s["reference_model"]


def test_trainer_keywords_are_validated_settings() -> None:
    tr = Trainer(tiny_qwen3(), lr=1e-3, temperature=0.7, loss_agg="rollout-mean", max_grad_norm=None)
    assert (tr.base_lr, tr.temperature, tr.loss_agg, tr.max_grad_norm) == (1e-3, 0.7, "rollout-mean", None)
    with pytest.raises(TypeError, match="lrr"):
        Trainer(tiny_qwen3(), lrr=1e-3)
    with pytest.raises(pydantic.ValidationError, match="ppo_epochs"):
        Trainer(tiny_qwen3(), ppo_epochs=0)
    assert Trainer(tiny_qwen3(), temperature=0.0).temperature == 1.0  # greedy sampling: scored at 1


def test_model_spec_defaults_are_the_model_section(tmp_path: Path) -> None:
    assert ModelSpec.from_config(Config().model) == ModelSpec()
    assert ModelSpec.from_config(yaml_twin(Config(), tmp_path).model) == ModelSpec()
    demo = load_config(ROOT / "configs/demo.yaml").model
    spec = ModelSpec.from_config(demo)
    assert all(getattr(spec, k) == v for k, v in demo.model_dump().items())


def engine_settings(engine: LocalEngine) -> tuple[int, int]:
    return engine.max_batch, engine.prefix.max_bytes


def test_local_engine_from_default_config_and_from_its_yaml(tokenizer, tmp_path: Path) -> None:
    async def build() -> list[tuple[int, int]]:
        out = []
        for engine in (LocalEngine(tiny_qwen3(), tokenizer), LocalEngine(tiny_qwen3(), tokenizer, Config().engine),
                       LocalEngine(tiny_qwen3(), tokenizer, yaml_twin(Config(), tmp_path).engine)):
            out.append(engine_settings(engine))
            await engine.close()
        return out

    bare, from_config, from_yaml = asyncio.run(build())
    assert bare == from_config == from_yaml == (EngineConfig().max_batch, int(EngineConfig().prefix_cache_mb * 2**20))


def test_serve_command_defaults_are_the_engine_section() -> None:
    params = inspect.signature(serve_command).parameters
    e = EngineConfig()
    assert (params["max_batch"].default, params["prefix_cache_mb"].default, params["threads"].default,
            params["split_steps"].default) == (e.max_batch, e.prefix_cache_mb, e.torch_threads, e.split_steps)


def test_split_steps_setting_reaches_the_decoder(tokenizer) -> None:
    async def build() -> list[bool]:
        out = []
        for cfg in (EngineConfig(), EngineConfig(split_steps=True)):
            engine = LocalEngine(tiny_qwen3(), tokenizer, cfg)
            out.append(engine.decoder._pool is not None)
            await engine.close()
        return out

    assert asyncio.run(build()) == [False, True]


def runner_settings(runner: GroupRunner) -> tuple[int, int, float]:
    return runner.sem._value, runner.max_retries, runner.backoff


async def _episode(*args: object, **kwargs: object) -> None:  # never run
    raise AssertionError


def test_group_runner_from_default_config_and_from_its_yaml(tmp_path: Path) -> None:
    r = Config().rollout
    bare = runner_settings(GroupRunner(_episode, {}))
    assert bare == runner_settings(GroupRunner(_episode, {}, r))
    assert bare == runner_settings(GroupRunner(_episode, {}, yaml_twin(Config(), tmp_path).rollout))
    assert bare == (r.concurrency, r.max_retries, r.retry_backoff)
    assert runner_settings(GroupRunner(_episode, {}, r, concurrency=8)) == (8, r.max_retries, r.retry_backoff)
