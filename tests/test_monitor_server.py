"""The dashboard's server: JSON API on real SQLite stores (synthetic and hand-built), auth, serving, CLI."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from legorl.monitor.db import RunDB, StoreMissing
from legorl.monitor.server import DashboardConfigError, check_bind, create_app, serve_dashboard
from legorl.monitor.synthetic import SyntheticSpec, build_synthetic_store
from legorl.records import GraderReport, LLMCall, Outcome, Rollout, ToolCall
from legorl.store import Store

LOCAL = "http://127.0.0.1"  # the dashboard answers loopback Hosts only (no token)


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("synth")
    build_synthetic_store(run / "store.sqlite", SyntheticSpec(steps=12, rollouts_per_step=12, calls_per_rollout=4))
    return run


@pytest.fixture(scope="module")
def client(synth: Path) -> TestClient:
    return TestClient(create_app(synth), base_url=LOCAL)


def sql(run: Path, q: str, *args: object) -> list[tuple]:
    with sqlite3.connect(run / "store.sqlite") as c:
        return c.execute(q, args).fetchall()


def test_indexes_are_added_on_open(client: TestClient, synth: Path) -> None:
    names = {r[0] for r in sql(synth, "SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"monitor_rollouts_outcome_step", "monitor_rollouts_task_step", "monitor_rollouts_split_group"} <= names
    plan = " ".join(r[3] for r in sql(synth, "EXPLAIN QUERY PLAN SELECT id FROM rollouts WHERE outcome = ? "
                                              "ORDER BY step DESC LIMIT 50", "unresolved"))
    assert "USING INDEX monitor_rollouts_outcome_step" in plan


def test_overview_curves(client: TestClient, synth: Path) -> None:
    d = client.get("/api/overview").json()
    charts = {c["id"]: c for c in d["charts"]}
    assert {"reward", "outcomes", "mismatch", "kl", "lengths", "turns", "tokens_per_s", "rollouts_per_min", "time",
            "train"} <= set(charts)
    assert charts["mismatch"]["x"] == list(range(12))
    names = {s["name"] for s in charts["reward"]["series"]}
    assert {"train reward (mean)", "train pass rate", "eval heldout pass@1"} <= names
    out = {s["name"]: s["values"] for s in charts["outcomes"]["series"]}
    per_step = dict(sql(synth, "SELECT outcome, COUNT(*) FROM rollouts WHERE split = 'train' AND step = 3 "
                               "GROUP BY outcome"))
    assert {k: v[3] for k, v in out.items() if v[3]} == per_step
    assert d["run"]["rollouts"] == sql(synth, "SELECT COUNT(*) FROM rollouts")[0][0]
    assert all(f["outcome"] != "resolved" for f in d["recent_failures"])


def test_rollouts_filter_sort_paginate(client: TestClient, synth: Path) -> None:
    failed = sql(synth, "SELECT COUNT(*) FROM rollouts WHERE outcome != 'resolved'")[0][0]
    d = client.get("/api/rollouts", params={"outcome": "failed", "per_page": 10}).json()
    assert d["total"] == failed and len(d["rows"]) == 10
    assert all(r["outcome"] != "resolved" for r in d["rows"])
    page2 = client.get("/api/rollouts", params={"outcome": "failed", "per_page": 10, "page": 2}).json()
    assert not {r["id"] for r in d["rows"]} & {r["id"] for r in page2["rows"]}

    d = client.get("/api/rollouts", params={"step": 5, "split": "train", "sort": "reward", "order": "asc"}).json()
    assert d["total"] == 12 and all(r["step"] == 5 for r in d["rows"])
    rewards = [r["reward"] for r in d["rows"]]
    assert rewards == sorted(rewards, key=lambda x: (x is not None, x))  # NULLs (masked) first in SQLite ASC

    task = d["rows"][0]["task_id"]
    by_task = client.get("/api/rollouts", params={"task": task[-4:]}).json()
    assert by_task["total"] >= 1 and all(task[-4:] in r["task_id"] for r in by_task["rows"])
    rew = client.get("/api/rollouts", params={"reward_min": 1, "harness": "codex"}).json()
    assert all(r["reward"] == 1.0 and r["harness"] == "codex" for r in rew["rows"])
    masked = client.get("/api/rollouts", params={"masked": "1"}).json()
    assert masked["total"] == sql(synth, "SELECT COUNT(*) FROM rollouts WHERE reward IS NULL")[0][0]
    row = d["rows"][0]
    assert row["turns"] == sql(synth, "SELECT COUNT(*) FROM llm_calls WHERE rollout_id = ?", row["id"])[0][0]
    assert set(d["facets"]["harness"]) == {"mini-swe-agent", "claude-code", "codex"}
    assert client.get("/api/rollouts", params={"step": "x"}).status_code == 400


def test_failures_behaviour_alarms(client: TestClient) -> None:
    f = client.get("/api/failures").json()
    assert f["table"] and all(t["examples"] for t in f["table"])
    assert sum(t["count"] for t in f["table"]) + f["resolved"] == f["total"]
    b = client.get("/api/behaviour").json()
    charts = {c["id"]: c for c in b["charts"]}
    assert {"b_turns", "b_tools", "b_verify", "b_text", "b_submit", "b_mix"} <= set(charts)
    assert 0.0 < b["latest"]["verify_after_edit_rate"] <= 1.0 and b["latest"]["tool_calls_per_turn"] > 0.5
    a = client.get("/api/alarms").json()
    assert {"alarms", "active", "config", "last_step"} <= set(a)


def test_pages_render(client: TestClient) -> None:
    for path in ["/", "/rollouts", "/failures", "/behaviour", "/alarms", "/rollout/any"]:
        r = client.get(path)
        assert r.status_code == 200 and '<script src="/static/app.js">' in r.text
    assert "drawChart" in client.get("/static/app.js").text or "render" in client.get("/static/charts.js").text
    assert client.get("/api/rollout/nope").status_code == 404


def hand_built(run: Path) -> str:
    """A two-call rollout where call 1 extends call 0 (so only its new tokens are 'new prompt')."""
    store = Store(run / "store.sqlite")
    store.add_run("hand", {})
    rid = "r-hand"
    store.upsert_rollout(Rollout(id=rid, step=0, task_id="t1", group_id="g", sample_index=0, harness="mini-swe-agent",
                                 outcome=Outcome.UNRESOLVED, outcome_reason="1 of 2 tests failed", reward=0.0,
                                 diff="--- a/x.py\n+++ b/x.py\n@@\n-a\n+b\n",
                                 report=GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason="1 failed",
                                                     tests={"t::a": "passed", "t::b": "failed"},
                                                     dropped_paths=["tests/conftest.py"], log_tail="1 failed")))
    req0 = {"messages": [{"role": "user", "content": "fix"}], "tools": [{"type": "function"}]}
    tc = ToolCall(id="c0", name="bash", arguments=json.dumps({"command": "sed -i 's/a/b/' x.py"}))
    store.add_call(LLMCall(rid, 0, "openai_chat", req0, [1, 2, 3], [4, 5], [-0.1, -2.0], "stop", 3, "ab",
                           tool_calls=[tc], routed_experts=[[[0, 1]], [[2, 3]]]))
    req1 = {"messages": req0["messages"] + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c0", "function": {"name": "bash",
                                                                                     "arguments": tc.arguments}}]},
        {"role": "tool", "tool_call_id": "c0", "content": "<returncode>0</returncode>"}], "tools": req0["tools"]}
    store.add_call(LLMCall(rid, 1, "openai_chat", req1, [1, 2, 3, 4, 5, 6, 7], [8], [-0.5], "stop", 3, "c",
                           parent_index=0))
    store.add_call(LLMCall(rid, 2, "openai_chat", {"messages": [{"role": "user", "content": "again"}]}, [9], [10],
                           [-0.2], "length", 3, "d", segment_break="history rewritten"))
    store.add_step(0, {"reward/mean": 0.0})
    store.close()
    return rid


def test_trajectory_tokens_tools_and_report(tmp_path: Path) -> None:
    rid = hand_built(tmp_path)
    t = TestClient(create_app(tmp_path), base_url=LOCAL).get(f"/api/rollout/{rid}").json()
    c0, c1, c2 = t["calls"]
    assert c0["new_prompt_start"] == 0 and c0["new_prompt_tokens"] == 3  # segment start: the whole prompt
    assert c1["new_prompt_start"] == 5 and c1["new_prompt_tokens"] == 2  # only what follows call 0's tokens
    assert c2["new_prompt_start"] == 0 and c2["segment_break"] == "history rewritten"
    assert c0["completion"]["ids"] == [4, 5] and c0["completion"]["logprobs"] == [-0.1, -2.0]
    assert c0["completion"]["experts"] == ["L0:0,1", "L0:2,3"]
    assert c0["completion"]["pieces"] == ["⟨4⟩", "⟨5⟩"]  # no tokenizer in this run dir: ids shown
    assert c0["tool_calls"][0]["kind"] == "edit" and c0["tool_results"] == [
        {"tool_call_id": "c0", "text": "<returncode>0</returncode>", "is_error": False}]
    assert t["rollout"]["report"]["dropped_paths"] == ["tests/conftest.py"]
    assert t["summary"]["segments"] == 2 and t["summary"]["edits"] == 1


def test_a_side_call_is_shown_in_order_but_kept_out_of_the_agents_chain(tmp_path: Path) -> None:
    rid = hand_built(tmp_path)
    store = Store(tmp_path / "store.sqlite")  # a title request between the agent's turns 0 and 1
    title = {"messages": [{"role": "system", "content": "You are a title generator."}]}
    store.add_call(LLMCall(rid, 3, "openai_chat", title, [11], [12], [-0.3], "stop", 3, "Fix x", session="title"))
    store.close()
    t = TestClient(create_app(tmp_path), base_url=LOCAL).get(f"/api/rollout/{rid}").json()
    assert [(c["index"], c["session"]) for c in t["calls"]] == [(0, "main"), (1, "main"), (2, "main"), (3, "title")]
    assert t["calls"][0]["tool_results"][0]["tool_call_id"] == "c0"  # read from the agent's next call, not the title
    assert t["summary"]["side_calls"] == {"title": 1} and t["summary"]["calls"] == 3


def test_live_reads_while_the_store_is_written(tmp_path: Path) -> None:
    hand_built(tmp_path)
    c = TestClient(create_app(tmp_path), base_url=LOCAL)
    assert c.get("/api/overview").json()["run"]["steps"] == 1
    writer = Store(tmp_path / "store.sqlite")  # the trainer's connection, still open
    writer.add_step(1, {"reward/mean": 1.0, "pass_rate": 1.0})
    d = c.get("/api/overview").json()
    assert d["run"]["steps"] == 2  # the cache saw the commit
    writer.close()


def test_token_required_on_every_request(tmp_path: Path) -> None:
    hand_built(tmp_path)
    c = TestClient(create_app(tmp_path, token="s3cret"))
    assert c.get("/api/overview").status_code == 401
    assert c.get("/static/app.js").status_code == 401
    assert c.get("/api/overview", params={"token": "wrong"}).status_code == 401
    r = c.get("/", params={"token": "s3cret"})
    assert r.status_code == 200
    assert c.get("/api/overview").status_code == 200  # the cookie set by the first visit


def test_a_forged_host_is_refused_without_a_token(client: TestClient, synth: Path) -> None:
    """DNS rebinding: a page on evil.example resolved to 127.0.0.1 sends Host: evil.example:port."""
    for host in ("127.0.0.1:8321", "localhost:8321", "[::1]:8321", "localhost"):
        assert client.get("/api/health", headers={"host": host}).status_code == 200, host
    for host in ("evil.example:8321", "127.0.0.1.evil.example", "", "[::1", "10.0.0.2:8321"):
        r = client.get("/api/overview", headers={"host": host})
        assert r.status_code == 421 and "loopback addresses only" in r.text, (host, r.text)
    # with a token any name may reach it (served on a public address); the token is what is checked
    c = TestClient(create_app(synth, token="tok"), base_url="http://dash.example.org")
    assert c.get("/api/health", params={"token": "tok"}).status_code == 200


def test_bind_policy() -> None:
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("localhost", None)
    check_bind("0.0.0.0", "tok")
    with pytest.raises(DashboardConfigError, match="not a loopback address, without a token"):
        check_bind("0.0.0.0", None)
    with pytest.raises(StoreMissing, match="has no store.sqlite"):
        RunDB("/nonexistent/run")


def test_serve_dashboard_on_a_real_socket(tmp_path: Path) -> None:
    hand_built(tmp_path)

    async def main() -> tuple[int, str, int]:
        url, stop = await serve_dashboard(tmp_path, port=0, token="tok")
        base = url.split("?")[0]
        async with httpx.AsyncClient() as http:
            ok = await http.get(base + "api/health", params={"token": "tok"})
            again = await http.get(base + "api/health")  # the cookie from the first answer
            assert again.status_code == 200
        async with httpx.AsyncClient() as fresh:
            denied = await fresh.get(base + "api/health")
        await stop()
        return ok.status_code, url, denied.status_code

    status, url, denied = asyncio.run(main())
    assert status == 200 and url.startswith("http://127.0.0.1:") and url.endswith("?token=tok") and denied == 401
    with pytest.raises(DashboardConfigError):
        asyncio.run(serve_dashboard(tmp_path, host="0.0.0.0"))


def test_cli_command(tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from legorl.cli import app as legorl_app
    from legorl.monitor.cli import dashboard_command

    assert "dashboard" in [c.name for c in legorl_app.registered_commands]
    hand_built(tmp_path)
    app = typer.Typer()
    app.command("dashboard")(dashboard_command)
    app.command("unused")(lambda: None)  # two commands: typer keeps the command name
    runner = CliRunner()
    r = runner.invoke(app, ["dashboard", str(tmp_path), "--host", "0.0.0.0", "--port", "0"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "without a token" in r.output
    r = runner.invoke(app, ["dashboard", str(tmp_path / "missing")], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "has no store.sqlite" in r.output


def test_the_time_left_is_estimated_from_measured_phase_times(tmp_path: Path) -> None:
    from legorl.monitor.progress import estimate, read_progress

    planned = ["demonstrations", "sft", "eval_before_rl", "rl", "eval_after_rl"]
    base = {"planned": planned, "steps": 10, "mode": "sync", "phase_started": 1000.0}
    # RL after 4 of 10 steps in 400 s: 600 s more, then the final evaluation as long as the first (120 s)
    p = estimate({**base, "phase": "rl", "phase_times_s": {"eval_before_rl": 120.0}, "first_step": 0},
                 steps_done=4, now=1400.0)
    assert p["label"] == "RL step 5 of 10" and p["share"] == 0.4 and p["time_left_s"] == 720.0
    # a resumed run counts only its own steps' rate: 2 steps (4 -> 6) in 400 s
    p = estimate({**base, "phase": "rl", "phase_times_s": {"eval_before_rl": 120.0}, "first_step": 4},
                 steps_done=6, now=1400.0)
    assert p["time_left_s"] == 4 * 200.0 + 120.0
    # demonstrations: 30 of 120 rollouts in 60 s; the later phases are not measured yet -> no estimate
    p = estimate({**base, "phase": "demonstrations", "done": 30, "total": 120, "phase_times_s": {}},
                 steps_done=0, now=1060.0)
    assert p["label"] == "teacher demonstrations: 30 of 120" and p["share"] == 0.25 and p["time_left_s"] is None
    # the final evaluation, 10 of 40 in 30 s: its own rest only
    p = estimate({**base, "phase": "eval_after_rl", "done": 10, "total": 40, "phase_times_s": {}},
                 steps_done=10, now=1030.0)
    assert p["time_left_s"] == 90.0
    assert estimate({**base, "phase": "done", "phase_times_s": {}}, steps_done=10)["time_left_s"] is None
    # asynchronous: the lag of the last batch trained, as the driver records it
    from legorl.monitor.progress import RunProgress

    progress = RunProgress(tmp_path, steps=10, planned=planned, mode="async")
    progress.enter("rl", {})
    progress.lag({"async/staleness_mean": 14 / 42, "async/staleness_max": 2.0, "async/dropped": 2.0,
                  "reward/mean": 0.5}, ahead=1)
    label = estimate(read_progress(tmp_path), steps_done=4)["label"]
    assert label == ("RL step 5 of 10 (asynchronous: 1 step(s) sampled ahead; the last batch trained was 0.33 "
                     "versions behind on average, at most 2, 2 rollouts dropped)"), label


def test_task_families_from_ids() -> None:
    from legorl.monitor.tasks_grid import family_of

    assert family_of("builtin-wrong_return-3b1a418b43") == "wrong_return"
    assert family_of("astropy__astropy-12907") == "astropy__astropy"
    assert family_of("pkg-attrs-evolve") == "pkg-attrs"


@pytest.mark.parametrize("advantage, fires", [("grpo", True), ("reinforce", False)])
def test_the_zero_variance_alarm_counts_groups_as_the_runs_advantage_trains_them(
        tmp_path: Path, advantage: str, fires: bool) -> None:
    """Three all-resolved groups and one all-failed: none trains under grpo, three under reinforce (SFT on
    their successes), so the dashboard's alarm (default threshold 50 %) fires for grpo only."""
    store = Store(tmp_path / "store.sqlite")
    store.add_run("r", {"trainer": {"advantage": advantage}})
    for g, reward in enumerate([1.0, 1.0, 1.0, 0.0]):
        for i in range(2):
            store.upsert_rollout(Rollout(
                id=f"g{g}-{i}", step=0, task_id=f"t{g}", group_id=f"g{g}", sample_index=i, harness="mini-swe-agent",
                split="train", outcome=Outcome.RESOLVED if reward else Outcome.UNRESOLVED, reward=reward))
    store.add_step(0, {"outcomes/resolved": 6.0, "outcomes/unresolved": 2.0})
    alarms = TestClient(create_app(tmp_path), base_url=LOCAL).get("/api/alarms").json()["alarms"]
    assert any(a["name"] == "zero_variance_groups" for a in alarms) is fires, alarms


def test_the_dashboard_judges_the_groups_the_loop_trained_on(tmp_path: Path) -> None:
    """The store also holds the all-failed groups a refill replaced; the loop's alarm judged only the batch it
    trained on and logged that share (`groups/no_signal_share`), which the dashboard follows."""
    from legorl.monitor.alarms import ZERO_VARIANCE, AlarmMonitor

    store = Store(tmp_path / "store.sqlite")
    store.add_run("r", {"trainer": {"advantage": "grpo"}})
    rollouts = []
    for g, rewards in enumerate([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]):
        for i, reward in enumerate(rewards):
            r = Rollout(id=f"g{g}-{i}", step=0, task_id=f"t{g}", group_id=f"g{g}", sample_index=i,
                        harness="mini-swe-agent", split="train",
                        outcome=Outcome.RESOLVED if reward else Outcome.UNRESOLVED, reward=reward)
            store.upsert_rollout(r)
            rollouts.append(r)
    batch = rollouts[4:]  # two groups were refilled away: one silent group and one with signal were trained
    monitor = AlarmMonitor(advantage="grpo")
    metrics = {"outcomes/resolved": 1.0, "outcomes/unresolved": 7.0}
    assert monitor.update(0, metrics, batch) == []
    logged = monitor.metrics([])
    assert logged == {ZERO_VARIANCE: 0.5}
    store.add_step(0, {**metrics, **logged})
    alarms = TestClient(create_app(tmp_path), base_url=LOCAL).get("/api/alarms").json()["alarms"]
    assert not any(a["name"] == "zero_variance_groups" for a in alarms), alarms  # the store alone says 75 %
