"""Procedurally generated bug-fix tasks (the built-in suite).

Each instance is a tiny Python package with one planted one-line bug. A family gives
the correct module source, the (good, bad) substring pair, and the calls that expose
the bug (FAIL_TO_PASS) or must keep working (PASS_TO_PASS). Expected values are
computed by running both versions at generation time, so every instance is checked
to be solvable by its gold patch and broken without it.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from legorl.tasks.schema import Task

HIDDEN_TEST_PATH = "tests/test_hidden.py"
VISIBLE_TEST_PATH = "tests/test_basic.py"

WORDS = [
    "atlas", "birch", "cobalt", "delta", "ember", "fable", "garnet", "harbor", "indigo", "juniper", "kestrel",
    "lumen", "maple", "nimbus", "onyx", "pebble", "quartz", "raven", "sierra", "tundra", "umber", "vesper",
    "willow", "xenon", "yarrow", "zephyr",
]  # fmt: skip


@dataclass
class Bug:
    module: str
    func: str
    code: str  # correct module source
    good: str  # substring of code (occurs once) ...
    bad: str  # ... replaced by this to plant the bug
    f2p: list[str]  # call expressions whose result changes with the bug
    p2p: list[str] = field(default_factory=list)  # call expressions unaffected by the bug


def _wrong_operator(r: random.Random) -> Bug:
    if r.random() < 0.5:
        f = r.choice(["area", "rect_area", "surface", "tile_count"])
        a, b = r.randint(3, 9), r.randint(3, 9)
        code = f'def {f}(width, height):\n    """Area of a width x height rectangle."""\n    return width * height\n'
        return Bug(
            "geometry", f, code, "width * height", "width + height", [f"{f}({a}, {b})"], [f"{f}(2, 2)"]
        )
    f = r.choice(["apply_discount", "net_price", "sale_price"])
    p, d = r.randint(20, 90), r.randint(2, 15)
    code = f'def {f}(price, discount):\n    """Price after subtracting a flat discount."""\n    return price - discount\n'
    return Bug(
        "pricing", f, code, "price - discount", "price + discount", [f"{f}({p}, {d})"], [f"{f}({p}, 0)"]
    )


def _off_by_one(r: random.Random) -> Bug:
    if r.random() < 0.5:
        f = r.choice(["sum_to", "triangular", "total_up_to"])
        code = (
            f'def {f}(n):\n    """Sum of the integers 1..n inclusive."""\n    total = 0\n'
            "    for i in range(1, n + 1):\n        total += i\n    return total\n"
        )
        return Bug(
            "series", f, code, "range(1, n + 1)", "range(1, n)", [f"{f}({r.randint(3, 12)})"], [f"{f}(0)"]
        )
    f = r.choice(["first_k", "take", "head"])
    items = r.sample(range(10, 99), r.randint(4, 6))
    code = f'def {f}(items, k):\n    """The first k items of a list."""\n    return items[:k]\n'
    return Bug(
        "listops",
        f,
        code,
        "items[:k]",
        "items[:k - 1]",
        [f"{f}({items}, {r.randint(1, 3)})"],
        [f"{f}([], 2)"],
    )


_UNITS = [  # (function, constant name, factor, wrong factor)
    ("hours_to_seconds", "SECONDS_PER_HOUR", 3600, 360),
    ("minutes_to_seconds", "SECONDS_PER_MINUTE", 60, 100),
    ("km_to_meters", "METERS_PER_KM", 1000, 100),
    ("days_to_hours", "HOURS_PER_DAY", 24, 12),
    ("feet_to_inches", "INCHES_PER_FOOT", 12, 10),
]


def _wrong_constant(r: random.Random) -> Bug:
    f, const, good, bad = r.choice(_UNITS)
    code = f'{const} = {good}\n\n\ndef {f}(value):\n    """Convert using {const}."""\n    return value * {const}\n'
    return Bug(
        "units", f, code, f"{const} = {good}", f"{const} = {bad}", [f"{f}({r.randint(2, 9)})"], [f"{f}(0)"]
    )


def _inverted_condition(r: random.Random) -> Bug:
    if r.random() < 0.5:
        f = r.choice(["is_even", "even", "has_even_parity"])
        code = f'def {f}(n):\n    """True when n is even."""\n    return n % 2 == 0\n'
        return Bug("parity", f, code, "n % 2 == 0", "n % 2 != 0", [f"{f}({2 * r.randint(1, 50)})", f"{f}(7)"])
    f = r.choice(["keep_below", "at_most", "filter_small"])
    limit = r.randint(10, 20)
    values = r.sample(range(1, 30), 6)
    code = (
        f'def {f}(values, limit):\n    """The values that are <= limit, in order."""\n'
        "    return [v for v in values if v <= limit]\n"
    )
    return Bug(
        "filters", f, code, "v <= limit", "v > limit", [f"{f}({values}, {limit})"], [f"{f}([], {limit})"]
    )


def _wrong_variable(r: random.Random) -> Bug:
    if r.random() < 0.5:
        f = r.choice(["clamp", "bound", "limit_to"])
        lo, hi = r.randint(0, 5), r.randint(10, 20)
        code = (
            f'def {f}(x, lo, hi):\n    """x limited to the range [lo, hi]."""\n    if x < lo:\n        return lo\n'
            "    if x > hi:\n        return hi\n    return x\n"
        )
        return Bug(
            "ranges", f, code, "x > hi:\n        return hi", "x > hi:\n        return lo",
            [f"{f}({hi + r.randint(1, 9)}, {lo}, {hi})"], [f"{f}({lo + 2}, {lo}, {hi})", f"{f}({lo - 3}, {lo}, {hi})"],
        )  # fmt: skip
    f = r.choice(["full_name", "display_name", "join_names"])
    first, last = r.sample(["Ada", "Alan", "Grace", "Linus", "Barbara", "Ken", "Edsger", "Donald"], 2)
    code = f'def {f}(first, last):\n    """First and last name separated by one space."""\n    return first + " " + last\n'
    return Bug(
        "names", f, code, 'first + " " + last', 'first + " " + first', [f"{f}({first!r}, {last!r})"],
        [f"{f}({first!r}, {first!r})"],
    )  # fmt: skip


def _missing_case(r: random.Random) -> Bug:
    table, f, entries = r.choice([
        ("TO_METERS", "to_meters", [("km", 1000.0), ("m", 1.0), ("cm", 0.01), ("mm", 0.001)]),
        ("TO_GRAMS", "to_grams", [("kg", 1000.0), ("g", 1.0), ("mg", 0.001)]),
        ("TO_SECONDS", "to_seconds", [("h", 3600), ("min", 60), ("s", 1), ("ms", 0.001)]),
    ])  # fmt: skip
    missing = r.choice([k for k, _ in entries if k not in ("m", "g", "s")])
    full = ", ".join(f"{k!r}: {v!r}" for k, v in entries)
    partial = ", ".join(f"{k!r}: {v!r}" for k, v in entries if k != missing)
    code = f'{table} = {{{full}}}\n\n\ndef {f}(value, unit):\n    """Convert value given in unit."""\n    return value * {table}[unit]\n'
    v = r.randint(2, 9)
    keep = [k for k, _ in entries if k != missing]
    return Bug(
        "convert", f, code, f"{table} = {{{full}}}", f"{table} = {{{partial}}}",
        [f"{f}({v}, {missing!r})"], [f"{f}({v}, {k!r})" for k in keep[:2]],
    )  # fmt: skip


def _wrong_return(r: random.Random) -> Bug:
    if r.random() < 0.5:
        f = r.choice(["index_of", "find_index", "position"])
        items = r.sample(["red", "green", "blue", "cyan", "pink", "gold", "gray"], 4)
        code = (
            f'def {f}(items, target):\n    """Index of target in items, or -1 when absent."""\n'
            "    for i, item in enumerate(items):\n        if item == target:\n            return i\n    return -1\n"
        )
        return Bug(
            "search", f, code, "return i\n", "return item\n", [f"{f}({items}, {items[r.randint(1, 3)]!r})"],
            [f"{f}({items}, 'white')"],
        )  # fmt: skip
    f = r.choice(["largest", "maximum", "biggest"])
    vals = r.sample(range(1, 50), 5)
    top = sorted(vals)
    code = (
        f'def {f}(values):\n    """The largest value of a non-empty list."""\n    best = values[0]\n'
        "    for v in values[1:]:\n        if v > best:\n            best = v\n    return best\n"
    )
    return Bug(
        "stats", f, code, "    return best\n", "    return values[0]\n",
        [f"{f}({top[:2] + [top[-1]] + top[2:4]})"], [f"{f}({top[::-1]})"],
    )  # fmt: skip


def _string_format(r: random.Random) -> Bug:
    if r.random() < 0.5:
        f = r.choice(["format_price", "as_dollars", "money"])
        code = f'def {f}(cents):\n    """Format cents as dollars, e.g. 1250 -> "$12.50"."""\n    return f"${{cents // 100}}.{{cents % 100:02d}}"\n'
        return Bug(
            "money", f, code, "{cents % 100:02d}", "{cents % 100}",
            [f"{f}({r.randint(1, 20) * 100 + r.randint(1, 9)})"], [f"{f}({r.randint(1, 20) * 100 + r.randint(10, 99)})"],
        )  # fmt: skip
    f = r.choice(["greet", "greeting", "hello"])
    name = r.choice(["Ada", "Bob", "Chen", "Dana", "Eve"])
    code = f'def {f}(name):\n    """Greeting, e.g. "Hello, Ada!"."""\n    return f"Hello, {{name}}!"\n'
    return Bug("messages", f, code, '"Hello, {name}!"', '"Hello {name}!"', [f"{f}({name!r})"])


FAMILIES: dict[str, Callable[[random.Random], Bug]] = {
    "wrong_operator": _wrong_operator,
    "off_by_one": _off_by_one,
    "wrong_constant": _wrong_constant,
    "inverted_condition": _inverted_condition,
    "wrong_variable": _wrong_variable,
    "missing_case": _missing_case,
    "wrong_return": _wrong_return,
    "string_format": _string_format,
}

# Correct helper functions that sit next to the bug: distractors with PASS_TO_PASS tests.
HELPERS = [
    (["double", "twice"], "def {g}(x):\n    return 2 * x\n", "{g}(4)"),
    (["normalize", "clean"], "def {g}(s):\n    return s.strip().lower()\n", "{g}('  AbC ')"),
    (["is_empty", "empty"], "def {g}(xs):\n    return len(xs) == 0\n", "{g}([1])"),
    (["smaller", "min_of"], "def {g}(a, b):\n    return a if a < b else b\n", "{g}(7, 3)"),
]


def _evaluate(code: str, call: str) -> tuple[bool, str]:
    env: dict = {}
    exec(code, env)  # noqa: S102 - our own generated code, never task input
    try:
        return True, repr(eval(call, env))
    except Exception as e:  # noqa: BLE001 - the planted bug may raise anything
        return False, f"{type(e).__name__}: {e}"


def _require(cond: bool, family: str, what: str) -> None:
    # Generator self-checks: a family that can emit an unsolvable or bug-free instance is a bug here.
    if not cond:
        raise RuntimeError(f"built-in family {family}: {what}")


def unified_diff(path: str, old: str, new: str) -> str:
    """A `git diff`-style patch (a/ b/ prefixes) from old to new content of one file."""
    body = difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}")
    return f"diff --git a/{path} b/{path}\n" + "".join(body)


def make_task(family: str, r: random.Random, split: str) -> Task:
    bug = FAMILIES[family](r)
    _require(bug.code.count(bug.good) == 1, family, f"{bug.good!r} must occur once")
    pkg = f"pkg_{r.choice(WORDS)}{r.randint(10, 99)}"
    names, helper_src, helper_call = r.choice(HELPERS)
    g = r.choice(names)
    helper_src, helper_call = helper_src.format(g=g), helper_call.format(g=g)
    good_code = f'"""{bug.module.capitalize()} helpers."""\n\n\n{helper_src}\n\n{bug.code}'
    bad_code = good_code.replace(bug.good, bug.bad)
    mod_path = f"{pkg}/{bug.module}.py"

    def check(call: str) -> str:
        ok, value = _evaluate(good_code, call)
        _require(ok, family, f"{call} fails on the fixed code: {value}")
        return value

    f2p_tests, p2p_tests = [], []
    for i, call in enumerate(bug.f2p):
        value = check(call)
        _require(_evaluate(bad_code, call) != (True, value), family, f"{call} does not expose the bug")
        f2p_tests.append((f"test_{bug.func}_{i}", call, value))
    for i, call in enumerate([*bug.p2p, helper_call]):
        value = check(call)
        _require(_evaluate(bad_code, call) == (True, value), family, f"{call} changes with the bug")
        p2p_tests.append((f"test_{bug.func}_keeps_{i}", call, value))

    imports = f"from {pkg}.{bug.module} import {g}, {bug.func}\n"
    hidden = (
        '"""Hidden tests (never shown to the agent)."""\n\n'
        + imports
        + "".join(
            f"\n\ndef {name}():\n    assert {call} == {value}\n"
            for name, call, value in f2p_tests + p2p_tests
        )
    )
    visible = f'"""Basic tests."""\n\nfrom {pkg}.{bug.module} import {g}\n\n\ndef test_{g}():\n'
    visible += f"    assert {helper_call} == {check(helper_call)}\n"
    call, want = f2p_tests[0][1], f2p_tests[0][2]
    _, got = _evaluate(bad_code, call)
    got = f"raises `{got}`" if not _evaluate(bad_code, call)[0] else f"returns `{got}`"
    statement = r.choice([
        "`{call}` {got} but it should return `{want}`.",
        "Bug report: calling `{call}` {got}; the expected result is `{want}`.",
        "In `{pkg}`, `{call}` {got}. It should return `{want}`. Please fix the library code.",
    ]).format(call=call, got=got, want=want, pkg=pkg)  # fmt: skip
    files = {
        "README.md": f"# {pkg}\n\nSmall {bug.module} utilities.\n\nRun the tests with `python -m pytest -q`.\n",
        f"{pkg}/__init__.py": "",
        mod_path: bad_code,
        VISIBLE_TEST_PATH: visible,
    }
    digest = hashlib.sha256(json.dumps([files, hidden], sort_keys=True).encode()).hexdigest()
    return Task(
        instance_id=f"builtin-{family}-{digest[:10]}",
        repo=f"builtin/{family}",
        problem_statement=statement,
        hidden_files={HIDDEN_TEST_PATH: hidden},
        patch=unified_diff(mod_path, bad_code, good_code),
        FAIL_TO_PASS=[f"{HIDDEN_TEST_PATH}::{name}" for name, _, _ in f2p_tests],
        PASS_TO_PASS=[f"{HIDDEN_TEST_PATH}::{name}" for name, _, _ in p2p_tests],
        files=files,
        family=family,
        split=split,
    )


def generate_tasks(
    families: list[str] | None, n: int, seed: int, split: str = "train", *, exclude: set[str] | None = None
) -> list[Task]:
    """n tasks, round-robin over families, deterministic in (families, n, seed, split).

    Instances whose id is in ``exclude`` (or already generated) are redrawn, so every
    returned instance has distinct content.
    """
    families = list(FAMILIES if families is None else families)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; known: {sorted(FAMILIES)}")
    if n and not families:
        raise ValueError("no task families given: name at least one (None: all)")
    seen = set(exclude or ())
    tasks: list[Task] = []
    for i in range(n):
        family = families[i % len(families)]
        for attempt in range(1000):
            task = make_task(family, random.Random(f"{seed}:{split}:{i}:{attempt}"), split)
            if task.instance_id not in seen:
                break
        else:
            raise ValueError(f"family {family} cannot produce {n} distinct instances")
        seen.add(task.instance_id)
        tasks.append(task)
    return tasks


def builtin_splits(
    n_train: int, n_heldout: int, seed: int, families: list[str] | None = None
) -> tuple[list[Task], list[Task]]:
    """Train and held-out sets of `families` (None: all) that share no instance (ids and contents both disjoint)."""
    train = generate_tasks(families, n_train, seed, "train")
    heldout = generate_tasks(families, n_heldout, seed + 7919, "heldout", exclude={t.instance_id for t in train})
    train_content = {json.dumps(t.files, sort_keys=True) for t in train}
    if train_content & {json.dumps(t.files, sort_keys=True) for t in heldout}:
        raise RuntimeError("built-in train and held-out splits share an instance")
    return train, heldout
