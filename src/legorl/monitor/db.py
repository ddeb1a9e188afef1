"""Read side of the run store for the dashboard: fast, paginated, safe while the trainer writes.

Each server thread gets its own SQLite connection (WAL: readers never block the
writer). The indexes the dashboard's filters need are added on open with
CREATE INDEX IF NOT EXISTS, so an existing run directory works as it is.
Results that depend only on the store's contents are cached until the store
changes (its file and WAL sizes and times are the cache key).
"""

from __future__ import annotations

import json
import math
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from legorl.records import LLMCall
from legorl.store import read_calls, read_light_calls

T = TypeVar("T")

INDEXES = (
    "CREATE INDEX IF NOT EXISTS monitor_rollouts_step_outcome ON rollouts(step, outcome)",
    "CREATE INDEX IF NOT EXISTS monitor_rollouts_outcome_step ON rollouts(outcome, step)",
    "CREATE INDEX IF NOT EXISTS monitor_rollouts_task_step ON rollouts(task_id, step)",
    "CREATE INDEX IF NOT EXISTS monitor_rollouts_harness_step ON rollouts(harness, step)",
    "CREATE INDEX IF NOT EXISTS monitor_rollouts_reward ON rollouts(reward, step)",
    "CREATE INDEX IF NOT EXISTS monitor_rollouts_split_step ON rollouts(split, step, outcome)",
    "CREATE INDEX IF NOT EXISTS monitor_rollouts_split_group ON rollouts(split, step, group_id, reward, outcome)",
    # every filter and sort column: any filter combination can be answered from this index alone
    ("CREATE INDEX IF NOT EXISTS monitor_rollouts_filter "
     "ON rollouts(outcome, harness, split, reward, step, task_id, updated)"),
)

SORTABLE = {"step": "step", "task": "task_id", "harness": "harness", "outcome": "outcome", "reward": "reward",
            "split": "split", "updated": "updated", "id": "rowid", "created": "rowid"}
LIST_COLS = ("id, step, task_id, group_id, sample_index, harness, split, outcome, outcome_reason, reward, "
             "weight_version_start, weight_version_end, timings_json, updated")


def clean_metrics(m: dict[str, Any]) -> dict[str, float]:
    """Finite numbers only, to 6 significant digits (charts need no more; JSON has no NaN)."""
    out = {}
    for k, v in m.items():
        if isinstance(v, (int, float)) and math.isfinite(v):
            out[k] = float(f"{v:.6g}")
    return out


class OutcomeMatrix:
    """Counts per step (x, ascending) and outcome, as columns aligned with x; grows by appending steps."""

    def __init__(self) -> None:
        self.x: list[int] = []
        self.cols: dict[str, list[int]] = {}
        self.totals: dict[str, int] = {}

    def add_rows(self, rows: list[Any]) -> None:
        """Rows of (step, outcome, count) in ascending step order, all after the steps already held."""
        for r in rows:
            step, outcome, n = int(r[0]), str(r[1]), int(r[2])
            if not self.x or self.x[-1] != step:
                self.x.append(step)
                for col in self.cols.values():
                    col.append(0)
            col = self.cols.get(outcome)
            if col is None:
                col = self.cols[outcome] = [0] * len(self.x)
            col[-1] += n
            self.totals[outcome] = self.totals.get(outcome, 0) + n

    def copy(self) -> OutcomeMatrix:
        m = OutcomeMatrix()
        m.x, m.cols, m.totals = list(self.x), {k: list(v) for k, v in self.cols.items()}, dict(self.totals)
        return m


class StoreMissing(FileNotFoundError):
    """The run directory has no store.sqlite."""


@dataclass
class RolloutFilter:
    step: int | None = None
    step_min: int | None = None
    step_max: int | None = None
    task: str | None = None  # exact id, or a substring
    harness: str | None = None
    outcome: str | None = None  # one outcome, several comma-separated, or "failed" (anything but resolved)
    split: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    masked: bool | None = None  # True: only rollouts without a reward (masked); False: only rewarded

    def columns(self) -> set[str]:
        cols = {"step": self.step is not None or self.step_min is not None or self.step_max is not None,
                "task_id": bool(self.task), "harness": bool(self.harness), "outcome": bool(self.outcome),
                "split": bool(self.split), "reward": self.reward_min is not None or self.reward_max is not None
                or self.masked is not None}
        return {c for c, used in cols.items() if used} | ({"outcome"} if self.masked else set())

    def covering_index(self, sort_col: str) -> str | None:
        """None when a plain index seek serves this filter and sort; else the covering index to scan once."""
        used = self.columns() | ({sort_col} if sort_col != "rowid" else set())
        if self.step is not None:
            return None  # one step is a small range of rollouts_step
        seekable = ({"step"}, {"outcome", "step"}, {"harness", "step"}, {"reward", "step"}, {"split", "step"},
                    {"split", "step", "outcome"})
        if not self.task and any(used <= s for s in seekable):
            return None
        if used <= {"task_id", "step"}:
            return "monitor_rollouts_task_step"
        if used <= {"outcome", "harness", "split", "reward", "step", "task_id", "updated"}:
            return "monitor_rollouts_filter"
        return None

    def where(self) -> tuple[str, list[Any]]:
        clauses: list[str] = []
        params: list[Any] = []

        def add(clause: str, *values: Any) -> None:
            clauses.append(clause)
            params.extend(values)

        bounds = (("step = ?", self.step), ("step >= ?", self.step_min), ("step <= ?", self.step_max))
        for clause, v in bounds:
            if v is not None:
                add(clause, v)
        if self.task:
            esc = self.task.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            add("(task_id = ? OR task_id LIKE ? ESCAPE '\\')", self.task, f"%{esc}%")
        if self.harness:
            add("harness = ?", self.harness)
        if self.outcome:
            if self.outcome == "failed":
                add("outcome IS NOT NULL AND outcome != 'resolved'")
            elif self.outcome == "pending":
                add("outcome IS NULL")
            else:
                names = [o.strip() for o in self.outcome.split(",") if o.strip()]
                add(f"outcome IN ({', '.join('?' * len(names))})", *names)
        if self.split:
            add("split = ?", self.split)
        for clause, v in (("reward >= ?", self.reward_min), ("reward <= ?", self.reward_max)):
            if v is not None:
                add(clause, v)
        if self.masked is True:
            add("reward IS NULL AND outcome IS NOT NULL")
        elif self.masked is False:
            add("reward IS NOT NULL")
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", params


@dataclass
class Page:
    rows: list[dict[str, Any]]
    total: int
    page: int
    per_page: int
    facets: dict[str, list[str]] = field(default_factory=dict)


class RunDB:
    """The dashboard's view of one run directory."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "store.sqlite"
        if not self.path.is_file():
            raise StoreMissing(f"{self.run_dir} has no store.sqlite: is it a run directory written by legorl train?")
        self._local = threading.local()
        self._cache: dict[tuple[Any, ...], tuple[tuple[int, ...], Any]] = {}
        self._cache_lock = threading.Lock()
        self._steps: dict[int, tuple[float, dict[str, float]]] = {}
        self._steps_lock = threading.Lock()
        self._steps_gen = 0  # bumped whenever a step's metrics were (re)read
        self._columns: tuple[int, list[int], dict[str, list[float | None]]] = (-1, [], {})
        self._matrix = OutcomeMatrix()  # train outcome counts of closed steps, grown as steps close
        self._matrix_upto: int | None = None
        self._matrix_lock = threading.Lock()
        self._groups: dict[int, tuple[int, dict[float, int]]] = {}
        self._groups_upto: int | None = None
        self.ensure_indexes()

    def ensure_indexes(self) -> None:
        conn = sqlite3.connect(str(self.path), timeout=30.0)
        try:
            conn.execute("PRAGMA busy_timeout=30000")
            for sql in INDEXES:
                conn.execute(sql)
            conn.commit()
            self.indexed = True
        except sqlite3.OperationalError:
            self.indexed = False  # a read-only copy of a run: pages still work, filters scan
        finally:
            conn.close()

    def _by(self, index: str) -> str:
        return f" INDEXED BY {index}" if self.indexed else ""

    # ---- connections and caching ---------------------------------------------------------------
    def conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "conn", None)
        if c is None:
            c = sqlite3.connect(str(self.path), timeout=30.0, check_same_thread=False)
            c.row_factory = sqlite3.Row
            c.execute("PRAGMA busy_timeout=30000")
            c.execute("PRAGMA query_only=1")
            c.execute("PRAGMA cache_size=-65536")  # 64 MiB page cache per reader
            self._local.conn = c
        return c

    def query(self, sql: str, params: tuple[Any, ...] | list[Any] = ()) -> list[sqlite3.Row]:
        return self.conn().execute(sql, tuple(params)).fetchall()

    def version(self) -> tuple[int, ...]:
        """Changes whenever anything was committed to the store (file and WAL size and time)."""
        out: list[int] = []
        for p in (self.path, self.path.with_name(self.path.name + "-wal")):
            try:
                st = p.stat()
                out += [st.st_mtime_ns, st.st_size]
            except FileNotFoundError:
                out += [0, 0]
        return tuple(out)

    def cached(self, key: tuple[Any, ...], compute: Callable[[], T]) -> T:
        v = self.version()
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] == v:
            return hit[1]
        value = compute()
        with self._cache_lock:
            if len(self._cache) > 512:
                self._cache.clear()
            self._cache[key] = (v, value)
        return value

    # ---- steps -------------------------------------------------------------------------------------
    def steps(self) -> list[tuple[int, float, dict[str, float]]]:
        """(step, time, metrics) for every step; a row's JSON is parsed once, again only if it was rewritten."""
        def load() -> list[tuple[int, float, dict[str, float]]]:
            with self._steps_lock:
                stamps = {int(r[0]): float(r[1] or 0.0) for r in self.query("SELECT step, t FROM steps")}
                stale = [st for st, t in stamps.items() if self._steps.get(st, (None,))[0] != t]
                for i in range(0, len(stale), 500):
                    chunk = stale[i:i + 500]
                    marks = ", ".join("?" * len(chunk))
                    for r in self.query(f"SELECT step, t, metrics_json FROM steps WHERE step IN ({marks})", chunk):
                        self._steps[int(r[0])] = (float(r[1] or 0.0), clean_metrics(json.loads(r[2] or "{}")))
                gone = set(self._steps) - set(stamps)
                for st in gone:
                    del self._steps[st]
                if stale or gone:
                    self._steps_gen += 1
                return [(st, *self._steps[st]) for st in sorted(self._steps)]

        return self.cached(("steps",), load)

    def step_columns(self, keys: list[str]) -> tuple[list[int], dict[str, list[float | None]]]:
        """(steps, {metric: values aligned with steps}), built once per change of the steps table."""
        steps = self.steps()
        with self._steps_lock:
            gen, xs, cols = self._columns
            if gen != self._steps_gen or len(xs) != len(steps):
                gen, xs, cols = self._steps_gen, [st for st, _, _ in steps], {}
                self._columns = (gen, xs, cols)
            out = {}
            for key in keys:
                col = cols.get(key)
                if col is None:
                    col = cols[key] = [m.get(key) for _, _, m in steps]
                out[key] = col
        return xs, out

    def closed_step(self) -> int | None:
        """The last step whose metrics are written: its train rollouts are final."""
        steps = self.steps()
        return steps[-1][0] if steps else None

    def summary(self) -> dict[str, Any]:
        """RUN_DIR/summary.json (evaluations before and after RL, per-harness results, wall time); {} until the
        run writes it."""
        try:
            return json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return {}

    def run_info(self) -> dict[str, Any]:
        rows = self.query("SELECT name, created, config_json FROM runs ORDER BY id DESC LIMIT 1")
        if not rows:
            return {"name": self.run_dir.name, "created": None, "config": {}}
        return {"name": rows[0][0], "created": rows[0][1], "config": json.loads(rows[0][2] or "{}")}

    # ---- rollouts ------------------------------------------------------------------------------------
    def rollouts_page(self, f: RolloutFilter, sort: str = "step", desc: bool = True, page: int = 1,
                      per_page: int = 50) -> Page:
        """One page of the rollouts table. Filtering, sorting and skipping happen on indexes (rowids only);
        only the page's rows are then read from the table."""
        where, params = f.where()
        col = SORTABLE.get(sort, "step")
        direction = "DESC" if desc else "ASC"
        per_page = max(1, min(per_page, 500))
        page = max(1, page)
        offset = (page - 1) * per_page
        # A filter no single index seeks is answered from one covering index (its rows are never read)
        by = self._by(hint) if (hint := f.covering_index(col)) and self.indexed else ""
        order = f"ORDER BY {col} {direction}, rowid {direction} LIMIT ? OFFSET ?"
        if by:  # a full scan of that index anyway: count in the same pass
            found = self.query(f"SELECT rowid, COUNT(*) OVER () FROM rollouts{by}{where} {order}",
                               params + [per_page, offset])
            ids = [int(r[0]) for r in found]
            total = int(found[0][1]) if found else None
        else:
            ids = [int(r[0]) for r in self.query(f"SELECT rowid FROM rollouts{where} {order}",
                                                 params + [per_page, offset])]
            total = None
        if total is None:
            total = int(self.query(f"SELECT COUNT(*) FROM rollouts{by}{where}", params)[0][0])
        by_rowid: dict[int, dict[str, Any]] = {}
        if ids:
            marks = ", ".join("?" * len(ids))
            for r in self.query(f"SELECT rowid AS rid, {LIST_COLS} FROM rollouts WHERE rowid IN ({marks})", ids):
                d = dict(r)
                by_rowid[d.pop("rid")] = d
        rows = [by_rowid[i] for i in ids if i in by_rowid]
        calls: dict[str, tuple[int, int]] = {}
        if rows:
            marks = ", ".join("?" * len(rows))
            for r in self.query(f"SELECT rollout_id, COUNT(*), SUM(length(completion_ids)) / 4 FROM llm_calls "
                                f"WHERE rollout_id IN ({marks}) GROUP BY rollout_id", [d["id"] for d in rows]):
                calls[r[0]] = (int(r[1]), int(r[2] or 0))
        for d in rows:
            timings = json.loads(d.pop("timings_json") or "{}")
            d["duration_s"] = timings.get("total_s")
            d["turns"], d["completion_tokens"] = calls.get(d["id"], (0, 0))
        return Page(rows=rows, total=total, page=page, per_page=per_page, facets=self.facets())

    def facets(self) -> dict[str, list[str]]:
        """Distinct values for the filter drop-downs: one index seek per value (a loose index scan)."""
        def distinct(col: str) -> list[str]:
            rows = self.query(f"WITH RECURSIVE d(v) AS (SELECT MIN({col}) FROM rollouts UNION ALL "
                              f"SELECT (SELECT MIN({col}) FROM rollouts WHERE {col} > d.v) FROM d "
                              "WHERE d.v IS NOT NULL) SELECT v FROM d WHERE v IS NOT NULL LIMIT 500")
            return [str(r[0]) for r in rows]

        return self.cached(("facets",), lambda: {c: distinct(c) for c in ("harness", "outcome", "split")})

    def rollout(self, rollout_id: str) -> dict[str, Any] | None:
        rows = self.query("SELECT * FROM rollouts WHERE id = ?", (rollout_id,))
        if not rows:
            return None
        d = dict(rows[0])
        d["report"] = json.loads(d.pop("report_json")) if d.get("report_json") else None
        d["timings"] = json.loads(d.pop("timings_json") or "{}")
        return d

    def calls(self, rollout_id: str) -> list[LLMCall]:
        return read_calls(self.conn(), rollout_id)

    def light_calls(self, rollout_ids: list[str]) -> dict[str, list[LLMCall]]:
        """Calls without token arrays (for behaviour analytics): request, text, tool calls, finish reason."""
        return read_light_calls(self.conn(), rollout_ids)

    # ---- aggregates --------------------------------------------------------------------------------
    def outcome_counts(self, split: str | None = None) -> OutcomeMatrix:
        """Finished rollouts per step and outcome, for one split or all (None)."""
        if split == "train":
            return self.train_outcomes()
        cond = "outcome IS NOT NULL" + (" AND split = ?" if split else "")
        m = OutcomeMatrix()
        m.add_rows(self.query(f"SELECT step, outcome, COUNT(*) FROM rollouts WHERE {cond} GROUP BY step, outcome "
                              "ORDER BY step", (split,) if split else ()))
        return m

    def train_outcomes(self) -> OutcomeMatrix:
        """Train rollouts per step and outcome. Steps whose metrics are written are final: they are counted
        once and kept; only the steps after them are counted again."""
        closed = self.closed_step()
        q = ("SELECT step, outcome, COUNT(*) FROM rollouts WHERE split = 'train' AND step > ? AND step <= ? "
             "AND outcome IS NOT NULL GROUP BY step, outcome ORDER BY step")
        with self._matrix_lock:
            upto = -(2**62) if self._matrix_upto is None else self._matrix_upto
            if closed is not None and closed > upto:
                self._matrix.add_rows(self.query(q, (upto, closed)))
                self._matrix_upto = upto = closed
            m = self._matrix.copy()
        m.add_rows(self.query(q, (upto, 2**62)))
        return m

    def outcome_totals(self) -> dict[str, int]:
        """Rollouts per outcome over all splits ("pending" for unfinished ones)."""
        totals = dict(self.train_outcomes().totals)
        by_split = self._by("monitor_rollouts_split_step")  # a range of splits, not a scan of every rollout
        for sql in (f"SELECT outcome, COUNT(*) FROM rollouts{by_split} WHERE split < 'train' GROUP BY outcome",
                    f"SELECT outcome, COUNT(*) FROM rollouts{by_split} WHERE split > 'train' GROUP BY outcome",
                    f"SELECT outcome, COUNT(*) FROM rollouts{by_split} WHERE split IS NULL GROUP BY outcome",
                    (f"SELECT NULL, COUNT(*) FROM rollouts{self._by('monitor_rollouts_outcome_step')} "
                     "WHERE outcome IS NULL AND split = 'train'")):
            for r in self.query(sql):
                if r[1]:
                    k = r[0] or "pending"
                    totals[k] = totals.get(k, 0) + int(r[1])
        return totals

    def eval_pass_rates(self) -> dict[str, list[tuple[int, float, int]]]:
        """split -> [(step, resolved share, rollouts)] for evaluation rollouts (split eval-*)."""
        rows = self.query("SELECT split, step, COUNT(*), SUM(outcome = 'resolved') FROM rollouts "
                          "WHERE split >= 'eval-' AND split < 'eval.' AND outcome IS NOT NULL "
                          "GROUP BY split, step ORDER BY split, step")
        out: dict[str, list[tuple[int, float, int]]] = {}
        for r in rows:
            out.setdefault(str(r[0])[5:], []).append((int(r[1]), (r[3] or 0) / max(r[2], 1), int(r[2])))
        return out

    def group_stats(self) -> dict[int, tuple[int, dict[float, int]]]:
        """Train step -> (groups with >= 2 rewarded rollouts, {reward: groups whose every reward is it}); only
        such groups can train nothing, and whether they do depends on the advantage (`carries_signal`).
        Closed steps are computed once."""
        q = ("SELECT step, lo, COUNT(*), SUM(lo = hi) FROM ("
             " SELECT step, group_id, COUNT(reward) n, MIN(reward) lo, MAX(reward) hi FROM rollouts"
             " WHERE split = 'train' AND step > ? AND step <= ? AND reward IS NOT NULL GROUP BY step, group_id"
             " HAVING n >= 2) GROUP BY step, lo")

        def rows(lo: int, hi: int) -> dict[int, tuple[int, dict[float, int]]]:
            out: dict[int, tuple[int, dict[float, int]]] = {}
            for step, reward, n, equal in self.query(q, (lo, hi)):
                total, uniform = out.get(int(step), (0, {}))
                if equal:
                    uniform[float(reward)] = int(equal)
                out[int(step)] = (total + int(n), uniform)
            return out

        closed = self.closed_step()
        with self._matrix_lock:
            upto = -(2**62) if self._groups_upto is None else self._groups_upto
            if closed is not None and closed > upto:
                self._groups.update(rows(upto, closed))
                self._groups_upto = upto = closed
            out = dict(self._groups)
        out.update(rows(upto, 2**62))
        return out

    def recent_failures(self, limit: int = 10) -> list[dict[str, Any]]:
        rows = self.query("SELECT id, step, task_id, split, outcome, outcome_reason FROM rollouts "
                          "WHERE outcome IS NOT NULL AND outcome != 'resolved' ORDER BY step DESC, updated DESC "
                          "LIMIT ?", (limit,))
        return [dict(r) for r in rows]

    def failure_examples(self, outcome: str, limit: int = 5) -> list[dict[str, Any]]:
        rows = self.query("SELECT id, step, task_id, split, outcome_reason FROM rollouts WHERE outcome = ? "
                          "ORDER BY step DESC, updated DESC LIMIT ?", (outcome, limit))
        return [dict(r) for r in rows]

    def failure_reasons(self, limit: int = 200, window: int = 5000) -> list[tuple[str, str, int, int]]:
        """(outcome, reason prefix, count, last step) over the latest `window` failures, most frequent first."""
        rows = self.query("SELECT outcome, substr(outcome_reason, 1, 90) r, COUNT(*) c, MAX(step) FROM ("
                          " SELECT outcome, outcome_reason, step FROM rollouts"
                          " WHERE outcome IS NOT NULL AND outcome != 'resolved' ORDER BY step DESC LIMIT ?)"
                          " GROUP BY outcome, r ORDER BY c DESC LIMIT ?", (window, limit))
        return [(str(r[0]), str(r[1] or ""), int(r[2]), int(r[3])) for r in rows]

    def rollout_ids_by_step(self, split: str = "train") -> dict[int, list[str]]:
        rows = self.query("SELECT step, id FROM rollouts WHERE split = ? AND outcome IS NOT NULL "
                          "ORDER BY step, id", (split,))
        out: dict[int, list[str]] = {}
        for r in rows:
            out.setdefault(int(r[0]), []).append(str(r[1]))
        return out

    def harness_of(self, rollout_ids: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for i in range(0, len(rollout_ids), 500):
            chunk = rollout_ids[i:i + 500]
            marks = ", ".join("?" * len(chunk))
            for r in self.query(f"SELECT id, harness FROM rollouts WHERE id IN ({marks})", chunk):
                out[str(r[0])] = str(r[1] or "")
        return out
