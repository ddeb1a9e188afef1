"""The dashboard in a real browser (Debian's Chromium through Playwright) on a real run made here.

The run is a real `legorl train` at toy size: teacher demonstrations through mini-swe-agent (tool calls,
edits, submits), SFT, then two RL steps whose untrained rollouts fail. While it trains, the
dashboard reads the store live; then every page is opened, clicked through and checked. Screenshots go
to test-artifacts/dashboard/.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "test-artifacts" / "dashboard"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

# each page and what it shows once its data arrived, whatever the phase (an empty table says so)
LIVE_PAGES = [("/", "#phase-label"), ("/rollouts", "#rollouts-table"), ("/tasks", "#task-grid, #grid p"),
              ("/failures", "#taxonomy-table, #taxonomy p"), ("/behaviour", "#bnote:not(:empty)"),
              ("/alarms", "#thresholds:not(:empty)")]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="playwright is not installed (pip install -e '.[dev]', or make setup-test)"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing (apt-get install -y chromium)"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="the real run needs bubblewrap (apt-get install bubblewrap)"),
]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory, browser: Any) -> Path:
    import re

    from fastapi.testclient import TestClient

    from legorl.monitor.server import create_app

    run = tmp_path_factory.mktemp("dashboard") / "run"
    exe = Path(sys.executable).with_name("legorl")
    cmd = [str(exe), "train", "--config", str(ROOT / "configs" / "smoke.yaml"), "--run-dir", str(run),
           "run.steps=2", "sft.enabled=true", "sft.demos=2", "sft.epochs=1", "harness.step_limit=5",
           "rollout.tasks_per_step=2", "rollout.group_size=2", "run.checkpoint_every=0",
           "eval.before_training=true"]
    log = open(run.parent / "train.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    live_checks = 0
    phases: list[str] = []  # what /api/progress said while the run went
    live_pages: list[str] = []  # the run's own dashboard opened in the browser during each phase
    errors: list[str] = []
    live = browser.new_page(viewport={"width": 1400, "height": 1000})
    live.on("pageerror", lambda e: errors.append(str(e)))
    live.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    deadline = time.time() + 600
    try:
        client = None
        while proc.poll() is None and time.time() < deadline:
            time.sleep(1.0)
            if client is None and (run / "store.sqlite").exists():
                client = TestClient(create_app(run), base_url="http://127.0.0.1")
            if client is not None:  # the dashboard reads while the trainer writes
                assert client.get("/api/overview").status_code == 200
                assert client.get("/api/rollouts").status_code == 200
                p = client.get("/api/progress").json()
                if p["phase"] and (not phases or phases[-1] != p["phase"]):
                    phases.append(p["phase"])
                    assert p["label"] and p["phase_elapsed_s"] >= 0
                    url = re.search(r"dashboard: (http://\S+)", (run.parent / "train.log").read_text())
                    if url and p["phase"] != "done":  # every page, rendered while the run writes
                        for path, drawn in LIVE_PAGES:
                            live.goto(url.group(1).rstrip("/") + path)
                            live.wait_for_selector(drawn)
                        live_pages.append(p["phase"])
                live_checks += 1
        if proc.poll() is None:
            proc.kill()
            pytest.fail(f"the run did not finish in time; see {run.parent / 'train.log'}")
    finally:
        log.close()
        live.close()
    assert proc.returncode == 0, (run.parent / "train.log").read_text()[-3000:]
    assert live_checks > 0
    assert live_pages and errors == [], (live_pages, errors)  # rendered live, without a console error
    # the phases came in order (a short one may pass between two polls), the last one seen being "done"
    order = ["demonstrations", "sft", "eval_before_rl", "rl", "eval_after_rl", "done"]
    assert len(phases) >= 3 and phases == sorted(phases, key=order.index), phases
    return run


def _served(run: Path, *compare_with: Path) -> Iterator[str]:
    from legorl.monitor.server import served_in_thread

    with served_in_thread(run, compare_with) as url:
        yield url


@pytest.fixture(scope="module")
def base_url(real_run: Path) -> Iterator[str]:
    yield from _served(real_run)


@pytest.fixture(scope="module")
def compare_url(real_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real run beside a copy of it whose recorded config says otherwise (the same run name, another
    directory)."""
    import json
    import sqlite3

    other = tmp_path_factory.mktemp("compare") / "other"
    shutil.copytree(real_run, other)
    with sqlite3.connect(other / "store.sqlite") as con:  # the config the run recorded in its store
        rid, text = con.execute("SELECT id, config_json FROM runs ORDER BY id DESC LIMIT 1").fetchone()
        cfg = json.loads(text)
        cfg["rollout"]["mode"], cfg["trainer"]["lr"] = "async", 0.5
        con.execute("UPDATE runs SET config_json = ? WHERE id = ?", (json.dumps(cfg), rid))
    yield from _served(real_run, other)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    pg = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.set_default_timeout(30_000)
    yield pg
    pg.close()
    assert errors == [], f"JavaScript errors: {errors}"


def shot(pg: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def test_overview(page: Any, base_url: str) -> None:
    page.goto(base_url + "/")
    page.wait_for_selector("#chart-reward svg")
    for cid in ("reward", "outcomes", "mismatch", "kl", "lengths", "turns", "tokens_per_s", "rollouts_per_min",
                "time", "train", "tokens", "is_weights"):
        assert page.locator(f"#chart-{cid}").count() == 1, cid
    assert page.locator("#chart-outcomes rect.bar").count() >= 2  # two RL steps
    assert page.locator("#chart-mismatch path.line").count() >= 1
    stats = page.locator(".stats").inner_text()
    assert "rollouts" in stats and "model calls" in stats
    page.hover("#chart-mismatch svg", position={"x": 200, "y": 100})
    assert "step" in page.locator("#tip").inner_text()
    # the phase banner: finished, every planned phase with its measured time; the resolved config on demand
    assert page.locator("#phase-label").inner_text() == "finished"
    assert page.locator(".phase-step.done").count() == page.locator(".phase-step").count() >= 3
    page.click("#config summary")
    page.wait_for_function("document.querySelector('#config pre').textContent.includes('tasks_per_step')")
    shot(page, "overview")


def test_overview_to_a_failed_trajectory(page: Any, base_url: str) -> None:
    page.goto(base_url + "/")
    link = page.wait_for_selector("#recent-failures a.rollout-link")
    rid = link.inner_text()
    link.click()
    page.wait_for_url("**/rollout/**")
    page.wait_for_selector(".call")
    assert rid in page.locator("h1").inner_text()
    outcome = page.locator("#rollout-head .pill").first.inner_text()
    assert outcome not in ("resolved", "pending")
    assert page.locator("#outcome").inner_text().strip()
    assert page.locator("#grader-report #tests tr").count() >= 2 or "not graded" in page.content()
    assert page.locator(".tokens .tok").count() > 0
    page.hover(".tokens .tok >> nth=0")
    tip = page.locator("#tip").inner_text()
    assert "logprob" in tip and "id" in tip
    shot(page, "trajectory_failed")


def test_outcome_bar_opens_the_filtered_table(page: Any, base_url: str) -> None:
    page.goto(base_url + "/")
    bar = page.wait_for_selector("#chart-outcomes rect.bar")
    step, outcome = bar.get_attribute("data-step"), bar.get_attribute("data-series")
    bar.click()
    page.wait_for_url("**/rollouts?**")
    page.wait_for_selector("#rollouts-table tr[data-id]")
    rows = page.locator("#rollouts-table tr[data-id]")
    assert rows.count() >= 1
    for i in range(rows.count()):
        cells = rows.nth(i).locator("td")
        assert cells.nth(0).inner_text() == step
        assert cells.nth(6).inner_text() == outcome


def test_rollouts_table_filters_sorts_and_pages(page: Any, base_url: str) -> None:
    page.goto(base_url + "/rollouts")
    page.wait_for_selector("#rollouts-table tr[data-id]")
    total = int(page.locator("#page-info").first.inner_text().split("·")[1].split()[0])
    assert total >= 10  # 2 demos + 2 steps x 4 rollouts
    page.select_option("select[name=split]", "demo")
    page.click("#filters button.primary")
    page.wait_for_function("document.querySelector('#page-info').textContent.includes('2 rollouts')")
    splits = page.locator("#rollouts-table tr[data-id] td:nth-child(6)").all_inner_texts()
    assert splits == ["demo", "demo"]
    page.click("#filters #clear")
    page.wait_for_function(f"document.querySelector('#page-info').textContent.includes('{total} rollouts')")
    page.click("th[data-sort=reward]")
    page.wait_for_selector("th.sorted[data-sort=reward]")
    page.goto(base_url + "/rollouts?per_page=3")
    page.wait_for_selector("#rollouts-table tr[data-id]")
    first = page.locator("#rollouts-table tr[data-id]").first.get_attribute("data-id")
    page.click("#pager button[data-go=next]")
    page.wait_for_function("document.querySelector('#page-info').textContent.startsWith('page 2')")
    assert page.locator("#rollouts-table tr[data-id]").first.get_attribute("data-id") != first
    page.goto(base_url + "/rollouts")
    page.wait_for_selector("#rollouts-table tr[data-id]")
    shot(page, "rollouts")


def test_demonstration_trajectory_shows_tools_results_and_report(page: Any, base_url: str) -> None:
    page.goto(base_url + "/rollouts?split=demo&outcome=resolved")
    page.wait_for_selector("#rollouts-table tr[data-id] a.rollout-link")
    page.click("#rollouts-table tr[data-id] a.rollout-link >> nth=0")
    page.wait_for_selector(".call")
    assert page.locator("#rollout-head .pill").first.inner_text() == "resolved"
    kinds = page.locator(".toolcall .pill").all_inner_texts()
    assert {"read", "edit", "submit"} <= set(kinds), kinds  # the teacher reads, fixes with sed -i, submits
    assert page.locator(".result").count() >= 2
    assert "sed -i" in page.locator(".toolcall", has_text="edit").first.inner_text()
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in page.locator(".toolcall").last.inner_text()
    assert "full prompt (segment start)" in page.locator("#call-0").inner_text().lower()
    assert "+" in page.locator("#final-diff").inner_text()
    statuses = page.locator("#tests td:nth-child(2)").all_inner_texts()
    assert statuses and set(statuses) == {"passed"}
    head = page.locator("#rollout-head").inner_text()
    assert "1 edit(s)" in head and "submitted: yes" in head and "0 format error(s)" in head
    shot(page, "trajectory")


def test_failures_page_links_to_examples(page: Any, base_url: str) -> None:
    page.goto(base_url + "/failures")
    page.wait_for_selector("#taxonomy-table tr[data-outcome]")
    assert page.locator("#chart-failures rect.bar").count() >= 1
    shot(page, "failures")
    page.click("#taxonomy-table a.rollout-link >> nth=0")
    page.wait_for_url("**/rollout/**")
    page.wait_for_selector(".call")
    assert page.locator("#rollout-head .pill").first.inner_text() != "resolved"


def test_behaviour_page(page: Any, base_url: str) -> None:
    page.goto(base_url + "/behaviour")
    page.wait_for_selector("#chart-b_verify")
    page.wait_for_function("document.querySelector('#bnote').textContent.length > 0")
    assert "2 train steps" in page.locator("#bnote").inner_text()
    for cid in ("b_turns", "b_tools", "b_verify", "b_text", "b_submit", "b_mix"):
        assert page.locator(f"#chart-{cid}").count() == 1
    assert page.locator("#chart-b_text path.line").count() >= 1
    shot(page, "behaviour")


def test_alarms_page(page: Any, base_url: str) -> None:
    page.goto(base_url + "/alarms")
    page.wait_for_selector("#thresholds:not(:empty)")
    assert "kl_rise_factor" in page.locator("#thresholds").inner_text()
    assert page.locator("#active .card").count() >= 1
    shot(page, "alarms")


def test_compare_page(page: Any, compare_url: str) -> None:
    page.goto(compare_url + "/")
    assert page.locator('nav a[data-nav="compare"]').count() == 1  # shown only when runs are compared
    page.click('nav a[data-nav="compare"]')
    page.wait_for_selector("#chart-reward svg")
    labels = page.locator("#compare-runs tr td:first-child").all_inner_texts()
    assert labels == ["smoke", "smoke (other)"]  # the same run name, told apart by directory
    for cid in ("reward", "heldout", "pearson", "k3", "turns", "verify", "step_time"):
        assert page.locator(f"#chart-{cid}").count() == 1, cid
    assert page.locator("#chart-reward path.line").count() == 2  # one curve per run, same axes
    diff = page.locator("#config-diff").inner_text()
    assert "rollout.mode" in diff and "async" in diff and "trainer.lr" in diff
    assert "run.seed" not in diff  # only what differs
    shot(page, "compare")


def test_task_grid(page: Any, base_url: str) -> None:
    page.goto(base_url + "/tasks")
    page.wait_for_selector("#task-grid")
    assert page.locator("#task-grid tr.family").count() >= 1  # grouped by task family
    cells = page.locator("#task-grid td.cell")
    assert cells.count() == 4  # 2 steps x 2 tasks, a cell holding its task's group of 2 rollouts
    assert "resolved" in cells.first.get_attribute("title")
    shot(page, "tasks")
    page.select_option("#grid-form select", "eval-heldout")  # the evaluation before RL is step -1: named
    # the train grid's cells stay until the new split's arrive: wait for its step column, not any cell
    page.wait_for_selector('#task-grid th.step:text-is("before")')
    assert page.locator("#task-grid th.step").first.inner_text() == "before"
    assert "before RL:" in page.locator("#task-grid td.cell").first.get_attribute("title")
    page.select_option("#grid-form select", "demo")
    page.wait_for_selector("#task-grid td.cell.solved")  # the teacher's demonstrations resolved
    page.locator("#task-grid td.cell a").first.click()
    page.wait_for_selector(".trajectory, #trajectory, .call", timeout=30_000)
    assert "/rollout/" in page.url
