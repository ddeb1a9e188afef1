"""SQLite run store: every LLM call is persisted the moment it happens.

WAL mode so the dashboard (another connection or process) reads while the driver
writes. One connection, guarded by a lock, is shared by the asyncio loop and worker
threads (``check_same_thread=False``). Token arrays are stored compactly as
little-endian int32 / float32 bytes; routed experts as int32 with a two-int header
(layers, top_k) so the [tokens][layers][top_k] shape survives the round trip.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, Self

import numpy as np

from legorl.records import (
    ABANDONED,
    MAIN_SESSION,
    REASONING_DROPPED,
    GraderReport,
    LLMCall,
    Outcome,
    Rollout,
    ToolCall,
)

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT, created REAL, config_json TEXT
);
CREATE TABLE IF NOT EXISTS steps (step INTEGER PRIMARY KEY, t REAL, metrics_json TEXT);
CREATE TABLE IF NOT EXISTS trained_samples (
    step INTEGER, rollout_id TEXT, sequences INTEGER, advantage REAL, PRIMARY KEY (step, rollout_id)
);
CREATE TABLE IF NOT EXISTS rollouts (
    id TEXT PRIMARY KEY, step INTEGER, task_id TEXT, group_id TEXT, sample_index INTEGER,
    harness TEXT, split TEXT, outcome TEXT, outcome_reason TEXT, reward REAL, diff TEXT,
    report_json TEXT, weight_version_start INTEGER, weight_version_end INTEGER,
    timings_json TEXT, created REAL, updated REAL
);
CREATE INDEX IF NOT EXISTS rollouts_step ON rollouts(step);
CREATE TABLE IF NOT EXISTS llm_calls (
    id INTEGER PRIMARY KEY AUTOINCREMENT, rollout_id TEXT, idx INTEGER, wire_format TEXT,
    request_json TEXT, prompt_ids BLOB, completion_ids BLOB, completion_logprobs BLOB,
    finish_reason TEXT, weight_version INTEGER, completion_text TEXT, tool_calls_json TEXT,
    parent_index INTEGER, segment_break TEXT, naive_prompt_differs INTEGER,
    sampled_from_policy INTEGER, routed_experts BLOB, t_start REAL, t_end REAL, session TEXT NOT NULL DEFAULT 'main',
    malformed_tool_call TEXT, token_versions BLOB
);
CREATE INDEX IF NOT EXISTS llm_calls_rollout ON llm_calls(rollout_id);
"""

Sessions = Literal["main", "side", "all"]  # which of a rollout's sessions a read returns

_CALL_COLS = (
    "rollout_id, idx, wire_format, request_json, prompt_ids, completion_ids, completion_logprobs, "
    "finish_reason, weight_version, completion_text, tool_calls_json, parent_index, segment_break, "
    "naive_prompt_differs, sampled_from_policy, routed_experts, t_start, t_end, session, malformed_tool_call, "
    "token_versions"
)


def ids_to_blob(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=_I32).tobytes()


def blob_to_ids(b: bytes | None) -> list[int]:
    return np.frombuffer(b, dtype=_I32).tolist() if b else []


def floats_to_blob(xs: list[float]) -> bytes:
    return np.asarray(xs, dtype=_F32).tobytes()


def blob_to_floats(b: bytes | None) -> list[float]:
    return np.frombuffer(b, dtype=_F32).tolist() if b else []


def routes_to_blob(routes: list[list[list[int]]] | None) -> bytes | None:
    if routes is None:
        return None
    if len(routes) == 0:
        return np.zeros(2, dtype=_I32).tobytes()
    arr = np.asarray(routes, dtype=_I32)
    if arr.ndim != 3:
        raise ValueError(f"routed_experts must be [tokens][layers][top_k], got shape {arr.shape}")
    return np.asarray(arr.shape[1:], dtype=_I32).tobytes() + arr.tobytes()


def blob_to_routes(b: bytes | None) -> list[list[list[int]]] | None:
    if b is None:
        return None
    layers, top_k = np.frombuffer(b[:8], dtype=_I32).tolist()
    if layers * top_k == 0:
        return []
    return np.frombuffer(b[8:], dtype=_I32).reshape(-1, layers, top_k).tolist()


class Store:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=30.0)
        self._conn.row_factory = sqlite3.Row
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL is durable across process crashes in WAL mode and far cheaper than FULL per commit.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA busy_timeout=30000")
            self._conn.executescript(_SCHEMA)
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(llm_calls)")}
            if "session" not in columns:  # a store written before side sessions: every call was the agent's
                self._conn.execute(f"ALTER TABLE llm_calls ADD COLUMN session TEXT NOT NULL DEFAULT '{MAIN_SESSION}'")
            if "malformed_tool_call" not in columns:  # a store written before malformed tool calls were recorded
                self._conn.execute("ALTER TABLE llm_calls ADD COLUMN malformed_tool_call TEXT")
            if "token_versions" not in columns:  # a store written before asynchronous RL
                self._conn.execute("ALTER TABLE llm_calls ADD COLUMN token_versions BLOB")
            self._conn.commit()

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def journal_mode(self) -> str:
        return str(self._query("PRAGMA journal_mode")[0][0])

    def _write(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        with self._lock:
            cur = self._conn.execute(sql, params)
            self._conn.commit()
            return int(cur.lastrowid or 0)

    def _update(self, sql: str, params: tuple[Any, ...] = ()) -> int:
        """An UPDATE/DELETE; returns the number of rows it changed."""
        with self._lock:
            cur = self._conn.execute(sql, params)
            self._conn.commit()
            return cur.rowcount

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    # ---- writes -----------------------------------------------------------------------------

    def add_run(self, name: str, config: dict[str, Any]) -> int:
        return self._write(
            "INSERT INTO runs (name, created, config_json) VALUES (?, ?, ?)",
            (name, time.time(), json.dumps(config, default=str)),
        )

    def add_call(self, call: LLMCall) -> int:
        """Persist one call now (committed before returning). Returns its row id."""
        params = (
            call.rollout_id,
            call.index,
            call.wire_format,
            json.dumps(call.request, default=str),
            ids_to_blob(call.prompt_ids),
            ids_to_blob(call.completion_ids),
            floats_to_blob(call.completion_logprobs),
            call.finish_reason,
            call.weight_version,
            call.completion_text,
            json.dumps([tc.__dict__ for tc in call.tool_calls]),
            call.parent_index,
            call.segment_break,
            int(call.naive_prompt_differs),
            int(call.sampled_from_policy),
            routes_to_blob(call.routed_experts),
            call.t_start,
            call.t_end,
            call.session,
            call.malformed_tool_call,
            ids_to_blob(call.token_versions) if call.token_versions is not None else None,
        )
        marks = ", ".join("?" * len(params))
        return self._write(f"INSERT INTO llm_calls ({_CALL_COLS}) VALUES ({marks})", params)

    def upsert_rollout(self, r: Rollout) -> None:
        """Insert or update a rollout's row (its calls are stored separately by add_call)."""
        now = time.time()
        report = json.dumps(r.report.to_dict()) if r.report is not None else None
        self._write(
            """INSERT INTO rollouts (id, step, task_id, group_id, sample_index, harness, split, outcome,
                   outcome_reason, reward, diff, report_json, weight_version_start, weight_version_end,
                   timings_json, created, updated)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
               ON CONFLICT(id) DO UPDATE SET
                   step=excluded.step, task_id=excluded.task_id, group_id=excluded.group_id,
                   sample_index=excluded.sample_index, harness=excluded.harness, split=excluded.split,
                   outcome=excluded.outcome, outcome_reason=excluded.outcome_reason,
                   reward=excluded.reward, diff=excluded.diff, report_json=excluded.report_json,
                   weight_version_start=excluded.weight_version_start,
                   weight_version_end=excluded.weight_version_end,
                   timings_json=excluded.timings_json, updated=excluded.updated""",
            (
                r.id,
                r.step,
                r.task_id,
                r.group_id,
                r.sample_index,
                r.harness,
                r.split,
                r.outcome.value if r.outcome is not None else None,
                r.outcome_reason,
                r.reward,
                r.diff,
                report,
                r.weight_version_start,
                r.weight_version_end,
                json.dumps(r.timings),
                now,
                now,
            ),
        )

    def add_step(self, step: int, metrics: dict[str, float]) -> None:
        self._write(
            "INSERT OR REPLACE INTO steps (step, t, metrics_json) VALUES (?, ?, ?)",
            (step, time.time(), json.dumps(metrics)),
        )

    def add_trained(self, step: int, samples: list[tuple[str, int, float]]) -> None:
        """Which rollouts a step trained on: (rollout id, sequences, advantage). Every sample is traceable."""
        with self._lock:
            self._conn.execute("DELETE FROM trained_samples WHERE step = ?", (step,))
            self._conn.executemany("INSERT INTO trained_samples VALUES (?, ?, ?, ?)",
                                   [(step, rid, n, adv) for rid, n, adv in samples])
            self._conn.commit()

    def prepare_resume(self, last_done_step: int) -> dict[str, int]:
        """Before resuming after `last_done_step`: what the killed driver left half-done.

        Rollouts it never finished become masked `agent_crash`; the steps after the last
        checkpoint are redone, so their step rows go and their rollouts are marked superseded
        (kept for inspection, never trained on again).
        """
        reason = "the driver was killed during this rollout; its step was redone on resume"
        n_open = self._update("UPDATE rollouts SET outcome = 'agent_crash', outcome_reason = ?, reward = NULL "
                             "WHERE outcome IS NULL", (reason,))
        n_old = self._update("UPDATE rollouts SET split = 'superseded', reward = NULL "
                            "WHERE step > ? AND split = 'train'", (last_done_step,))
        n_steps = self._update("DELETE FROM steps WHERE step > ?", (last_done_step,))
        self._update("DELETE FROM trained_samples WHERE step > ?", (last_done_step,))
        return {"abandoned_rollouts": n_open, "superseded_rollouts": n_old, "dropped_steps": n_steps}

    # ---- reads ------------------------------------------------------------------------------

    def calls_for(self, rollout_id: str, abandoned: bool = False, sessions: Sessions = "main") -> list[LLMCall]:
        """A rollout's answered calls in order, of its main session by default (what outcomes and training
        read); with `abandoned`, also the calls whose client went away before the answer (finish_reason
        ABANDONED, no completion); `sessions` "side" gives its side sessions' calls, "all" every call."""
        with self._lock:
            return read_calls(self._conn, rollout_id, abandoned, sessions)

    def rollout(self, rollout_id: str, with_calls: bool = True) -> Rollout | None:
        rows = self._query("SELECT * FROM rollouts WHERE id = ?", (rollout_id,))
        if not rows:
            return None
        r = _row_to_rollout(rows[0])
        if with_calls:
            self.load_calls(r)
        return r

    def load_calls(self, r: Rollout) -> None:
        """`r.calls` (its main session's answered calls) and `r.side_calls`, in one read."""
        calls = self.calls_for(r.id, sessions="all")
        r.calls = [c for c in calls if c.session == MAIN_SESSION]
        r.side_calls = [c for c in calls if c.session != MAIN_SESSION]

    def rollouts(
        self, step: int | None = None, split: str | None = None, with_calls: bool = False
    ) -> list[Rollout]:
        where, params = [], []
        if step is not None:
            where.append("step = ?")
            params.append(step)
        if split is not None:
            where.append("split = ?")
            params.append(split)
        sql = "SELECT * FROM rollouts" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self._query(sql + " ORDER BY step, group_id, sample_index, id", tuple(params))
        out = [_row_to_rollout(row) for row in rows]
        if with_calls:
            for r in out:
                self.load_calls(r)
        return out

    def last_step(self) -> int | None:
        row = self._query("SELECT MAX(step) FROM steps")[0]
        return None if row[0] is None else int(row[0])

    def step_numbers(self) -> list[int]:
        return [int(r["step"]) for r in self._query("SELECT step FROM steps ORDER BY step")]

    def step_metrics(self, step: int) -> dict[str, float]:
        rows = self._query("SELECT metrics_json FROM steps WHERE step = ?", (step,))
        return json.loads(rows[0][0]) if rows else {}

    def report(self, decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
        """Run summary: counts, token-fidelity check of every call, and the last step's metrics."""
        by_outcome: dict[str, int] = {}
        for row in self._query("SELECT outcome, COUNT(*) FROM rollouts GROUP BY outcome"):
            by_outcome[row[0] if row[0] is not None else "pending"] = int(row[1])
        by_outcome["total"] = sum(by_outcome.values())
        fid = {"checked": 0, "violations": 0, "segments": 0, "bridge_hits": 0, "drift_prevented": 0,
               "reasoning_dropped": 0}
        examples: list[dict[str, Any]] = []
        abandoned = 0
        for row in self._iter_rows(
            "SELECT id, rollout_id, idx, completion_ids, completion_logprobs, completion_text, parent_index,"
            " segment_break, naive_prompt_differs, finish_reason FROM llm_calls ORDER BY id"
        ):
            if row["finish_reason"] == ABANDONED:  # no completion to check: never answered, never trained
                abandoned += 1
                continue
            fid["checked"] += 1
            ids = blob_to_ids(row["completion_ids"])
            n_lp = len(row["completion_logprobs"] or b"") // _F32.itemsize
            why = None
            if not ids:
                why = "empty completion ids"
            elif len(ids) != n_lp:
                why = f"{len(ids)} ids but {n_lp} logprobs"
            elif decode is not None and decode(ids) != (row["completion_text"] or ""):
                why = "decode(completion_ids) != completion_text"
            if why:
                fid["violations"] += 1
                if len(examples) < 20:
                    examples.append({"rollout_id": row["rollout_id"], "index": row["idx"], "why": why})
            if row["parent_index"] is None or row["segment_break"] is not None:
                fid["segments"] += 1
            if row["parent_index"] is not None:
                fid["bridge_hits"] += 1
            if row["naive_prompt_differs"]:
                fid["drift_prevented"] += 1
            if row["segment_break"] == REASONING_DROPPED:  # a new segment: the prompt lost its parent's reasoning
                fid["reasoning_dropped"] += 1
        fid["reasoning_dropped_share"] = fid["reasoning_dropped"] / fid["checked"] if fid["checked"] else 0.0
        last = self.last_step()
        return {
            "steps": int(self._query("SELECT COUNT(*) FROM steps")[0][0]),
            "rollouts": by_outcome,
            "llm_calls": fid["checked"],
            "abandoned_calls": abandoned,
            "fidelity": {**fid, "examples": examples},
            "integrity": self._integrity(),
            "faults": self._injected_faults(),
            "last_step": self.step_metrics(last) if last is not None else {},
        }

    def _integrity(self) -> dict[str, int]:
        """Every trained sample must trace back to one graded, trainable rollout with its calls."""
        q = self._query
        total = int(q("SELECT COUNT(*) FROM trained_samples")[0][0])
        untraceable = int(q(
            "SELECT COUNT(*) FROM trained_samples t LEFT JOIN rollouts r ON r.id = t.rollout_id "
            "WHERE r.id IS NULL OR NOT EXISTS (SELECT 1 FROM llm_calls c WHERE c.rollout_id = t.rollout_id)")[0][0])
        from_masked = int(q(
            "SELECT COUNT(*) FROM trained_samples t JOIN rollouts r ON r.id = t.rollout_id "
            "WHERE r.reward IS NULL OR r.outcome IS NULL")[0][0])
        return {"trained_samples": total, "untraceable_samples": untraceable, "trained_from_masked": from_masked}

    def _injected_faults(self) -> dict[str, dict[str, int]]:
        """Chaos mode: for each injected fault, the outcomes of the rollouts it hit."""
        out: dict[str, dict[str, int]] = {}
        for row in self._query("SELECT outcome, outcome_reason FROM rollouts WHERE outcome_reason LIKE '%[injected:%'"):
            names = row[1].rsplit("[injected:", 1)[1].rstrip("]").split(",")
            for name in (n.strip() for n in names):
                by = out.setdefault(name, {})
                by[row[0]] = by.get(row[0], 0) + 1
        return out

    def export_calls_jsonl(self, path: str | Path) -> int:
        """One JSON object per call (token arrays as lists). Returns the number written."""
        n = 0
        with open(path, "w", encoding="utf-8") as f:
            for row in self._iter_rows(f"SELECT {_CALL_COLS} FROM llm_calls ORDER BY rollout_id, idx, id"):
                c = _row_to_call(row)
                d = dict(c.__dict__)
                d["tool_calls"] = [tc.__dict__ for tc in c.tool_calls]
                f.write(json.dumps(d) + "\n")
                n += 1
        return n

    def export_calls_parquet(self, path: str | Path, batch: int = 2000) -> int:
        """The same records as the JSONL export, as a Parquet file (needs pyarrow)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None
        n = 0
        rows: list[dict[str, Any]] = []

        def flush() -> None:
            nonlocal writer
            table = pa.Table.from_pylist(rows)
            if writer is None:
                writer = pq.ParquetWriter(str(path), table.schema)
            writer.write_table(table)
            rows.clear()

        for row in self._iter_rows(f"SELECT {_CALL_COLS} FROM llm_calls ORDER BY rollout_id, idx, id"):
            c = _row_to_call(row)
            d = dict(c.__dict__)
            d["request"] = json.dumps(c.request)
            d["tool_calls"] = json.dumps([tc.__dict__ for tc in c.tool_calls])
            d["routed_experts"] = json.dumps(c.routed_experts) if c.routed_experts is not None else None
            rows.append(d)
            n += 1
            if len(rows) >= batch:
                flush()
        if rows:
            flush()
        if writer is not None:
            writer.close()
        return n

    def _iter_rows(self, sql: str, batch: int = 500) -> Iterator[sqlite3.Row]:
        """Stream rows in batches on a snapshot cursor, holding the lock only per batch.

        Reads on a separate connection so writers (same process) are not blocked for the
        whole scan; WAL gives this reader a consistent snapshot.
        """
        conn = sqlite3.connect(str(self.path), timeout=30.0)
        conn.row_factory = sqlite3.Row
        try:
            cur = conn.execute(sql)
            while rows := cur.fetchmany(batch):
                yield from rows
        finally:
            conn.close()


# ---- reading calls on any connection to a store file (the dashboard opens its own: monitor/db.py) --------


def read_calls(conn: sqlite3.Connection, rollout_id: str, abandoned: bool = True,
               sessions: Sessions = "all") -> list[LLMCall]:
    """One rollout's calls in order, token arrays included; `abandoned=False` leaves out the calls whose
    client went away before the answer (finish_reason ABANDONED: an attempt that a retry may repeat
    under the same index, never trained); `sessions` picks the main session's, the side sessions' or all."""
    cur = conn.cursor()
    cur.row_factory = sqlite3.Row
    only, params = "", [rollout_id]
    if not abandoned:
        only += " AND finish_reason IS NOT ?"
        params.append(ABANDONED)
    if sessions != "all":
        only += " AND session = ?" if sessions == "main" else " AND session != ?"
        params.append(MAIN_SESSION)
    rows = cur.execute(f"SELECT {_CALL_COLS} FROM llm_calls WHERE rollout_id = ?{only} ORDER BY idx, id", params)
    return [_row_to_call(row) for row in rows.fetchall()]


def read_light_calls(conn: sqlite3.Connection, rollout_ids: list[str]) -> dict[str, list[LLMCall]]:
    """The main-session calls of each rollout without their token arrays (request, text, tool calls, finish
    reason): what behaviour analytics read, at a fraction of the cost."""
    out: dict[str, list[LLMCall]] = {rid: [] for rid in rollout_ids}
    for i in range(0, len(rollout_ids), 500):
        chunk = rollout_ids[i:i + 500]
        marks = ", ".join("?" * len(chunk))
        for r in conn.execute("SELECT rollout_id, idx, wire_format, request_json, finish_reason, completion_text, "
                              f"tool_calls_json FROM llm_calls WHERE rollout_id IN ({marks}) AND session = ? "
                              "ORDER BY idx, id", [*chunk, MAIN_SESSION]):
            out[r[0]].append(LLMCall(
                rollout_id=r[0], index=r[1], wire_format=r[2], request=json.loads(r[3] or "{}"),
                prompt_ids=[], completion_ids=[], completion_logprobs=[], finish_reason=r[4] or "",
                weight_version=0, completion_text=r[5] or "", tool_calls=_tool_calls(r[6])))
    return out


def _tool_calls(tool_calls_json: str | None) -> list[ToolCall]:
    return [ToolCall(**d) for d in json.loads(tool_calls_json or "[]")]


def _row_to_call(row: sqlite3.Row) -> LLMCall:
    return LLMCall(
        rollout_id=row["rollout_id"],
        index=row["idx"],
        wire_format=row["wire_format"],
        request=json.loads(row["request_json"]) if row["request_json"] else {},
        prompt_ids=blob_to_ids(row["prompt_ids"]),
        completion_ids=blob_to_ids(row["completion_ids"]),
        completion_logprobs=blob_to_floats(row["completion_logprobs"]),
        finish_reason=row["finish_reason"],
        weight_version=row["weight_version"],
        completion_text=row["completion_text"] or "",
        tool_calls=_tool_calls(row["tool_calls_json"]),
        parent_index=row["parent_index"],
        segment_break=row["segment_break"],
        naive_prompt_differs=bool(row["naive_prompt_differs"]),
        sampled_from_policy=bool(row["sampled_from_policy"]),
        routed_experts=blob_to_routes(row["routed_experts"]),
        t_start=row["t_start"] or 0.0,
        t_end=row["t_end"] or 0.0,
        session=row["session"] or MAIN_SESSION,
        malformed_tool_call=row["malformed_tool_call"],
        token_versions=blob_to_ids(row["token_versions"]) if row["token_versions"] is not None else None,
    )


def _row_to_rollout(row: sqlite3.Row) -> Rollout:
    report = None
    if row["report_json"]:
        d = json.loads(row["report_json"])
        d["outcome"] = Outcome(d["outcome"])
        report = GraderReport(**d)
    return Rollout(
        id=row["id"],
        step=row["step"],
        task_id=row["task_id"],
        group_id=row["group_id"],
        sample_index=row["sample_index"],
        harness=row["harness"],
        outcome=Outcome(row["outcome"]) if row["outcome"] else None,
        outcome_reason=row["outcome_reason"] or "",
        reward=row["reward"],
        diff=row["diff"] or "",
        report=report,
        weight_version_start=row["weight_version_start"] or 0,
        weight_version_end=row["weight_version_end"] or 0,
        timings=json.loads(row["timings_json"] or "{}"),
        split=row["split"] or "train",
    )
