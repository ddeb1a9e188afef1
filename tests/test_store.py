"""The SQLite run store, on a real file: round trips, report, WAL concurrency."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from legorl.records import GraderReport, LLMCall, Outcome, Rollout, ToolCall
from legorl.store import Store


def _decode(ids: list[int]) -> str:
    return "".join(chr(97 + i % 26) for i in ids)


def _call(rid: str, index: int, parent: int | None = None, **kw) -> LLMCall:
    completion = kw.pop("completion", [3, 4, 2**31 - 1, 0])
    base: dict = {
        "rollout_id": rid,
        "index": index,
        "wire_format": "anthropic_messages",
        "request": {"model": "m", "messages": [{"role": "user", "content": "hi ✓"}]},
        "prompt_ids": [1, 2, 70000, 5] * (index + 1),
        "completion_ids": completion,
        "completion_logprobs": [-0.125, -(2.0**-20), -13.5, 0.0][: len(completion)],
        "finish_reason": "stop",
        "weight_version": index,
        "completion_text": _decode(completion),
        "tool_calls": [ToolCall(id="t1", name="bash", arguments='{"cmd": "ls"}')],
        "parent_index": parent,
        "t_start": 1.5,
        "t_end": 2.25,
    }
    base.update(kw)
    return LLMCall(**base)


def _rollout(rid: str, outcome: Outcome | None, step: int = 0, split: str = "train") -> Rollout:
    return Rollout(
        id=rid,
        step=step,
        task_id="t",
        group_id="g",
        sample_index=0,
        harness="mini",
        outcome=outcome,
        reward=1.0 if outcome == Outcome.RESOLVED else None,
        split=split,
    )


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "run" / "store.db")
    yield s
    s.close()


def test_call_round_trip_is_exact(store: Store) -> None:
    calls = [
        _call("r1", 0),
        _call("r1", 1, parent=0, naive_prompt_differs=True, routed_experts=[[[1, 2], [3, 4]]] * 4),
        _call("r1", 2, segment_break="history rewritten", sampled_from_policy=False),
    ]
    for c in reversed(calls):
        store.add_call(c)
    store.add_call(_call("other", 0))
    got = store.calls_for("r1")
    assert got == calls  # dataclass equality: every field, arrays exact
    # float32 storage (what engines produce): these values are exactly representable
    assert got[0].completion_logprobs[1] == -(2.0**-20)
    assert got[1].routed_experts == [[[1, 2], [3, 4]]] * 4
    assert store.calls_for("missing") == []


def test_arrays_are_compact_little_endian(store: Store, tmp_path: Path) -> None:
    store.add_call(_call("r1", 0))
    conn = sqlite3.connect(store.path)
    blob, lp = conn.execute("SELECT completion_ids, completion_logprobs FROM llm_calls").fetchone()
    conn.close()
    assert len(blob) == 4 * 4 and np.frombuffer(blob, "<i4").tolist() == [3, 4, 2**31 - 1, 0]
    assert len(lp) == 4 * 4


def test_rollouts_upsert_and_filter(store: Store) -> None:
    r = _rollout("a", None, step=1)
    store.upsert_rollout(r)
    r.outcome, r.reward = Outcome.RESOLVED, 1.0
    r.report = GraderReport(resolved=True, outcome=Outcome.RESOLVED, tests={"t::x": "passed"})
    r.timings = {"agent": 3.5}
    store.upsert_rollout(r)
    store.upsert_rollout(_rollout("b", Outcome.AGENT_TIMEOUT, step=1, split="eval"))
    store.upsert_rollout(_rollout("c", Outcome.UNRESOLVED, step=2))
    store.add_call(_call("a", 0))
    assert [x.id for x in store.rollouts()] == ["a", "b", "c"]
    (a,) = store.rollouts(step=1, split="train")
    assert a.outcome == Outcome.RESOLVED and a.reward == 1.0 and a.timings == {"agent": 3.5}
    assert a.report == r.report and a.calls == []
    assert [x.id for x in store.rollouts(split="eval")] == ["b"]
    (a,) = store.rollouts(step=1, split="train", with_calls=True)
    assert len(a.calls) == 1


def test_steps(store: Store) -> None:
    assert store.last_step() is None
    store.add_step(0, {"train/loss": 1.0})
    store.add_step(3, {"train/loss": 0.5})
    store.add_step(3, {"train/loss": 0.25})  # a re-logged step replaces the earlier one
    assert store.last_step() == 3
    assert store.report()["last_step"] == {"train/loss": 0.25}
    assert store.report()["steps"] == 2


def test_report_counts_and_fidelity(store: Store, tmp_path: Path) -> None:
    store.add_run("demo", {"lr": 1e-5})
    store.upsert_rollout(_rollout("a", Outcome.RESOLVED))
    store.upsert_rollout(_rollout("b", Outcome.RESOLVED))
    store.upsert_rollout(_rollout("c", Outcome.SANDBOX_ERROR))
    store.upsert_rollout(_rollout("d", None))
    store.add_call(_call("a", 0))
    store.add_call(_call("a", 1, parent=0, naive_prompt_differs=True))
    store.add_call(_call("a", 2, parent=1, segment_break="rewritten"))
    store.add_call(_call("b", 0))
    rep = store.report(decode=_decode)
    assert rep["rollouts"] == {"resolved": 2, "sandbox_error": 1, "pending": 1, "total": 4}
    assert rep["llm_calls"] == 4
    f = rep["fidelity"]
    assert (f["checked"], f["violations"], f["segments"], f["bridge_hits"], f["drift_prevented"]) == (
        4,
        0,
        3,
        2,
        1,
    )
    # bad calls: one logprob short, empty completion, text that is not decode(ids)
    short = _call("b", 1, parent=0)
    short.completion_logprobs = short.completion_logprobs[:-1]
    store.add_call(short)
    store.add_call(_call("b", 2, parent=1, completion=[], completion_text=""))
    store.add_call(_call("b", 3, parent=2, completion_text="re-rendered text"))
    rep = store.report(decode=_decode)
    assert rep["fidelity"]["violations"] == 3
    assert {e["index"] for e in rep["fidelity"]["examples"]} == {1, 2, 3}
    # without a decoder only the structural checks apply
    assert store.report()["fidelity"]["violations"] == 2

    out = tmp_path / "calls.jsonl"
    assert store.export_calls_jsonl(out) == 7
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["rollout_id"] == "a" and lines[0]["completion_ids"] == [3, 4, 2**31 - 1, 0]
    assert lines[0]["tool_calls"] == [{"id": "t1", "name": "bash", "arguments": '{"cmd": "ls"}'}]


def test_wal_and_reads_while_another_connection_writes(store: Store) -> None:
    assert store.journal_mode() == "wal"
    store.add_call(_call("r", 0))
    # another writer holds an open write transaction with an uncommitted call
    writer = sqlite3.connect(store.path, timeout=0.1)
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO llm_calls (rollout_id, idx) VALUES ('r', 99)")
    reader = Store(store.path)  # a second connection, e.g. the dashboard
    assert [c.index for c in reader.calls_for("r")] == [0]  # not blocked, sees committed data only
    assert reader.report()["llm_calls"] == 1
    writer.commit()
    assert [c.index for c in reader.calls_for("r")] == [0, 99]
    writer.close()
    reader.close()


def test_threads_share_one_store(store: Store) -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(25):
                store.add_call(_call(f"r{t}", i))
                store.calls_for(f"r{t}")
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert store.report()["llm_calls"] == 100


def test_other_process_reads_while_writing(store: Store) -> None:
    # A separate process reads the store from before the first commit until it sees the last one,
    # while this one keeps committing calls: it is never blocked, and no count ever goes back.
    code = (
        "import json, sys, time; from legorl.store import Store\n"
        "s = Store(sys.argv[1]); seen = [s.report()['llm_calls']]\n"
        "print('reading', flush=True)\n"
        "deadline = time.monotonic() + 60\n"
        "while seen[-1] < 150 and time.monotonic() < deadline:\n"
        "    seen.append(s.report()['llm_calls'])\n"
        "print(json.dumps({'first': seen[0], 'last': seen[-1], 'reads': len(seen),\n"
        "                  'ordered': all(a <= b for a, b in zip(seen, seen[1:]))}))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(store.path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "reading\n"  # the reader is in its loop before the first write
    for i in range(150):
        store.add_call(_call("r", i))
    out, _ = proc.communicate(timeout=90)
    assert proc.returncode == 0
    seen = json.loads(out)
    assert seen["first"] == 0 and seen["last"] == 150 and seen["ordered"], seen
