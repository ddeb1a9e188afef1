"""Loggers: the same step metrics reach TensorBoard, W&B (offline) and MLflow (file store), read back from disk.

Each backend is an optional dependency (`pip install legorl[loggers]`): its round-trip test is skipped,
saying so, where the package is not installed; the missing-package message is tested everywhere.
"""

from __future__ import annotations

import builtins
import importlib.util
from pathlib import Path

import pytest

from legorl.monitor.loggers import LoggerUnavailable, make_loggers

METRICS = [{"reward/mean": 0.25, "pass_rate": 0.5, "train/loss": 1.5, "note": "text is skipped",
            "train/bad": float("nan")},
           {"reward/mean": 0.75, "pass_rate": 1.0, "train/loss": 0.5}]
CONFIG = {"run": {"name": "unit"}, "trainer": {"lr": 1e-4}}


def needs(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install 'legorl[loggers]')")


def log_two_steps(names: list[str], run_dir: Path) -> None:
    logger = make_loggers(names, run_dir, CONFIG)
    for step, m in enumerate(METRICS):
        logger.log(step, m)
    logger.close()


def test_unknown_logger_is_named() -> None:
    with pytest.raises(LoggerUnavailable, match="unknown logger.*'tensorbored'.*choose from"):
        make_loggers(["tensorbored"], "/tmp/unused")


def test_empty_list_logs_nowhere(tmp_path: Path) -> None:
    logger = make_loggers([], tmp_path)
    logger.log(0, {"x": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name,package", [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")])
def test_missing_package_message(name: str, package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_such_package(mod: str, *args: object, **kwargs: object) -> object:
        if mod == package or mod.startswith(package + "."):
            raise ModuleNotFoundError(f"No module named '{package}'")
        return real_import(mod, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_such_package)
    monkeypatch.setattr(importlib, "import_module", lambda mod: no_such_package(mod))
    with pytest.raises(LoggerUnavailable, match=rf"'{name}' needs the {package} package.*pip install 'legorl\[loggers\]'"):
        make_loggers([name], tmp_path)


@needs("tensorboard")
def test_tensorboard_round_trip(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_two_steps(["tensorboard"], tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"reward/mean", "pass_rate", "train/loss"} <= set(acc.Tags()["scalars"])
    assert "train/bad" not in acc.Tags()["scalars"]
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0.25), (1, 0.75)]


@needs("wandb")
def test_wandb_offline_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    log_two_steps(["wandb"], tmp_path)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (record,) = runs[0].glob("*.wandb")  # the offline run log `wandb sync` uploads: protobuf records
    data = record.read_bytes()
    assert b"reward/mean" in data and b"train/loss" in data and b"0.75" in data
    assert b"train/bad" not in data and b"text is skipped" not in data


@needs("mlflow")
def test_mlflow_file_store_round_trip(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    log_two_steps(["mlflow"], tmp_path)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("legorl")
    (run,) = client.search_runs([exp.experiment_id])
    hist = client.get_metric_history(run.info.run_id, "reward/mean")
    assert sorted((m.step, m.value) for m in hist) == [(0, 0.25), (1, 0.75)]
    assert run.data.params["trainer.lr"] == "0.0001"
    assert run.info.status == "FINISHED"


@needs("tensorboard")
def test_several_loggers_at_once(tmp_path: Path) -> None:
    names = ["tensorboard"] + [n for n in ("mlflow",) if importlib.util.find_spec(n)]
    log_two_steps(names, tmp_path)
    assert (tmp_path / "tensorboard").is_dir()
