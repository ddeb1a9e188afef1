"""docs/configuration.md and the schema (src/legorl/config.py) name the same keys, both ways.

The page documents each section (`## run`, `### monitor.alarms`, ...) in a table whose first
column is the key in backticks. Every such row must be a key of that section of the schema, every
schema key must have a row, a backticked default must equal the schema's, every dotted reference
(`rollout.task_pool`, `trainer.lr=1e-5`) anywhere on the page must name a real key, and every YAML
example must load.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from legorl.config import Config, load_config

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
FILE_SUFFIXES = {"md", "py", "yaml", "yml", "json", "jsonl", "sqlite", "toml", "txt"}


def _section_model(field: Any) -> type[BaseModel] | None:
    ann = field.annotation
    return ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None


def schema_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> pydantic field, for every leaf key (nested sections walked, not listed)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        sub = _section_model(field)
        if sub is not None and prefix:  # a nested section (monitor.alarms) is documented as a key too
            out[prefix + name] = field
        out.update(schema_keys(sub, f"{prefix}{name}.") if sub is not None else {prefix + name: field})
    return out


def schema_sections(model: type[BaseModel] = Config, prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        if (sub := _section_model(field)) is not None:
            out |= {prefix + name} | schema_sections(sub, f"{prefix}{name}.")
    return out


def documented_rows(text: str) -> list[tuple[str, str, str | None, int]]:
    """(section, key, default cell or None, line number) for each table row under a section heading."""
    sections = schema_sections()
    rows, section, in_code = [], None, False
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        if m := re.match(r"#{2,6}\s+`?([\w.]+)`?", line):
            section = m[1] if m[1] in sections else None
            continue
        if section is None or not line.lstrip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        key = re.fullmatch(r"`([\w.]+)`", cells[0])
        if key is None:  # the header, its rule, or a row that is not a key
            continue
        header_default = len(cells) > 1 and cells[1]
        rows.append((section, key[1], header_default or None, lineno))
    return rows


def dotted_references(text: str) -> list[tuple[str, int]]:
    """`section.key[.more]` tokens anywhere on the page (prose, tables, code), with their line."""
    top = "|".join(sorted(Config.model_fields, key=len, reverse=True))
    # not inside a path or a name (docs/tasks.md, legorl.tasks), not a call (ray.init()), not quoted
    # in an error message ('trainer.lrr', the page's example of a typo)
    pattern = re.compile(rf"(?<![\w/.$'-])(?:{top})(?:\.\w+)+(?![\w/(-])")
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in pattern.finditer(line):
            ref = m[0]
            if ref.rsplit(".", 1)[1] in FILE_SUFFIXES:  # docs/tasks.md, rollout/curriculum.py
                continue
            found.append((ref, lineno))
    return found


def resolves(ref: str) -> bool:
    """A dotted reference names a schema key, or something inside a mapping-valued key."""
    model: type[BaseModel] = Config
    for part in ref.split("."):
        field = model.model_fields.get(part)
        if field is None:
            return False
        sub = _section_model(field)
        if sub is None:
            return True  # a leaf; what follows is a mapping key (harness.overrides.codex) or nothing
        model = sub
    return True


TEXT = PAGE.read_text()
ROWS = documented_rows(TEXT)


def test_the_parser_sees_the_page() -> None:
    """Guards the guard: a change of page layout that hides the tables fails here, not silently."""
    sections = {s for s, *_ in ROWS}
    assert {"run", "engine", "trainer", "monitor", "monitor.alarms", "ray"} <= sections
    assert len(ROWS) >= 100
    assert ("tasks", "families", "`null`", next(n for s, k, _, n in ROWS if (s, k) == ("tasks", "families"))) in ROWS


def test_every_documented_key_is_in_the_schema() -> None:
    keys = schema_keys()
    unknown = [f"docs/configuration.md:{n}: {s}.{k}" for s, k, _, n in ROWS if f"{s}.{k}" not in keys]
    assert not unknown, "documented but not in the schema:\n" + "\n".join(unknown)


def test_every_schema_key_is_documented() -> None:
    documented = {f"{s}.{k}" for s, k, *_ in ROWS}
    missing = sorted(set(schema_keys()) - documented)
    assert not missing, "in the schema but not documented in docs/configuration.md: " + ", ".join(missing)


def test_each_key_is_documented_once() -> None:
    seen: dict[str, int] = {}
    twice = []
    for s, k, _, n in ROWS:
        if f"{s}.{k}" in seen:
            twice.append(f"{s}.{k} (lines {seen[f'{s}.{k}']} and {n})")
        seen[f"{s}.{k}"] = n
    assert not twice


def _plain(v: Any) -> Any:
    return [_plain(x) for x in v] if isinstance(v, list | tuple) else v


def test_documented_defaults_match_the_schema() -> None:
    keys = schema_keys()
    wrong = []
    for s, k, cell, n in ROWS:
        field = keys.get(f"{s}.{k}")
        if field is None or cell is None or _section_model(field) is not None:
            continue
        m = re.fullmatch(r"`([^`]*)`", cell)
        if m is None:  # prose in the default column: nothing to compare
            continue
        default = _plain(field.get_default(call_default_factory=True))
        documented = m[1] if isinstance(default, str) else yaml.safe_load(m[1])  # `off` is a string here
        if documented != default:
            wrong.append(f"docs/configuration.md:{n}: {s}.{k} documented as {m[1]!r}, the schema says {default!r}")
    assert not wrong, "\n".join(wrong)


def test_dotted_references_name_real_keys() -> None:
    refs = dotted_references(TEXT)
    assert ("tasks.families", 7) in refs  # the command-line example at the top
    bad = [f"docs/configuration.md:{n}: {ref}" for ref, n in refs if not resolves(ref)]
    assert not bad, "references to keys that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize("block", re.findall(r"```yaml\n(.*?)```", TEXT, re.DOTALL) or ["missing"])
def test_yaml_examples_load(block: str, tmp_path: Path) -> None:
    assert block != "missing", "the page should show a config file"
    path = tmp_path / "example.yaml"
    path.write_text(block)
    assert isinstance(yaml.safe_load(block), dict)
    load_config(path)


def test_the_checks_can_fail() -> None:
    """Each check catches what it is for, on a doctored page."""
    doctored = TEXT.replace("| `lr` | `1.0e-4` |", "| `lrr` | `1.0e-4` |")
    rows = documented_rows(doctored)
    assert ("trainer", "lrr") in {(s, k) for s, k, *_ in rows}
    assert "trainer.lr" not in {f"{s}.{k}" for s, k, *_ in rows}
    assert not resolves("trainer.lrr") and resolves("harness.overrides.codex") and resolves("monitor.alarms.kl_min")
    assert ("rollout.no_such_key", 1) in dotted_references("see `rollout.no_such_key`; docs/tasks.md")
