"""Monitoring settings: the `monitor:` section of the run config (extra keys are errors).

    monitor:
      dashboard: true            # serve the dashboard from the training driver
      host: 127.0.0.1            # a non-loopback host needs a token
      port: 0                    # 0 = pick a free port
      token: null
      loggers: [tensorboard]     # tensorboard | wandb | mlflow
      alarms: {kl_rise_factor: 3.0, infra_failure_max: 0.1}

The classes live in legorl/config.py with every other setting (configuration is the ground floor
that every part reads); this module names them where the monitor's readers look for them.
"""

from __future__ import annotations

from legorl.config import INFRA_OUTCOMES, AlarmConfig, MonitorConfig

__all__ = ["INFRA_OUTCOMES", "AlarmConfig", "MonitorConfig"]
