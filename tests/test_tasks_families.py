"""`tasks.families` restricts the built-in tasks of the main job, train and held-out splits alike."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from legorl import pipeline
from legorl.config import BUILTIN_FAMILIES, ConfigError, load_config
from legorl.pipeline import Driver, load_tasks
from legorl.tasks import FAMILIES

ROOT = Path(__file__).resolve().parents[1]
PICK = ["off_by_one", "string_format"]


def test_the_schema_knows_the_families_the_suite_has() -> None:
    assert list(BUILTIN_FAMILIES) == list(FAMILIES)


def test_families_restrict_both_splits() -> None:
    train, heldout = load_tasks(load_config(None, ["tasks.n_train=12", "tasks.n_heldout=6",
                                                   f"tasks.families=[{', '.join(PICK)}]"]))
    assert len(train) == 12 and len(heldout) == 6
    assert {t.family for t in train} == set(PICK) and {t.family for t in heldout} == set(PICK)
    assert not {t.instance_id for t in train} & {t.instance_id for t in heldout}
    every_train, every_heldout = load_tasks(load_config(None, ["tasks.n_train=12", "tasks.n_heldout=6"]))
    assert {t.family for t in every_train} == set(FAMILIES) and len({t.family for t in every_heldout}) == 6


def _digest(cfg_path: Path) -> str:
    train, heldout = load_tasks(load_config(cfg_path))
    ids = [t.instance_id for t in train] + ["|"] + [t.instance_id for t in heldout]  # ids carry a content hash
    return hashlib.sha256(" ".join(ids).encode()).hexdigest()[:16]


# The tasks each shipped config trained on before `tasks.families` took effect (all families).
# Larger pools (Claude Code's 512 RL tasks, the mixed run's 1536 demonstrations) and the harness demos'
# 128 held-out tasks (their 128 x 1 evaluation) as measured with them; the SmolLM2 demo's smaller pool.
SHIPPED = {(8, 4): "812d8f7764157366", (768, 96): "e31d012280c1df82", (1024, 96): "b493b1610a53ef72",
           (2048, 96): "d25fcb7e7489fb1c", (768, 128): "674aed1ebfe13620", (1024, 128): "1a4687bc6399186c",
           (288, 48): "ef23ce25e3a26aa0"}


BUILTIN_CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.yaml")
                         if load_config(p).tasks.source == "builtin")  # real.yaml reads mined tasks


def test_every_builtin_config_is_checked() -> None:
    assert {"demo.yaml", "smoke.yaml", "demo-codex.yaml"} <= set(BUILTIN_CONFIGS)


@pytest.mark.parametrize("name", BUILTIN_CONFIGS)
def test_shipped_configs_keep_their_tasks(name: str) -> None:
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.tasks.source == "builtin" and cfg.tasks.families is None and cfg.tasks.seed == 0
    assert _digest(ROOT / "configs" / name) == SHIPPED[(cfg.tasks.n_train, cfg.tasks.n_heldout)]


def test_unknown_family_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["tasks.families=[off_by_one, of_by_one]"])
    msg = str(e.value)
    assert "'tasks.families'" in msg and "of_by_one" in msg and "\n" not in msg
    assert all(f in msg for f in FAMILIES)


@pytest.mark.parametrize("value, words", [("[]", "leaves no tasks"), ("[off_by_one, off_by_one]", "once")])
def test_a_family_list_that_selects_nothing_or_twice_is_refused(value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(None, [f"tasks.families={value}"])


def test_families_of_another_source_are_refused(tmp_path: Path) -> None:
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("")
    with pytest.raises(ConfigError, match="tasks.families shapes the built-in suite"):
        load_config(None, ["tasks.source=jsonl", f"tasks.path={rows}", "tasks.families=[off_by_one]"])
    assert load_config(None, ["tasks.source=jsonl", f"tasks.path={rows}"]).tasks.families is None


class _Built(Exception):
    """Raised where the driver starts building harnesses: the tasks are loaded by then."""


def _driver_tasks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str) -> Driver:
    def stop(*_a, **_k):
        raise _Built

    monkeypatch.setattr(pipeline, "make_harnesses", stop)
    cfg = load_config(ROOT / "configs/smoke.yaml", [f"run.cache_dir={tmp_path / 'cache'}", "monitor.dashboard=false",
                                                    "rollout.tasks_per_step=3", *overrides])
    driver = Driver(cfg, tmp_path / "run")

    async def enter() -> None:
        async with driver:
            raise AssertionError("the driver got past building its harnesses")

    with pytest.raises(_Built):
        asyncio.run(enter())
    return driver


def test_families_change_which_tasks_a_run_trains_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    every = _driver_tasks(tmp_path / "a", monkeypatch)
    picked = _driver_tasks(tmp_path / "b", monkeypatch, f"tasks.families=[{', '.join(PICK)}]")
    trained = {t.family for step in range(4) for t in picked.tasks_for_step(step)}
    assert trained == set(PICK)
    assert {t.family for t in picked.heldout_tasks} == set(PICK)  # what the run evaluates on
    assert {t.family for step in range(4) for t in every.tasks_for_step(step)} - set(PICK)
    assert len(picked.train_tasks) == len(every.train_tasks) == 8
