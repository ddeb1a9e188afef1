"""What each dashboard page shows, as JSON: chart specs, tables, alarms.

A chart spec is `{"id", "title", "kind": "line" | "stacked", "x": [steps], "series": [{"name", "values"}]}`;
the front end draws any spec, so every curve is defined here, once.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from legorl.monitor import alarms as alarm_mod
from legorl.monitor.behaviour import aggregate, analyse_calls
from legorl.monitor.config import INFRA_OUTCOMES, AlarmConfig
from legorl.monitor.db import OutcomeMatrix, RunDB
from legorl.records import Outcome
from legorl.train.advantages import carries_signal

OUTCOMES = [o.value for o in Outcome]
log = logging.getLogger("legorl.alarms")


MAX_POINTS = 600  # longer runs are thinned to every k-th step (and the last) per chart


def _thin(n: int) -> list[int] | None:
    if n <= MAX_POINTS:
        return None
    k = -(-n // MAX_POINTS)
    idx = list(range(0, n, k))
    return idx if idx[-1] == n - 1 else idx + [n - 1]


def chart(cid: str, title: str, x: list[int], series: dict[str, list[float | None]], kind: str = "line",
          **extra: Any) -> dict[str, Any]:
    keep = _thin(len(x))
    if keep is not None:
        x = [x[i] for i in keep]
        series = {k: [v[i] for i in keep] for k, v in series.items()}
    return {"id": cid, "title": title, "kind": kind, "x": x,
            "series": [{"name": k, "values": v} for k, v in series.items() if any(y is not None for y in v)],
            **({"thinned": True} if keep is not None else {}), **extra}


def _get(ms: list[dict[str, float]], key: str) -> list[float | None]:
    return [m.get(key) for m in ms]  # the store's metrics are cleaned to finite floats on load (RunDB.steps)


def _ratio(a: list[float | None], b: list[float | None], scale: float = 1.0) -> list[float | None]:
    return [x / y * scale if x is not None and y else None for x, y in zip(a, b)]


def _outcome_chart(db: RunDB, split: str | None, cid: str, title: str,
                   m: OutcomeMatrix | None = None) -> dict[str, Any]:
    m = m or db.outcome_counts(split)
    order = [o for o in OUTCOMES if o in m.cols] + sorted(o for o in m.cols if o not in OUTCOMES)
    return chart(cid, title, m.x, {o: m.cols[o] for o in order}, kind="stacked", link="outcome", split=split)


def _eval_series(db: RunDB, xs: list[int], train_pass: list[float | None]) -> dict[str, Any]:
    """Train reward / pass rate per step, eval pass@1 per evaluation (steps may be -1 or past the end)."""
    evals = db.eval_pass_rates()
    all_x = sorted(set(xs) | {s for pts in evals.values() for s, _, _ in pts})
    pos = {s: i for i, s in enumerate(all_x)}
    series: dict[str, list[float | None]] = {}
    for name, vals in (("train pass rate", train_pass),):
        col: list[float | None] = [None] * len(all_x)
        for s, v in zip(xs, vals):
            col[pos[s]] = v
        series[name] = col
    for split, pts in evals.items():
        col = [None] * len(all_x)
        for s, v, _ in pts:
            col[pos[s]] = v
        series[f"eval {split} pass@1"] = col
    return {"x": all_x, "series": series}


OVERVIEW_METRICS = [
    "pass_rate", "reward/mean", "rollouts/turns_mean", "rollouts/count", "rollouts/completion_tokens_mean",
    "time/step_s", "time/rollout_s", "time/wait_s", "time/train_s", "time/sync_s", "time/grading_s",
    "train/logprob_pearson", "async/dropped", "tokens/prompt", "tokens/sampled", "tokens/masked",
    "train/loss_tokens", "train/is_weight_p05", "train/is_weight_p50", "train/is_weight_p95", "train/is_weight_max",
    "train/is_truncated_frac", "train/is_rejected_frac",
    "train/is_ess", "train/mismatch_k3_kl", "train/mismatch_abs_dlogp_mean", "seq/tokens_unmerged", "train/rollouts",
    "behaviour/turns_per_rollout", "train/loss", "train/grad_norm", "train/clip_frac"]


def _async_charts(steps: list[tuple[int, float, dict[str, float]]]) -> list[dict[str, Any]]:
    """Asynchronous RL: rollouts per step by staleness (weight versions behind the trainer) and dropped, and
    the share dropped per task family (dropping stale rollouts favours the tasks that finish fast)."""
    xs = [s for s, _, _ in steps]
    lags = sorted({int(k.rsplit("/", 1)[1]) for _, _, m in steps for k in m if k.startswith("async/staleness/")})
    families = sorted({k.rsplit("/", 1)[1] for _, _, m in steps for k in m if k.startswith("async/dropped_share/")})
    return [
        chart("staleness", "Asynchronous: rollouts by staleness (versions behind the trainer), dropped", xs,
              {**{f"{n} behind": [m.get(f"async/staleness/{n}", 0.0) for _, _, m in steps] for n in lags},
               "dropped": [m.get("async/dropped") for _, _, m in steps]}, kind="stacked"),
        chart("dropped_by_family", "Asynchronous: share dropped as stale, per task family", xs,
              {f: [m.get(f"async/dropped_share/{f}") for _, _, m in steps] for f in families}, ymin=0, ymax=1),
    ]


def overview(db: RunDB) -> dict[str, Any]:
    steps = db.steps()
    last = steps[-1][2] if steps else {}
    xs, cols = db.step_columns(OVERVIEW_METRICS)

    def g(key: str) -> list[float | None]:
        return cols[key]

    pass_rate = g("pass_rate")
    ev = _eval_series(db, xs, pass_rate)
    ev_series = dict(ev["series"])
    rewards: dict[str, list[float | None]] = {"train reward (mean)": [None] * len(ev["x"])}
    pos = {s: i for i, s in enumerate(ev["x"])}
    for s, v in zip(xs, g("reward/mean")):
        rewards["train reward (mean)"][pos[s]] = v
    calls_per_step = [t * n if t is not None and n is not None else None
                      for t, n in zip(g("rollouts/turns_mean"), g("rollouts/count"))]
    sampled = [c * t if c is not None and t is not None else None
               for c, t in zip(calls_per_step, g("rollouts/completion_tokens_mean"))]
    # asynchronous: the batch was sampled while earlier steps trained; the step waited time/wait_s for it
    asynchronous = any(v is not None for v in g("async/dropped"))
    rollout = g("time/wait_s") if asynchronous else g("time/rollout_s")
    other = [None if st is None else max(0.0, st - sum(v or 0.0 for v in parts))
             for st, *parts in zip(g("time/step_s"), rollout, g("time/train_s"), g("time/sync_s"),
                                   g("time/grading_s"))]
    charts = [
        chart("reward", "Reward and pass rate (train, eval)", ev["x"], {**rewards, **ev_series}, ymin=0, ymax=1),
        _outcome_chart(db, "train", "outcomes", "Outcomes per step (train rollouts; click a bar for its rollouts)"),
        chart("mismatch", "Sampler/trainer agreement: logprob Pearson, IS ESS", xs,
              {"logprob Pearson": g("train/logprob_pearson"), "IS ESS (normalised)": g("train/is_ess")}, ymax=1),
        chart("kl", "Mismatch k3 KL (sampler vs trainer)", xs,
              {"k3 KL": g("train/mismatch_k3_kl"), "mean |Δlogp|": g("train/mismatch_abs_dlogp_mean")}, ylog=True),
        chart("lengths", "Lengths (tokens): response per call, episode per trained rollout", xs,
              {"response": g("rollouts/completion_tokens_mean"),
               "episode": _ratio(g("seq/tokens_unmerged"), g("train/rollouts"))}, ymin=0),
        chart("turns", "Turns per rollout", xs, {"turns (calls) per rollout": g("rollouts/turns_mean"),
                                                 "behaviour turns": g("behaviour/turns_per_rollout")}, ymin=0),
        chart("tokens_per_s", "Throughput: sampled tokens / s (rollout phase)", xs,
              {"tokens/s": _ratio(sampled, g("time/rollout_s"))}, ymin=0),
        chart("rollouts_per_min", "Throughput: rollouts / min", xs,
              {"rollouts/min": _ratio(g("rollouts/count"), g("time/step_s"), 60.0)}, ymin=0),
        chart("time", "Step time split (s)", xs,
              {"waiting for rollouts" if asynchronous else "rollout": rollout, "grading": g("time/grading_s"),
               "training": g("time/train_s"), "weight sync": g("time/sync_s"), "other": other}, kind="stacked"),
        chart("train", "Training: loss, grad norm, clip fraction", xs,
              {"loss": g("train/loss"), "grad norm": g("train/grad_norm"), "clip frac": g("train/clip_frac")}),
        chart("tokens", "Tokens per step: prompt, sampled, trained (in the loss), sampled by masked rollouts", xs,
              {"prompt": g("tokens/prompt"), "sampled": g("tokens/sampled"), "trained": g("train/loss_tokens"),
               "masked": g("tokens/masked")}, ymin=0),
        chart("is_weights", "Importance weights (trainer / sampler): p5, median, p95, max; truncated, clipped share",
              xs, {"p5": g("train/is_weight_p05"), "median": g("train/is_weight_p50"), "p95": g("train/is_weight_p95"),
                   "max": g("train/is_weight_max"), "truncated share": g("train/is_truncated_frac"),
                   "clipped share": g("train/clip_frac")}, ymin=0),
    ]
    if asynchronous:
        charts += _async_charts(steps)
    totals = db.outcome_totals()
    return {
        "run": {"dir": str(db.run_dir), "name": db.run_info()["name"], "steps": len(xs),
                "last_step": xs[-1] if xs else None, "rollouts": sum(totals.values()), "outcomes": totals,
                "calls": int(db.query("SELECT MAX(id) FROM llm_calls")[0][0] or 0),
                "last": {k: last.get(k) for k in ("reward/mean", "pass_rate", "train/logprob_pearson",
                                                  "train/mismatch_k3_kl", "time/step_s") if k in last}},
        "charts": charts,
        "recent_failures": db.recent_failures(8),
    }


_DIGITS = re.compile(r"\d+")


def failures(db: RunDB, split: str | None = "train", infra: tuple[str, ...] = INFRA_OUTCOMES) -> dict[str, Any]:
    matrix = db.outcome_counts(split)
    stacked = _outcome_chart(db, split, "failures", "Outcome taxonomy per step", matrix)
    shares = dict(stacked)
    totals = [sum((s["values"][i] or 0.0) for s in stacked["series"]) for i in range(len(stacked["x"]))]
    shares.update(id="failure_share", title="Outcome share per step", kind="stacked",
                  series=[{"name": s["name"], "values": [v / t if t else None for v, t in zip(s["values"], totals)]}
                          for s in stacked["series"]])
    count_by = matrix.totals
    total = sum(count_by.values())
    reasons: dict[str, dict[str, list[int]]] = {}
    for outcome, reason, n, last in db.failure_reasons():
        key = _DIGITS.sub("N", reason)
        agg = reasons.setdefault(outcome, {}).setdefault(key, [0, last])
        agg[0] += n
        agg[1] = max(agg[1], last)
    table = []
    for o in OUTCOMES:
        if o == "resolved" or o not in count_by:
            continue
        top = sorted(reasons.get(o, {}).items(), key=lambda kv: -kv[1][0])[:5]
        table.append({"outcome": o, "count": count_by[o], "share": count_by[o] / total if total else 0.0,
                      "infra": o in infra,
                      "reasons": [{"reason": k, "count": v[0], "last_step": v[1]} for k, v in top],
                      "examples": db.failure_examples(o, 5)})
    return {"charts": [stacked, shares], "table": table, "total": total,
            "resolved": count_by.get("resolved", 0), "split": split}


class BehaviourCache:
    """Behaviour metrics per train step, from the pipeline's `behaviour/*` step metrics when it logged
    them, else computed from captured calls (a deterministic sample of at most `per_step` rollouts per
    step). Finished steps are computed once."""

    def __init__(self, db: RunDB, per_step: int = 24, max_steps: int = 200):
        self.db = db
        self.sample = per_step
        self.max_steps = max_steps
        self._done: dict[int, dict[str, float]] = {}
        self._lock = threading.Lock()

    def _compute(self, step: int) -> dict[str, float]:
        ids = [str(r[0]) for r in self.db.query(
            "SELECT id FROM rollouts WHERE split = 'train' AND step = ? AND outcome IS NOT NULL ORDER BY id",
            (step,))]
        n = len(ids)
        if n > self.sample:
            ids = [ids[i * n // self.sample] for i in range(self.sample)]
        calls = self.db.light_calls(ids)
        harness = self.db.harness_of(ids)
        m = aggregate(analyse_calls(calls[i], harness.get(i, "")) for i in ids if calls[i])
        if m:
            m["behaviour/sampled_rollouts"] = float(len(ids))
            m["behaviour/step_rollouts"] = float(n)
        return m

    def per_step(self) -> dict[int, dict[str, float]]:
        logged = {s: {k: v for k, v in m.items() if k.startswith("behaviour/")} for s, _, m in self.db.steps()}
        closed = set(logged)
        after = max(closed, default=-(2**62))  # steps without metrics yet: in progress
        steps = sorted({int(r[0]) for r in self.db.query(
            "SELECT DISTINCT step FROM rollouts WHERE split = 'train' AND step > ? AND outcome IS NOT NULL",
            (after,))} | closed)
        if len(steps) > self.max_steps:  # evenly spaced, always with the latest
            k = len(steps)
            steps = sorted({steps[i * (k - 1) // (self.max_steps - 1)] for i in range(self.max_steps)})
        out: dict[int, dict[str, float]] = {}
        with self._lock:
            for s in steps:
                if logged.get(s):
                    out[s] = logged[s]
                elif s in self._done:
                    out[s] = self._done[s]
                else:
                    m = self._compute(s)
                    if s in closed:
                        self._done[s] = m
                    out[s] = m
        return {s: m for s, m in out.items() if m}


def evaluations(db: RunDB, split: str = "heldout") -> list[tuple[int, dict[str, float]]]:
    """(RL updates done, metrics) of each evaluation of `split`: before RL and after it from summary.json, the
    ones between steps (`eval.every`) from the step rows."""
    summary = db.summary()
    key = f"eval/{split}/pass_at_1"
    out = [(0, summary["before_rl"])] if key in summary.get("before_rl", {}) else []
    out += [(s + 1, m) for s, _, m in db.steps() if key in m]
    if key in summary.get("after_rl", {}):
        out.append((int(summary.get("steps") or (out[-1][0] if out else 0)), summary["after_rl"]))
    return sorted(dict(out).items())


def evaluation_shares(db: RunDB, split: str = "heldout") -> dict[str, Any]:
    """Reasoning share and tool-call share per evaluation over the split's fixed task cohort, per harness; an
    evaluation that covered under half of the cohort with graded rollouts is flagged."""
    evs = evaluations(db, split)
    xs = [x for x, _ in evs]
    names = sorted({k.split("/")[2] for _, m in evs for k in m if k.endswith("/behaviour/reasoning_share")})
    series: dict[str, list[float | None]] = {}
    for h in names:
        series[f"reasoning share · {h}"] = [m.get(f"eval/{split}/{h}/behaviour/reasoning_share") for _, m in evs]
        series[f"tool-call share · {h}"] = [m.get(f"eval/{split}/{h}/behaviour/tool_call_share") for _, m in evs]
    coverage = [m.get(f"eval/{split}/cohort_coverage") for _, m in evs]
    series["cohort covered"] = coverage
    flagged = [x for x, c in zip(xs, coverage, strict=True) if c is not None and c < 0.5]
    title = f"Per {split} evaluation (x: RL updates done): reasoning share of the output, share of calls with a tool call"
    if flagged:
        title += f"; covered under half of the cohort at {', '.join(map(str, flagged))}: read those with care"
    return chart("b_eval_shares", title, xs, series, ymin=0, ymax=1) | {"flagged": flagged}


def behaviour(cache: BehaviourCache, evaluation: dict[str, Any] | None = None) -> dict[str, Any]:
    """The behaviour page: per-step charts from `cache`, then `evaluation` (evaluation_shares' chart) if given."""
    per = cache.per_step()
    xs = sorted(per)
    ms = [per[s] for s in xs]
    g = lambda k: _get(ms, "behaviour/" + k)
    mix = {k: g(f"mix/{k}") for k in ("read", "search", "edit", "test", "submit", "other")}
    # A run through several harnesses logs each one's behaviour too: one more line per harness.
    harnesses = sorted({k.split("/")[2] for m in ms for k in m if k.startswith("behaviour/by_harness/")})

    def split(label: str, key: str) -> dict[str, list[float | None]]:
        return {f"{label} · {h}": g(f"by_harness/{h}/{key}") for h in harnesses}

    charts = [
        chart("b_turns", "Turns per rollout", xs, {"turns": g("turns_per_rollout"),
                                                   **split("turns", "turns_per_rollout")}, ymin=0),
        chart("b_tools", "Tool calls per turn", xs, {"tool calls / turn": g("tool_calls_per_turn"),
                                                     **split("tool calls / turn", "tool_calls_per_turn")}, ymin=0),
        chart("b_verify", "Verification after edit (edits later read or tested)", xs,
              {"verified share of edits": g("verify_after_edit_rate"),
               "rollouts that edit": g("edit_rollout_rate"), **split("verified", "verify_after_edit_rate")},
              ymin=0, ymax=1),
        chart("b_text", "Text-only turns, format errors, truncated turns (share of turns)", xs,
              {"text-only": g("text_only_turn_rate"), "format errors": g("format_error_rate"),
               "truncated": g("truncated_turn_rate"), **split("text-only", "text_only_turn_rate")}, ymin=0, ymax=1),
        chart("b_submit", "Submit rate (rollouts that submitted / ended on their own)", xs,
              {"submitted": g("submit_rate")}, ymin=0, ymax=1),
        chart("b_mix", "Command mix (share of tool calls)", xs, mix, kind="stacked", ymax=1),
        *([evaluation] if evaluation is not None else []),
    ]
    sampled = sum(int(m.get("behaviour/sampled_rollouts", m.get("behaviour/rollouts", 0))) for m in ms)
    return {"charts": charts, "steps": len(xs), "rollouts_analysed": sampled, "harnesses": harnesses,
            "latest": {k.removeprefix("behaviour/"): v for k, v in (ms[-1] if ms else {}).items()}}


class AlarmBoard:
    """Evaluates the alarms over the whole run for the dashboard and logs each new one once."""

    def __init__(self, db: RunDB, cache: BehaviourCache, cfg: AlarmConfig | None = None):
        self.db = db
        self.cache = cache
        self.cfg = cfg or AlarmConfig()
        self._logged: set[tuple[str, int]] = set()
        self._seen_any = False
        self._lock = threading.Lock()

    def series(self) -> alarm_mod.Series:
        cfg = self.cfg
        groups = self.db.group_stats()
        # which groups train nothing depends on the run's advantage (under reinforce an all-resolved group trains)
        advantage = self.db.run_info()["config"].get("trainer", {}).get("advantage", "grpo")
        need_tools = not any(cfg.tool_metric in m for _, _, m in self.db.steps())
        behaviour = self.cache.per_step() if need_tools and cfg.tool_metric.startswith("behaviour/") else {}
        s = alarm_mod.Series()
        for step, _, m in self.db.steps():
            values = alarm_mod.derived(m, cfg)
            if step in groups and alarm_mod.ZERO_VARIANCE not in values:
                n, uniform = groups[step]
                silent = sum(k for reward, k in uniform.items() if not carries_signal([reward, reward], advantage))
                values[alarm_mod.ZERO_VARIANCE] = silent / n if n else None
            if cfg.tool_metric not in values and step in behaviour:
                values[cfg.tool_metric] = behaviour[step].get(cfg.tool_metric)
            s.add(step, values)
        return s

    def alarms(self) -> dict[str, Any]:
        s = self.series()
        found = alarm_mod.evaluate(s, self.cfg)
        last = s.steps[-1] if s.steps else None
        with self._lock:
            if not self._seen_any:  # on start, only what is firing now; the history is on the page
                self._seen_any = True
                self._logged.update((a.name, a.step) for a in found if a.step != last)
            for a in found:
                if (a.name, a.step) not in self._logged:
                    self._logged.add((a.name, a.step))
                    log.warning("ALARM %s at step %d: %s", a.name, a.step, a.message)
        return {"alarms": [a.as_dict() for a in found], "active": [a.as_dict() for a in found if a.step == last],
                "last_step": last, "config": self.cfg.model_dump()}
