"""`legorl tasks synth`: mutation operators, F2P/P2P selection on a package built on the spot,
the written SWE-bench rows, and that a kept task passes validation. No network: the package is a
local directory."""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from legorl.tasks.loaders import load_jsonl
from legorl.tasks.mutate import OPERATORS, find_mutations, mutant_ok
from legorl.tasks.repo import GIT_OPTS, git_env
from legorl.tasks.synth import SynthConfig, find_test_files, synthesize_package, write_rows
from legorl.tasks.synth_runner import Runner


def changed(a: str, b: str) -> list[str]:
    return [
        ln for ln in difflib.unified_diff(a.splitlines(), b.splitlines(), n=0, lineterm="")
        if ln[:1] in "+-" and not ln.startswith(("+++", "---"))
    ]  # fmt: skip


def mutants(src: str, operator: str) -> dict[str, str]:
    """{mutated source: description} for one operator; every mutant parses and changes the AST."""
    out = {}
    for m in find_mutations(src, "m.py", (operator,)):
        new = m.apply(src)
        assert mutant_ok(src, new) is None, (m, new)
        out[new] = m.description
    return out


# ---- mutation operators ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operator", "src", "expected"),
    [
        ("compare", "def f(a, b):\n    return a < b\n", ["def f(a, b):\n    return a <= b\n"]),
        ("compare", "def f(a, b):\n    return a is not b\n", ["def f(a, b):\n    return a is b\n"]),
        ("compare", "def f(a, b):\n    return (a) not in (b)\n", ["def f(a, b):\n    return (a) in (b)\n"]),
        ("boolean", "def f(a, b):\n    return a and not b\n",
         ["def f(a, b):\n    return a or not b\n", "def f(a, b):\n    return a and b\n"]),
        ("arithmetic", "def f(a, b):\n    a += b\n    return a * b\n",
         ["def f(a, b):\n    a -= b\n    return a * b\n", "def f(a, b):\n    a += b\n    return a / b\n"]),
        ("off_by_one", "def f(xs):\n    return [xs[i] for i in range(len(xs) - 1)]\n",
         ["def f(xs):\n    return [xs[i] for i in range(len(xs))]\n",
          "def f(xs):\n    return [xs[i] for i in range(len(xs) - 2)]\n"]),
        ("off_by_one", "def f(xs, n):\n    return xs[n:], xs[-1]\n",
         ["def f(xs, n):\n    return xs[n + 1:], xs[-1]\n", "def f(xs, n):\n    return xs[n - 1:], xs[-1]\n",
          "def f(xs, n):\n    return xs[n:], xs[0]\n", "def f(xs, n):\n    return xs[n:], xs[-2]\n"]),
        ("constant", "def f(x):\n    return x * 0, True\n",
         ["def f(x):\n    return x * 1, True\n", "def f(x):\n    return x * 0, False\n"]),
        ("swap_args", "def f(a, b):\n    return divmod(a, b)\n", ["def f(a, b):\n    return divmod(b, a)\n"]),
        ("drop_return", "def f(a):\n    if a:\n        return 1\n    return 2\n",
         ["def f(a):\n    if a:\n        pass\n    return 2\n", "def f(a):\n    if a:\n        return 1\n    pass\n"]),
        ("builtin", "def f(xs, s):\n    return max(xs), s.startswith('x')\n",
         ["def f(xs, s):\n    return min(xs), s.startswith('x')\n",
          "def f(xs, s):\n    return max(xs), s.endswith('x')\n"]),
    ],
)  # fmt: skip
def test_operator_edits_only_its_tokens(operator: str, src: str, expected: list[str]) -> None:
    got = mutants(src, operator)
    assert sorted(got) == sorted(expected)
    for new in got:
        assert len(changed(src, new)) == 2  # one line out, one line in: a one-line gold patch


def test_drop_branch_removes_a_guard_or_an_else_block() -> None:
    src = textwrap.dedent("""\
        def f(x):
            if x < 0:
                x = -x
            if x > 10:
                return 10
            else:
                x += 1
            return x
        """)
    got = mutants(src, "drop_branch")
    guard = src.replace("    if x < 0:\n        x = -x\n", "    pass\n")
    no_else = src.replace("    else:\n        x += 1\n", "")
    assert set(got) == {guard, no_else}
    assert all(len(changed(src, new)) <= 3 for new in got)


def test_operators_keep_formatting_comments_and_unicode() -> None:
    src = 'def f(a, b):\n    s = "héllo wörld"; return (a <  # why\n        b)\n'
    (new,) = mutants(src, "compare")
    assert new == 'def f(a, b):\n    s = "héllo wörld"; return (a <=  # why\n        b)\n'


def test_environment_checks_docstrings_annotations_and_asserts_are_left_alone() -> None:
    src = textwrap.dedent('''\
        """Module doc: a < b and c."""
        import sys
        __version__ = "1.0"
        if sys.version_info >= (3, 8):
            X = 1
        def f(x: int = 0) -> bool:
            """x < 1 or not."""
            assert x >= 0
            return x
        ''')
    found = find_mutations(src, "m.py")
    assert [(m.operator, m.description) for m in found] == [
        ("constant", "0 -> 1"),  # the default value, not the annotation
        ("drop_return", "`return` replaced by `pass`"),
    ]
    with pytest.raises(ValueError, match="unknown mutation operators"):
        find_mutations(src, "m.py", ("nope",))
    assert set(OPERATORS) >= {"compare", "boolean", "off_by_one", "constant", "swap_args", "drop_branch",
                              "drop_return", "builtin"}  # fmt: skip


def test_mutant_ok_names_syntax_errors_and_equivalent_mutants() -> None:
    assert mutant_ok("x = 1\n", "x = (\n") == "syntax"
    assert mutant_ok("x = 1\n", "x  =  1  # same\n") == "equivalent"
    assert mutant_ok("x = 1\n", "x = 2\n") is None


# ---- synthesis on a tiny package --------------------------------------------------------------------

PKG = {
    "pyproject.toml": '[project]\nname = "tinypkg"\nversion = "0.1.0"\n',
    "tinypkg/__init__.py": textwrap.dedent("""\
        def clamp(x, lo, hi):
            if x < lo:
                return lo
            if x > hi:
                return hi
            return x


        def mean(xs):
            if not xs:
                return 0.0
            return sum(xs) / len(xs)


        def head(text, n):
            return text.split()[:n]
        """),
    "tests/test_clamp.py": textwrap.dedent("""\
        from tinypkg import clamp


        def test_inside():
            assert clamp(5, 0, 9) == 5


        def test_below():
            assert clamp(-3, 0, 9) == 0


        def test_above():
            assert clamp(12, 0, 9) == 9
        """),
    "tests/test_text.py": textwrap.dedent("""\
        from tinypkg import head, mean


        def test_mean():
            assert mean([1, 2, 3, 6]) == 3
            assert mean([]) == 0.0


        def test_head():
            assert head("a b c d", 2) == ["a", "b"]
        """),
}


def make_package(root: Path) -> Path:
    for rel, text in PKG.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("synth")
    pkg = make_package(base / "tinypkg-src")
    out = base / "out"
    cfg = SynthConfig(n=2, seed=0, max_attempts=8)
    res = synthesize_package(str(pkg), out, cfg, runner=Runner(), cache=base / "cache")
    assert not res.error, res.error
    write_rows(out, [res])
    return pkg, out, res, cfg


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *GIT_OPTS, *args], cwd=repo, env=git_env(repo), capture_output=True, text=True,
                          check=True).stdout  # fmt: skip


def test_layout_detection(tmp_path: Path) -> None:
    pkg = make_package(tmp_path / "p")
    assert find_test_files(pkg) == ["tests/test_clamp.py", "tests/test_text.py"]


def test_synth_keeps_bugs_that_tests_catch_and_writes_swebench_rows(synth) -> None:
    _, out, res, cfg = synth
    assert res.source.name == "tinypkg" and res.source.version == "0.1.0"
    assert res.usable_tests == 5 and 1 <= len(res.rows) <= cfg.n
    assert res.tried == len(res.rows) + sum(v for k, v in res.rejected.items() if k != "duplicate")
    tasks = {t.instance_id: t for t in load_jsonl(out / "tasks.jsonl")}
    assert sorted(tasks) == sorted(r["instance_id"] for r in res.rows)
    repo = out / "repos" / "tinypkg-0.1.0"
    pristine = git(repo, "rev-parse", "main").strip()
    for row in res.rows:
        for field in ("instance_id", "repo", "base_commit", "patch", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS",
                      "problem_statement", "repo_path", "version", "environment_setup_commit"):  # fmt: skip
            assert row[field], field
        assert isinstance(row["FAIL_TO_PASS"], str)  # JSON-encoded, as published
        task = tasks[row["instance_id"]]
        assert task.repo_path == str(repo.resolve()) and task.version == "0.1.0"
        f2p, p2p = task.FAIL_TO_PASS, task.PASS_TO_PASS
        hidden = sorted({t.split("::")[0] for t in f2p})
        assert f2p and not set(f2p) & set(p2p)
        # P2P: the other tests of the hidden files, every one of them
        assert {t.split("::")[0] for t in p2p} <= set(hidden)
        all_in_hidden = {f"{f}::{name}" for f in hidden for name in _test_names(PKG[f])}
        assert set(f2p) | set(p2p) == all_in_hidden
        # The agent's tree: the bug, no hidden test file; the gold patch touches the source only.
        tree = git(repo, "ls-tree", "-r", "--name-only", task.base_commit).split()
        assert not set(hidden) & set(tree) and "tinypkg/__init__.py" in tree
        assert "diff --git a/tinypkg/__init__.py" in task.patch and task.patch.count("diff --git") == 1
        assert all(f"+++ b/{f}" in task.test_patch for f in hidden) and "new file mode" in task.test_patch
        assert len(changed(git(repo, "show", f"{task.base_commit}:tinypkg/__init__.py"),
                           git(repo, "show", f"{pristine}:tinypkg/__init__.py"))) <= 6  # fmt: skip
        # No hint of the fix: no library frame, file, line or code of the bug.
        st = task.problem_statement
        assert all(t in st for t in f2p[:3]) and "tinypkg/__init__.py" not in st and "__init__.py" not in st
        bug_lines = [ln[1:].strip() for ln in changed(git(repo, "show", f"{pristine}:tinypkg/__init__.py"),
                     git(repo, "show", f"{task.base_commit}:tinypkg/__init__.py")) if ln.strip("+- ")]  # fmt: skip
        assert not [b for b in bug_lines if len(b) > 4 and b in st], bug_lines


def _test_names(text: str) -> list[str]:
    return [ln.split("(")[0][4:] for ln in text.splitlines() if ln.startswith("def test_")]


def test_synth_is_deterministic_for_a_seed(synth, tmp_path: Path) -> None:
    """Candidates are tried in a seeded order and kept in that order: a second run asked for one
    task finds the first task of the first run, byte for byte (ids, commits, patches, statement)."""
    pkg, _, res, cfg = synth
    cfg1 = dataclasses.replace(cfg, n=1)
    again = synthesize_package(str(pkg), tmp_path / "out", cfg1, runner=Runner(), cache=tmp_path / "cache")
    keys = (
        "instance_id",
        "base_commit",
        "patch",
        "test_patch",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "problem_statement",
    )
    assert [{k: r[k] for k in keys} for r in again.rows] == [{k: r[k] for k in keys} for r in res.rows[:1]]


def test_rejection_reasons_are_counted(tmp_path: Path) -> None:
    """A library whose only test checks nothing useful: every bug survives (`no_test_fails`)."""
    pkg = tmp_path / "weak"
    (pkg / "weak").mkdir(parents=True)
    (pkg / "weak" / "__init__.py").write_text("def add(a, b):\n    return a + b\n")
    (pkg / "test_weak.py").write_text("from weak import add\n\ndef test_runs():\n    add(1, 2)\n")
    res = synthesize_package(str(pkg), tmp_path / "out", SynthConfig(n=2, max_attempts=3), runner=Runner(),
                             cache=tmp_path / "c")  # fmt: skip
    assert res.rows == [] and res.rejected["no_test_fails"] == res.tried >= 1
    assert not (tmp_path / "out" / "repos" / "weak-0").exists()  # no task, no snapshot left


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_a_kept_task_validates(synth, tmp_path: Path) -> None:
    from legorl.grading.validate import validate_task

    out = synth[1]
    task = load_jsonl(out / "tasks.jsonl")[0]
    result = asyncio.run(validate_task(task, tmp_path, timeout=60, hide_paths=[out.resolve()],
                                       canaries=("test_edit", "hidden_test_lookup"), concurrency=4))  # fmt: skip
    assert result.ok, [(c.name, c.detail) for c in result.checks if not c.ok]
    assert {c.name for c in result.checks} == {"gold", "empty", "test_edit", "hidden_test_lookup"}


def test_synth_cli_rejects_bad_arguments(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from legorl.cli import app

    r = CliRunner().invoke(app, ["tasks", "synth", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "--package" in r.output
    r = CliRunner().invoke(
        app, ["tasks", "synth", "--package", "not a pin", "--out", str(tmp_path), "--no-validate"]
    )
    assert r.exit_code == 1 and "expected NAME==VERSION" in r.output
    r = CliRunner().invoke(
        app, ["tasks", "synth", "--package", "x==1", "--operator", "nope", "--out", str(tmp_path)]
    )
    assert r.exit_code == 2 and "unknown operators" in r.output
    assert json.loads((tmp_path / "synth-report.json").read_text())["kept"] == 0
