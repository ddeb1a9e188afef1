"""Step metrics to TensorBoard, Weights & Biases (offline) and MLflow (file store).

    logger = make_loggers(["tensorboard", "wandb"], run_dir, config_dict)
    logger.log(step, metrics)      # every step
    logger.close()                 # at the end of the run

Each backend is an optional dependency (`pip install legorl[loggers]`); asking for
one that is not installed fails at start with a message naming the package.
Files go under the run directory: tensorboard/, wandb/, mlruns/.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

INSTALL_HINT = "pip install 'legorl[loggers]'"


class LoggerUnavailable(RuntimeError):
    """A requested logger backend's package is not installed (or the name is unknown)."""


class Logger(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Finite numbers only (bools count); everything else is skipped."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[str(k)] = float(v)
    return out


def _require(module: str, package: str, name: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise LoggerUnavailable(f"logger '{name}' needs the {package} package, which is not installed "
                                f"({e}). Install it with: {INSTALL_HINT} (or pip install {package})") from None


class TensorBoardLogger:
    def __init__(self, run_dir: Path, config: Mapping[str, Any]):
        _require("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.dir))
        if config:
            self.writer.add_text("config", "```\n" + json.dumps(dict(config), indent=2, default=str) + "\n```", 0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for k, v in _scalars(metrics).items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """W&B in offline mode: files under RUN_DIR/wandb, `wandb sync` uploads them later."""

    def __init__(self, run_dir: Path, config: Mapping[str, Any]):
        wandb = _require("wandb", "wandb", "wandb")
        os.environ.setdefault("WANDB_SILENT", "true")
        name = str(config.get("run", {}).get("name", run_dir.name)) if isinstance(config.get("run"), dict) \
            else run_dir.name
        self.run = wandb.init(mode="offline", dir=str(run_dir), project="legorl", name=name,
                              config=dict(config), reinit=True)
        self.dir = Path(self.run.dir).parent

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # waits until the service has written the offline run file


class MlflowLogger:
    """MLflow, by default with a local file store in RUN_DIR/mlruns (`mlflow ui --backend-store-uri file:...`).

    MLFLOW_TRACKING_URI, when set, wins (e.g. sqlite:///mlflow.db or a tracking server). MLflow 3 keeps the
    file store in maintenance mode behind MLFLOW_ALLOW_FILE_STORE, which is set here for that default.
    """

    def __init__(self, run_dir: Path, config: Mapping[str, Any]):
        _require("mlflow", "mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.dir = run_dir / "mlruns"
        uri = os.environ.get("MLFLOW_TRACKING_URI") or self.dir.resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name("legorl")
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment("legorl")
        self.run_id = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        flat = _flatten(config)
        for k, v in list(flat.items())[:500]:
            self.client.log_param(self.run_id, k[:250], str(v)[:500])

    def log(self, step: int, metrics: Mapping[str, float]) -> None:

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key=_mlflow_key(k), value=v, timestamp=now, step=step) for k, v in _scalars(metrics).items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(k: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "_-./ " else "_" for ch in k)


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


BACKENDS: dict[str, type] = {"tensorboard": TensorBoardLogger, "wandb": WandbLogger, "mlflow": MlflowLogger}


class MultiLogger:
    """Fans one step's metrics out to every configured backend."""

    def __init__(self, loggers: list[Any]):
        self.loggers = loggers

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for lg in self.loggers:
            lg.log(step, metrics)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def make_loggers(names: list[str], run_dir: str | Path, config: Mapping[str, Any] | None = None) -> MultiLogger:
    """Start the named loggers (any of tensorboard, wandb, mlflow); an empty list logs nowhere."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise LoggerUnavailable(f"unknown logger(s) {unknown}: choose from {sorted(BACKENDS)}")
    started: list[Any] = []
    try:
        for n in dict.fromkeys(names):
            started.append(BACKENDS[n](run_dir, dict(config or {})))
    except Exception:
        for lg in started:
            lg.close()
        raise
    return MultiLogger(started)
