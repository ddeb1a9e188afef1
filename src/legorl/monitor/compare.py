"""Runs side by side (`legorl dashboard RUN_A RUN_B ...`, the Compare page): their curves on the same axes,
where their configs differ, and each one's per-harness results before and after RL."""

from __future__ import annotations

from typing import Any

from legorl.monitor.analytics import chart
from legorl.monitor.db import RunDB

# (chart id, title, step metric); held-out pass@1 comes from the evaluation rollouts
CURVES = [
    ("reward", "Train reward (mean)", "reward/mean"),
    ("pearson", "Sampler/trainer logprob Pearson", "train/logprob_pearson"),
    ("k3", "Mismatch k3 KL (sampler vs trainer)", "train/mismatch_k3_kl"),
    ("turns", "Turns per rollout", "behaviour/turns_per_rollout"),
    ("verify", "Verification after an edit (share of rollouts)", "behaviour/verify_after_edit_rate"),
    ("step_time", "Step time (s)", "time/step_s"),
]


def run_label(db: RunDB, name: str | None, taken: set[str]) -> str:
    """The run's name, made unique with its directory's name where two runs share one."""
    name = name or db.run_dir.name
    label = name if name not in taken else f"{name} ({db.run_dir.name})"
    taken.add(label)
    return label


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every config key whose value is not the same in all runs (a key a run lacks counts as different)."""
    flat = [flatten(c) for c in configs]
    keys = sorted({k for f in flat for k in f})
    missing = object()
    rows = []
    for key in keys:
        values = [f.get(key, missing) for f in flat]
        if any(v != values[0] for v in values[1:]):
            rows.append({"key": key, "values": [None if v is missing else v for v in values]})
    return rows


def compare(dbs: list[RunDB]) -> dict[str, Any]:
    """What the Compare page draws, for runs in the order given (the first is the dashboard's own run)."""
    taken: set[str] = set()
    infos = [db.run_info() for db in dbs]  # name and resolved config, as the run recorded them in its store
    labels = [run_label(db, info["name"], taken) for db, info in zip(dbs, infos, strict=True)]
    steps = [{s: m for s, _, m in db.steps()} for db in dbs]
    xs = sorted({s for per_run in steps for s in per_run})
    charts = [chart(cid, title, xs, {label: [per_run.get(s, {}).get(key) for s in xs]
                                     for label, per_run in zip(labels, steps, strict=True)})
              for cid, title, key in CURVES]
    # held-out pass@1 per evaluation (before RL at step -1, during, after RL at the last step)
    evals = [db.eval_pass_rates().get("heldout", []) for db in dbs]
    ex = sorted({s for pts in evals for s, _, _ in pts})
    charts.insert(1, chart("heldout", "Held-out pass@1 per evaluation", ex,
                           {label: [{s: v for s, v, _ in pts}.get(s) for s in ex]
                            for label, pts in zip(labels, evals, strict=True)}, ymin=0, ymax=1))
    summaries = [db.summary() for db in dbs]
    harnesses = [{"run": label, "harness": name, "before": row.get("pass_at_1_before_rl"),
                  "after": row.get("pass_at_1_after_rl")}
                 for label, s in zip(labels, summaries, strict=True)
                 for name, row in (s.get("per_harness") or {}).items()]
    return {"runs": [{"label": label, "dir": str(db.run_dir), "steps": len(per_run),
                      "wall_time_s": s.get("wall_time_s")}
                     for label, db, per_run, s in zip(labels, dbs, steps, summaries, strict=True)],
            "charts": charts,
            "config_differences": config_differences([info["config"] for info in infos]),
            "per_harness": harnesses}
