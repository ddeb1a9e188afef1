"""Alarms: the run is going wrong in a way a person should look at now.

- `mismatch_kl_rising`: the sampler/trainer mismatch (k3 KL) grew over a window of steps.
- `tool_calls_collapsing`: the agent stopped calling tools (it started writing prose).
- `grad_norm_spike`: a step's gradient norm is many times the recent median (an outsized update: the
  step before a policy collapses into repeated-token junk).
- `zero_variance_groups`: too many groups without learning signal (every advantage zero: equal
  rewards for the baseline methods, all failed for reinforce).
- `infra_failures`: too many rollouts ended in an infrastructure outcome.
- `nothing_trained`: a step ended with no trainable sequence (every rollout masked or without signal).

`evaluate(series, cfg)` judges every step of a run (the dashboard shows the history);
`AlarmMonitor.update(step, metrics, rollouts)` is for the training driver: it logs
and records (RUN_DIR/alarms.jsonl) each alarm the new step fires.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from legorl.monitor.config import AlarmConfig
from legorl.records import Rollout
from legorl.train.advantages import carries_signal

log = logging.getLogger("legorl.alarms")

# The share of the trained batch's groups that carry no signal: the loop logs the value its alarm judged, and the
# dashboard reads it (the store also holds groups a refill replaced, which the batch never trained on).
ZERO_VARIANCE = "groups/no_signal_share"
# derived series names
INFRA_SHARE = "infra_share"
FINISHED = "finished_rollouts"
NOTHING_TRAINED = "train/skipped"  # 1.0 on a step whose trainer had nothing to learn from
HINTS = {  # what to look at when one outcome took every rollout of a step
    "context_overflow": "prompts exceed the model's context: shorten the harness prompt (harness.system_prompt, "
                        "harness.tools) or raise model.max_position_embeddings",
    "no_model_calls": "the harness exited before calling the model: see the rollouts' outcome reasons",
    "agent_crash": "the harness failed: see the rollouts' outcome reasons and the harness logs",
}


@dataclass
class Alarm:
    name: str
    step: int
    value: float
    threshold: float
    message: str
    severity: str = "warning"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Series:
    """Per-step values, aligned: steps[i] has values[name][i] (None where unknown)."""

    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float | None]] = field(default_factory=dict)

    def add(self, step: int, metrics: dict[str, float | None]) -> None:
        n = len(self.steps)
        self.steps.append(step)
        for k, v in metrics.items():
            self.values.setdefault(k, [None] * n)
        for k, col in self.values.items():
            v = metrics.get(k)
            col.append(None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v))

    def get(self, name: str) -> list[float | None]:
        return self.values.get(name, [None] * len(self.steps))


def infra_share(outcomes: dict[str, float], cfg: AlarmConfig) -> tuple[float | None, float]:
    """(share of infrastructure outcomes, finished rollouts) from `outcomes/<name>` counts."""
    total = sum(outcomes.values())
    if total <= 0:
        return None, 0.0
    return sum(outcomes.get(o, 0.0) for o in cfg.infra_outcomes) / total, total


def zero_variance_share(rollouts: Iterable[Rollout], advantage: str = "grpo") -> float | None:
    """Share of groups (with 2+ rewarded members) that train nothing under the advantage method."""
    groups: dict[str, list[float]] = {}
    for r in rollouts:
        if r.reward is not None:
            groups.setdefault(r.group_id, []).append(r.reward)
    judged = [g for g in groups.values() if len(g) >= 2]
    if not judged:
        return None
    return sum(not carries_signal(g, advantage) for g in judged) / len(judged)


def derived(metrics: dict[str, float], cfg: AlarmConfig) -> dict[str, float | None]:
    """The series the alarms read, from one step's logged metrics."""
    outcomes = {k.split("/", 1)[1]: float(v) for k, v in metrics.items()
                if k.startswith("outcomes/") and isinstance(v, (int, float))}
    share, total = infra_share(outcomes, cfg)
    out: dict[str, float | None] = {INFRA_SHARE: share, FINISHED: total}
    out.update({f"outcomes/{o}": n for o, n in outcomes.items()})
    for k in (cfg.kl_metric, cfg.tool_metric, cfg.grad_metric, ZERO_VARIANCE, NOTHING_TRAINED):
        if k in metrics:
            out[k] = metrics[k]
    return out


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def _kl(series: Series, cfg: AlarmConfig) -> list[Alarm]:
    out = []
    v = series.get(cfg.kl_metric)
    w = cfg.kl_window
    for i in range(w, len(v)):
        recent, before = _mean(v[i - w + 1:i + 1]), _mean(v[max(0, i - 2 * w + 1):i - w + 1])
        if recent is None or before is None or recent < cfg.kl_min:
            continue
        ratio = recent / max(before, 1e-12)
        if ratio >= cfg.kl_rise_factor:
            out.append(Alarm("mismatch_kl_rising", series.steps[i], recent, cfg.kl_rise_factor,
                             f"{cfg.kl_metric} mean over the last {w} steps is {recent:.3g}, {ratio:.1f}x the "
                             f"{w} steps before ({before:.3g}): sampler and trainer disagree more and more "
                             "(check weight sync, routing replay, precision)", "critical"))
    return out


def _tools(series: Series, cfg: AlarmConfig) -> list[Alarm]:
    out = []
    v = series.get(cfg.tool_metric)
    w = cfg.tool_window
    peak: float | None = None
    for i in range(len(v)):
        if i >= w and (m := _mean(v[i - w:i])) is not None:  # rolling means strictly before the window
            peak = m if peak is None else max(peak, m)
        recent = _mean(v[max(0, i - w + 1):i + 1])
        if i < w or peak is None or recent is None or peak < cfg.tool_min_baseline:
            continue
        if recent < cfg.tool_drop_fraction * peak:
            out.append(Alarm("tool_calls_collapsing", series.steps[i], recent, cfg.tool_drop_fraction * peak,
                             f"{cfg.tool_metric} fell to {recent:.2f} (mean of the last {w} steps) from a peak "
                             f"of {peak:.2f}: the agent is answering in prose instead of acting", "critical"))
    return out


def _grad_spike(series: Series, cfg: AlarmConfig) -> list[Alarm]:
    out = []
    v = series.get(cfg.grad_metric)
    w = cfg.grad_window
    for i in range(w, len(v)):
        before = v[i - w:i]
        if v[i] is None or None in before:  # a full window of known values, so one missing step is no baseline
            continue
        median = statistics.median(before)
        if median > 0 and v[i] > cfg.grad_spike_factor * median:
            out.append(Alarm("grad_norm_spike", series.steps[i], v[i], cfg.grad_spike_factor * median,
                             f"{cfg.grad_metric} is {v[i]:.3g}, {v[i] / median:.1f}x the median of the {w} steps "
                             f"before ({median:.3g}): an outsized update, which can collapse a small policy into "
                             "repeated-token junk; look at the step's rollouts, and cap the update with "
                             "trainer.max_grad_norm at a few times that median"))
    return out


def _nothing_trained(series: Series) -> list[Alarm]:
    out = []
    for i, skipped in enumerate(series.get(NOTHING_TRAINED)):
        if not skipped:
            continue
        counts = {k.split("/", 1)[1]: col[i] for k, col in series.values.items() if k.startswith("outcomes/")}
        counts = {o: int(n) for o, n in counts.items() if n}
        top = max(counts, key=counts.get) if counts else ""
        seen = ", ".join(f"{o}={n}" for o, n in sorted(counts.items())) or "no finished rollout"
        hint = HINTS.get(top, "every rollout was masked or its group carried no learning signal")
        out.append(Alarm("nothing_trained", series.steps[i], 1.0, 0.0,
                         f"step {series.steps[i]} trained nothing ({seen}): {hint}", "critical"))
    return out


def _threshold(series: Series, name: str, metric: str, limit: float, cfg: AlarmConfig, what: str) -> list[Alarm]:
    out = []
    finished = series.get(FINISHED)
    for i, value in enumerate(series.get(metric)):
        if value is None or value <= limit:
            continue
        n = finished[i]
        if n is not None and n < cfg.min_rollouts:
            continue
        out.append(Alarm(name, series.steps[i], value, limit, f"{value:.0%} {what} (threshold {limit:.0%})"))
    return out


def evaluate(series: Series, cfg: AlarmConfig | None = None) -> list[Alarm]:
    """Every alarm at every step of the series, in step order."""
    cfg = cfg or AlarmConfig()
    alarms = _kl(series, cfg) + _tools(series, cfg) + _grad_spike(series, cfg) + _nothing_trained(series)
    alarms += _threshold(series, "zero_variance_groups", ZERO_VARIANCE, cfg.zero_variance_max, cfg,
                         "of groups carry no learning signal (every advantage zero)")
    alarms += _threshold(series, "infra_failures", INFRA_SHARE, cfg.infra_failure_max, cfg,
                         "of rollouts ended in an infrastructure failure (" + ", ".join(cfg.infra_outcomes) + ")")
    return sorted(alarms, key=lambda a: (a.step, a.name))


class AlarmMonitor:
    """For the training driver: feed each step, get (and log) the alarms that step fires."""

    def __init__(self, cfg: AlarmConfig | None = None, run_dir: str | Path | None = None,
                 logger: logging.Logger | None = None, advantage: str = "grpo"):
        self.cfg = cfg or AlarmConfig()
        self.advantage = advantage  # what counts as a group without signal
        self.path = Path(run_dir) / "alarms.jsonl" if run_dir is not None else None
        self.log = logger or log
        self.series = Series()
        self.fired: list[Alarm] = []

    def update(self, step: int, metrics: dict[str, float], rollouts: list[Rollout] | None = None) -> list[Alarm]:
        values = derived(metrics, self.cfg)
        if rollouts is not None:
            values[ZERO_VARIANCE] = zero_variance_share((r for r in rollouts if r.split == "train"), self.advantage)
            if self.cfg.tool_metric not in values and self.cfg.tool_metric.startswith("behaviour/"):
                from legorl.monitor.behaviour import step_metrics

                values[self.cfg.tool_metric] = step_metrics(rollouts).get(self.cfg.tool_metric)
            if values.get(FINISHED, 0.0) == 0.0:
                counts = Counter(r.outcome.value for r in rollouts if r.outcome is not None)
                values[INFRA_SHARE], values[FINISHED] = infra_share(dict(counts), self.cfg)
        self.series.add(step, values)
        new = [a for a in evaluate(self.series, self.cfg) if a.step == step]
        for a in new:
            self.log.warning("ALARM %s at step %d: %s", a.name, a.step, a.message)
            if self.path is not None:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(a.as_dict()) + "\n")
        self.fired += new
        return new

    def metrics(self, alarms: list[Alarm]) -> dict[str, float]:
        """To log next to the step metrics: `alarms/<name>` = 1.0 for the alarms just fired, and the share of
        groups without signal the last step was judged on (so the dashboard judges the same groups)."""
        out = {f"alarms/{a.name}": 1.0 for a in alarms}
        share = self.series.get(ZERO_VARIANCE)[-1] if self.series.steps else None
        return out if share is None else {ZERO_VARIANCE: share, **out}
