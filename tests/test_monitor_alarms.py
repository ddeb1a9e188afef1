"""Alarms: each fires on the pattern it watches for, stays quiet otherwise, and is logged and recorded."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from legorl.monitor.alarms import AlarmMonitor, Series, evaluate, zero_variance_share
from legorl.monitor.config import AlarmConfig
from legorl.records import Outcome, Rollout

KL = "train/mismatch_k3_kl"
TOOLS = "behaviour/tool_calls_per_turn"


def series(name: str, values: list[float | None]) -> Series:
    s = Series()
    for i, v in enumerate(values):
        s.add(i, {name: v})
    return s


def names(alarms: list) -> list[tuple[str, int]]:
    return [(a.name, a.step) for a in alarms]


def test_kl_rising_fires_when_the_window_mean_grows() -> None:
    cfg = AlarmConfig(kl_window=3, kl_rise_factor=2.0, kl_min=1e-3)
    vals = [0.002, 0.002, 0.002, 0.003, 0.006, 0.012, 0.02]
    fired = names(evaluate(series(KL, vals), cfg))
    assert ("mismatch_kl_rising", 5) in fired and ("mismatch_kl_rising", 6) in fired
    assert all(step >= 4 for _, step in fired)  # not before the rise
    assert evaluate(series(KL, [0.002] * 10), cfg) == []


def test_kl_rising_ignores_numerical_noise_below_the_floor() -> None:
    vals = [1e-14, 1e-14, 1e-13, 1e-12, 1e-11, 1e-10]
    assert evaluate(series(KL, vals), AlarmConfig(kl_window=2)) == []


def test_tool_calls_collapsing() -> None:
    cfg = AlarmConfig(tool_window=2, tool_drop_fraction=0.5, tool_min_baseline=0.2)
    vals = [1.0, 1.0, 0.95, 1.0, 0.6, 0.2, 0.05, 0.0]
    fired = names(evaluate(series(TOOLS, vals), cfg))
    assert ("tool_calls_collapsing", 6) in fired and ("tool_calls_collapsing", 7) in fired
    assert ("tool_calls_collapsing", 3) not in fired
    # never called tools much: nothing to collapse from
    assert evaluate(series(TOOLS, [0.1, 0.1, 0.0, 0.0, 0.0]), cfg) == []
    # missing values are skipped, not read as zero
    assert evaluate(series(TOOLS, [1.0, None, 1.0, None, 1.0]), cfg) == []


GRAD = "train/grad_norm_max"
# train/grad_norm_max of two real runs (2026-12-07): OpenCode with 5 SFT epochs, whose step 14 sampled repeated-token
# junk in every rollout (train reward 0.44 -> 0.0), and Qwen Code's healthy run (+19.5 held-out).
COLLAPSING = [0.0238, 0.0227, 0.0126, 0.0294, 0.0138, 0.0224, 0.0195, 0.0261, 0.0197, 0.0161, 0.0136, 0.011, 0.0239,
              0.2269, 0.6492, 0.1126, 0.0175]
HEALTHY = [0.0285, 0.0138, 0.0177, 0.0105, 0.0266, 0.0136, 0.033, 0.0346, 0.0214, 0.0161, 0.0262, 0.0486, 0.0148,
           0.019, 0.0379, 0.0184, 0.032, 0.0754, 0.0849, 0.0178, 0.0258, 0.0266, 0.0528, 0.0327]


def test_grad_norm_spike_fires_on_the_update_before_a_collapse() -> None:
    alarms = evaluate(series(GRAD, COLLAPSING))
    assert names(alarms) == [("grad_norm_spike", 13), ("grad_norm_spike", 14), ("grad_norm_spike", 15)]
    assert "11.6x the median of the 8 steps before" in alarms[0].message
    assert "trainer.max_grad_norm" in alarms[0].message
    assert evaluate(series(GRAD, HEALTHY)) == []  # its largest step was 3.3x the median before it
    # a stricter factor catches the healthy run's largest step; a missing value is never read as a baseline
    assert ("grad_norm_spike", 17) in names(evaluate(series(GRAD, HEALTHY), AlarmConfig(grad_spike_factor=3.0)))
    assert evaluate(series(GRAD, COLLAPSING[:12] + [None] + COLLAPSING[13:14]), AlarmConfig(grad_window=8)) == []


def test_grad_norm_spike_in_the_monitor_from_logged_metrics(tmp_path: Path) -> None:
    mon = AlarmMonitor(AlarmConfig(grad_window=3), run_dir=tmp_path)
    fired = [mon.update(i, {GRAD: v, "train/grad_norm": v}, []) for i, v in enumerate([0.02, 0.02, 0.03, 0.2])]
    assert [[a.name for a in f] for f in fired] == [[], [], [], ["grad_norm_spike"]]
    recorded = [json.loads(line) for line in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert [(r["name"], r["step"]) for r in recorded] == [("grad_norm_spike", 3)]


def test_threshold_alarms_from_outcome_counts_and_groups() -> None:
    cfg = AlarmConfig(infra_failure_max=0.25, zero_variance_max=0.5)
    mon = AlarmMonitor(cfg)
    ok = {"outcomes/resolved": 3.0, "outcomes/unresolved": 5.0, "outcomes/sandbox_error": 1.0}
    bad = {"outcomes/resolved": 1.0, "outcomes/unresolved": 1.0, "outcomes/sandbox_error": 2.0,
           "outcomes/engine_error": 1.0}
    assert mon.update(0, ok) == []
    fired = mon.update(1, bad)
    assert [a.name for a in fired] == ["infra_failures"] and fired[0].value == pytest.approx(3 / 5)

    def ro(group: str, i: int, reward: float | None) -> Rollout:
        return Rollout(id=f"{group}{i}", step=2, task_id="t", group_id=group, sample_index=i, harness="h",
                       outcome=Outcome.RESOLVED if reward else Outcome.UNRESOLVED, reward=reward)

    same = [ro("a", 0, 1.0), ro("a", 1, 1.0), ro("b", 0, 0.0), ro("b", 1, 0.0), ro("c", 0, 1.0), ro("c", 1, 0.0)]
    assert zero_variance_share(same) == pytest.approx(2 / 3)
    assert zero_variance_share(same, "reinforce") == pytest.approx(1 / 3)  # all-resolved "a" trains
    assert zero_variance_share([ro("a", 0, 1.0), ro("a", 1, None)]) is None  # one rewarded member: not judged
    fired = mon.update(2, ok, rollouts=same)
    assert [a.name for a in fired] == ["zero_variance_groups"]


def test_monitor_logs_and_records(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mon = AlarmMonitor(AlarmConfig(infra_failure_max=0.1), run_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="legorl.alarms"):
        fired = mon.update(7, {"outcomes/unresolved": 1.0, "outcomes/agent_crash": 1.0})
    assert [a.name for a in fired] == ["infra_failures"]
    assert "ALARM infra_failures at step 7" in caplog.text
    lines = [json.loads(x) for x in (tmp_path / "alarms.jsonl").read_text().splitlines()]
    assert lines[0]["name"] == "infra_failures" and lines[0]["step"] == 7
    assert mon.metrics(fired) == {"alarms/infra_failures": 1.0}


def test_monitor_computes_tool_rate_from_rollouts() -> None:
    from test_monitor_behaviour import mini_trajectory

    cfg = AlarmConfig(tool_window=1, tool_drop_fraction=0.5, tool_min_baseline=0.2)
    mon = AlarmMonitor(cfg)
    good = mini_trajectory()
    prose = [c for c in good if not c.tool_calls]
    for step in range(3):
        r = Rollout(id=f"r{step}", step=step, task_id="t", group_id="g", sample_index=0, harness="mini-swe-agent",
                    outcome=Outcome.UNRESOLVED, reward=0.0, calls=good)
        assert mon.update(step, {"outcomes/unresolved": 1.0}, rollouts=[r]) == []
    r = Rollout(id="r3", step=3, task_id="t", group_id="g", sample_index=0, harness="mini-swe-agent",
                outcome=Outcome.UNRESOLVED, reward=0.0, calls=prose * 3)
    assert [a.name for a in mon.update(3, {"outcomes/unresolved": 1.0}, rollouts=[r])] == ["tool_calls_collapsing"]


def test_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="kl_windw"):
        AlarmConfig.model_validate({"kl_windw": 3})
