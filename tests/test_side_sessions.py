"""Side sessions: a harness's side calls (a title, a check) are recorded apart from its agent's turns.

Through the real OpenAI SDK against the proxy: a session opened with a harness's `call_kind` sends
tool-less requests to a side session, which keeps its own chain and counters while the agent's
chain, turn limit and outcome facts stay whole; the store reads the main session by default, and
the rollout trains its side calls only when asked.
"""

from __future__ import annotations

import asyncio
import sqlite3

import openai
import pytest
from test_proxy import Harness, check_fidelity

from legorl.config import load_config
from legorl.engine import ScriptedEngine
from legorl.harness.in_sandbox import side_unless_tools
from legorl.models import render_tool_call_text
from legorl.pipeline import Driver
from legorl.records import MAIN_SESSION, LLMCall, Outcome, Rollout
from legorl.store import Store
from legorl.train.sequences import build_sequences

BASH = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
    "command": {"type": "string"}}}}}
TASK = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
TITLE = [{"role": "system", "content": "You are a title generator."}, {"role": "user", "content": "Fix it."}]


async def episode(tokenizer, max_calls: int | None = None) -> tuple[list[LLMCall], object, list[str]]:
    """Title, agent turn 1, title again (a retitle), agent turn 2: the two chains interleaved."""
    engine = ScriptedEngine(tokenizer)
    replies = iter(["A title", render_tool_call_text("bash", {"command": "ls"}), "A better title", "Done."])
    engine.set_script("r", lambda i, ids: next(replies))
    errors = []
    async with Harness(engine, tokenizer) as h:
        s = h.proxy.open_session("r", max_calls=max_calls, call_kind=side_unless_tools)  # the CLI adapters' rule
        client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x", max_retries=0)
        t1 = await client.chat.completions.create(model="m", messages=TITLE)
        a1 = await client.chat.completions.create(model="m", messages=TASK, tools=[BASH])
        retitle = TITLE + [t1.choices[0].message.model_dump(), {"role": "user", "content": "Shorter."}]
        await client.chat.completions.create(model="m", messages=retitle)
        tc = a1.choices[0].message.tool_calls[0]
        turn2 = TASK + [a1.choices[0].message.model_dump(), {"role": "tool", "tool_call_id": tc.id, "content": "a.py"}]
        try:
            await client.chat.completions.create(model="m", messages=turn2, tools=[BASH])
        except openai.APIError as e:
            errors.append(str(e))
        stats = h.proxy.stats()
    return h.calls, (s, stats), errors


def test_side_calls_keep_their_own_chain_and_leave_the_agents_whole(tokenizer):
    calls, (session, stats), errors = asyncio.run(episode(tokenizer))
    assert not errors
    assert [(c.index, c.session) for c in calls] == [(0, "side"), (1, MAIN_SESSION), (2, "side"), (3, MAIN_SESSION)]
    assert [c.parent_index for c in calls] == [None, None, 0, 1]  # each chain extends its own calls only
    assert all(c.segment_break is None for c in calls)
    check_fidelity(tokenizer, calls)
    assert session.n_calls == 2 and session.sides["side"].n_calls == 2
    assert stats["calls"] == 2 and stats["side_calls"] == {"side": 2} and stats["segments"] == 1
    main = [c for c in calls if c.session == MAIN_SESSION]
    assert len(build_sequences("r", main, 1.0, include_unsampled=True)) == 1
    assert len(build_sequences("r", calls, 1.0, include_unsampled=True)) == 2  # trained apart when asked


def test_side_calls_do_not_count_against_the_turn_limit(tokenizer):
    calls, (session, _), errors = asyncio.run(episode(tokenizer, max_calls=2))
    assert not errors and len(calls) == 4 and session.errors == []
    calls, (session, _), errors = asyncio.run(episode(tokenizer, max_calls=1))
    assert "turn limit" in errors[0] and session.errors == ["max_turns"]
    assert [c.session for c in calls] == ["side", MAIN_SESSION, "side"]  # the side session went on


def test_the_store_reads_the_agents_calls_unless_asked_for_the_side_ones(tokenizer, tmp_path):
    calls, _, _ = asyncio.run(episode(tokenizer))
    store = Store(tmp_path / "store.sqlite")
    for c in calls:
        store.add_call(c)
    store.upsert_rollout(Rollout(id="r", step=0, task_id="t", group_id="g", sample_index=0, harness="opencode"))
    assert [c.index for c in store.calls_for("r")] == [1, 3]
    assert [(c.index, c.session) for c in store.calls_for("r", sessions="side")] == [(0, "side"), (2, "side")]
    assert len(store.calls_for("r", sessions="all")) == 4
    r = store.rollout("r")
    assert [c.index for c in r.calls] == [1, 3] and [c.index for c in r.side_calls] == [0, 2]


def test_a_store_written_before_side_sessions_reads_every_call_as_the_agents(tokenizer, tmp_path):
    calls, _, _ = asyncio.run(episode(tokenizer))
    path = tmp_path / "old.sqlite"
    Store(path).add_call(calls[1])
    with sqlite3.connect(path) as conn:  # the column an older legorl did not write
        conn.execute("ALTER TABLE llm_calls DROP COLUMN session")
    old = Store(path)
    assert [(c.index, c.session) for c in old.calls_for("r")] == [(1, MAIN_SESSION)]


@pytest.mark.parametrize("train_side_calls", [False, True])
def test_a_rollout_trains_its_side_calls_only_when_asked(tokenizer, train_side_calls):
    calls, _, _ = asyncio.run(episode(tokenizer))
    for c in calls:
        c.sampled_from_policy = True  # as the policy's samples are
    main, side = [c for c in calls if c.session == MAIN_SESSION], [c for c in calls if c.session != MAIN_SESSION]
    solved = Rollout(id="r", step=0, task_id="t", group_id="g", sample_index=0, harness="opencode", reward=1.0,
                     outcome=Outcome.RESOLVED, calls=main, side_calls=side)
    failed = Rollout(id="o", step=0, task_id="t", group_id="g", sample_index=1, harness="opencode", reward=0.0,
                     outcome=Outcome.UNRESOLVED, calls=main, side_calls=side)
    driver = Driver.__new__(Driver)  # Driver.sequences reads only its config
    driver.cfg = load_config(None, [f"rollout.train_side_calls={str(train_side_calls).lower()}"])
    seqs, _, _ = driver.sequences([solved, failed])
    assert sorted(q.rollout_id for q in seqs) == (["o", "o", "r", "r"] if train_side_calls else ["o", "r"])
