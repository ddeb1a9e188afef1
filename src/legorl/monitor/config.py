"""Monitoring settings: a `monitor:` section the run config can embed (extra keys are errors).

    monitor:
      dashboard: true            # serve the dashboard from the training driver
      host: 127.0.0.1            # a non-loopback host needs a token
      port: 0                    # 0 = pick a free port
      token: null
      loggers: [tensorboard]     # tensorboard | wandb | mlflow
      alarms: {kl_rise_factor: 3.0, infra_failure_max: 0.1}
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

INFRA_OUTCOMES = ("agent_crash", "agent_timeout", "no_model_calls", "sandbox_error", "engine_error", "grader_error",
                  "invalid_capture")


class AlarmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kl_metric: str = "train/mismatch_k3_kl"
    kl_window: int = Field(4, ge=1)  # steps compared: the last window against the one before
    kl_rise_factor: float = Field(2.0, gt=1.0)  # alarm when the mean KL grew by this factor...
    kl_min: float = Field(1e-3, ge=0.0)  # ...and is above this floor (below it, rises are numerical noise)
    tool_metric: str = "behaviour/tool_calls_per_turn"
    tool_window: int = Field(3, ge=1)
    tool_drop_fraction: float = Field(0.5, gt=0.0, lt=1.0)  # recent mean below this fraction of the earlier peak
    tool_min_baseline: float = Field(0.2, ge=0.0)  # only once the agent did call tools at this rate
    zero_variance_max: float = Field(0.5, ge=0.0, le=1.0)  # share of groups whose rewards are all equal
    infra_failure_max: float = Field(0.2, ge=0.0, le=1.0)  # share of rollouts with an infrastructure outcome
    infra_outcomes: list[str] = Field(default_factory=lambda: list(INFRA_OUTCOMES))
    min_rollouts: int = Field(1, ge=1)  # steps with fewer finished rollouts are not judged


class MonitorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dashboard: bool = True
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    token: str | None = None
    loggers: list[str] = Field(default_factory=list)
    alarms: AlarmConfig = Field(default_factory=AlarmConfig)
