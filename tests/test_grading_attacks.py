"""The attack pass of issue #39: each patch below was graded resolved before; each must now be unresolved with
a reason that names it, on both sandbox backends, while the gold patch still resolves. Each defence is also
tested alone, with the layer in front of it switched off: the patch's effect on the tree (effect.py) with a
text filter that keeps everything, the verifier-owned config (``-c``) with a policy that forgot a config
name, the audit hook with names the static scan cannot read."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from legorl.config import SandboxConfig
from legorl.grading import effect, grade, grader, policy
from legorl.grading.policy import FilteredDiff, filter_diff_detailed, split_diff
from legorl.records import Outcome
from legorl.tasks import generate_tasks, prepare_repo
from legorl.tasks.builtin import unified_diff

TASK = generate_tasks(["wrong_operator"], 1, seed=21, split="train")[0]
MODULE = next(p for p in TASK.files if p.startswith("pkg_") and not p.endswith("__init__.py"))
PKG = MODULE.split("/")[0]
FORCE_PASS = "def pytest_pyfunc_call(pyfuncitem):\n    return True\n"


def touch_module(extra: str = "# tidy\n") -> str:
    """A valid hunk on the package module that fixes nothing."""
    return unified_diff(MODULE, TASK.files[MODULE], TASK.files[MODULE] + extra)


def new_file_traditional(path: str, content: str) -> str:
    lines = content.splitlines(keepends=True)
    return f"--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n" + "".join("+" + line for line in lines)


def new_file_git(path: str, content: str, mode: str = "100644") -> str:
    lines = content.splitlines(keepends=True)
    return (f"diff --git a/{path} b/{path}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1,{len(lines)} @@\n" + "".join("+" + line for line in lines))  # fmt: skip


def symlink_section(path: str, target: str, mode: str) -> str:
    return (f"diff --git a/{path} b/{path}\nnew file mode {mode}\n--- /dev/null\n+++ b/{path}\n"
            f"@@ -0,0 +1 @@\n+{target}\n\\ No newline at end of file\n")  # fmt: skip


ATTACKS = {
    # 1. a traditional section after a git hunk: git creates conftest.py
    "conftest after a hunk": touch_module() + new_file_traditional("conftest.py", FORCE_PASS),
    # 2. pytest 9's first config names, loading a plugin of the package before collection
    "pytest.toml addopts": touch_module() + new_file_git(f"{PKG}/compat.py", FORCE_PASS)
    + new_file_git("pytest.toml", f'[pytest]\naddopts = ["-p", "{PKG}.compat"]\n'),
    ".pytest.toml addopts": touch_module() + new_file_git(f"{PKG}/compat.py", FORCE_PASS)
    + new_file_git(".pytest.toml", f'[pytest]\naddopts = ["-p", "{PKG}.compat"]\n'),
    # 3. pytest patched through names built at run time
    "setattr through importlib": touch_module(
        "import importlib as _il\n"
        "setattr(_il.import_module('_py' + 'test.python').Function, 'run' + 'test', lambda self: None)\n"
    ),
    "class dict through gc": touch_module(
        "import gc as _gc, importlib as _il\n"
        "_F = _il.import_module('_py' + 'test.python').Function\n"
        "_gc.get_referents(_F.__dict__)[0]['run' + 'test'] = lambda self: None\n"
    ),
    # the small one: a link spelt with another mode
    "link mode 0120000": touch_module() + symlink_section(f"{PKG}/passwd", "/etc/passwd", "0120000"),
    "link mode 120777": touch_module() + symlink_section(f"{PKG}/passwd", "/etc/passwd", "120777"),
}
NAMED = {  # what each verdict's reason must name
    "conftest after a hunk": "conftest.py", "pytest.toml addopts": "pytest.toml",
    ".pytest.toml addopts": ".pytest.toml", "setattr through importlib": "Function.runtest",
    "class dict through gc": "Function.runtest", "link mode 0120000": f"{PKG}/passwd",
    "link mode 120777": f"{PKG}/passwd",
}  # fmt: skip


async def _grade_all(diffs: dict[str, str], work: Path, cfg: SandboxConfig | None) -> dict:
    sem = asyncio.Semaphore(3)

    async def one(diff: str):
        async with sem:
            return await grade(TASK, diff, work_dir=work, sandbox=cfg)

    return dict(zip(diffs, await asyncio.gather(*(one(d) for d in diffs.values())), strict=True))


def _check(reports: dict) -> None:
    assert reports["gold"].outcome == Outcome.RESOLVED, reports["gold"].reason
    for name, report in reports.items():
        if name == "gold":
            continue
        assert report.outcome == Outcome.UNRESOLVED and not report.resolved, (name, report.outcome, report.reason)
        assert NAMED[name] in report.reason, (name, report.reason)


def test_each_attack_is_unresolved_and_named(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    _check(asyncio.run(_grade_all({"gold": TASK.patch, **ATTACKS}, tmp_path, box_cfg)))


def test_the_effect_on_the_tree_holds_without_the_text_filter(tmp_path: Path, monkeypatch) -> None:
    """A text filter that keeps every section: the effect check alone drops the files and links."""

    def keep_all(diff: str, protected=frozenset(), base_paths=None) -> FilteredDiff:
        paths = sorted({p for sec in split_diff(diff) for p in sec.paths})
        return FilteredDiff(diff, "", paths, [], {})

    monkeypatch.setattr(grader, "filter_diff_detailed", keep_all)
    names = ["conftest after a hunk", "pytest.toml addopts", "link mode 0120000", "link mode 120777"]
    _check(asyncio.run(_grade_all({"gold": TASK.patch, **{n: ATTACKS[n] for n in names}}, tmp_path, None)))


def test_the_verifier_config_holds_when_the_policy_forgets_a_config_name(tmp_path: Path, monkeypatch) -> None:
    """As if a new pytest read a config name the policy does not know: `-c` reads the pristine config only."""
    monkeypatch.setattr(policy, "TEST_FILE_GLOBS", tuple(g for g in policy.TEST_FILE_GLOBS if "pytest.toml" not in g))
    reports = asyncio.run(_grade_all({"gold": TASK.patch, "toml": ATTACKS["pytest.toml addopts"]}, tmp_path, None))
    assert reports["gold"].outcome == Outcome.RESOLVED, reports["gold"].reason
    assert reports["toml"].outcome == Outcome.UNRESOLVED and "pytest.toml" in reports["toml"].applied_paths


def test_the_policy_knows_every_config_name_of_the_installed_pytest() -> None:
    from _pytest.config import findpaths

    names = set(getattr(findpaths, "CONFIG_LOADERS_BY_NAME", {}))  # pytest >= 9 keeps them in one table
    if not names:  # pytest 8: the names are literals in locate_config
        import ast
        import inspect

        tree = ast.parse(inspect.getsource(findpaths.locate_config).lstrip())
        names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                 and "." in n.value and " " not in n.value}  # fmt: skip
    assert names and names <= set(policy.PYTEST_CONFIG_FILES), names - set(policy.PYTEST_CONFIG_FILES)
    assert all(policy.is_test_path(n) and policy.is_test_path(f"sub/{n}") for n in policy.PYTEST_CONFIG_FILES)


def test_a_patch_over_the_size_limit_is_refused_as_such(tmp_path: Path) -> None:
    big = touch_module("#" + "x" * (policy.MAX_PATCH_BYTES + 10) + "\n")
    report = asyncio.run(grade(TASK, big, work_dir=tmp_path))
    assert report.outcome == Outcome.UNRESOLVED and "patch too large" in report.reason


def test_splitting_is_linear_and_sees_sections_after_hunks() -> None:
    secs = split_diff(ATTACKS["conftest after a hunk"])
    assert [sorted(s.paths) for s in secs] == [[MODULE], ["conftest.py"]]
    assert filter_diff_detailed(ATTACKS["link mode 120777"]).reasons == {f"{PKG}/passwd": "symlink or submodule"}
    # a hunk line that looks like a header is content: its counts say so
    body = touch_module("x = '''\n--- a/y\n+++ b/y\n'''\n")
    assert [sorted(s.paths) for s in split_diff(body)] == [[MODULE]]
    n = 200_000  # a 2 MB-scale patch: counting, not re-joining, keeps it linear (the old filter took ~35 s here)
    huge = new_file_git(f"{PKG}/data.py", "".join(f"v{i} = {i}\n" for i in range(n)))
    assert len(split_diff(huge)) == 1 and sum(map(len, split_diff(huge)[0].lines)) == len(huge)


# ---- property: whatever git applies, the grading tree changes only where the report says ---------------

hypothesis = pytest.importorskip("hypothesis")
st = pytest.importorskip("hypothesis.strategies")

NAMES = ["pkg/a.py", "pkg/b.py", "conftest.py", "pytest.toml", "tests/test_x.py", "pkg/sub/c.py", "json.py",
         "pkg/link", "setup.cfg", "pkg/x.pth", ".pytest.toml", "sitecustomize.py"]  # fmt: skip
MODES = ["100644", "100755", "120000", "0120000", "120777", "160000", " 120000"]


@st.composite
def patches(draw) -> str:
    out = []
    for _ in range(draw(st.integers(1, 5))):
        path = draw(st.sampled_from(NAMES))
        content = draw(st.sampled_from(["x = 1\n", "import os\n", "/etc/passwd\n", "a\nb\n"]))
        style = draw(st.sampled_from(["git", "traditional", "rename"]))
        if style == "git":
            out.append(new_file_git(path, content, draw(st.sampled_from(MODES))))
        elif style == "traditional":
            out.append(new_file_traditional(path, content))
        else:
            target = draw(st.sampled_from(NAMES))
            out.append(f"diff --git a/pkg/a.py b/{target}\nsimilarity index 100%\nrename from pkg/a.py\n"
                       f"rename to {target}\n")  # fmt: skip
    return "".join(out)


def _git_apply(tree: Path, diff: str) -> bool:
    r = subprocess.run(["git", "apply", "--whitespace=nowarn", "--binary", "-"], cwd=tree, input=diff.encode(), check=False,
                       capture_output=True, env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(tree)})  # fmt: skip
    return r.returncode == 0


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(diff=patches())
def test_the_grading_tree_changes_only_within_the_applied_paths(tmp_path_factory, diff: str) -> None:
    root = tmp_path_factory.mktemp("prop")
    pristine, tree = root / "pristine", root / "tree"
    for d in (pristine, tree):
        (d / "pkg").mkdir(parents=True)
        (d / "pkg" / "a.py").write_text("a = 0\n")
    before = effect.snapshot(tree)
    filtered = filter_diff_detailed(diff, base_paths={"pkg", "pkg/a.py"})
    if filtered.kept.strip() and not _git_apply(tree, filtered.kept):
        return  # git refused the kept part: nothing applied
    done = effect.judge(tree, before, pristine, frozenset(), frozenset({"pkg", "pkg/a.py"}))
    now, was = _contents(tree), _contents(pristine)
    changed = {p for p in set(now) | set(was) if now.get(p) != was.get(p) and now.get(p) != ("dir",)}
    assert changed <= set(done.applied) <= set(filtered.applied_paths)
    for p in changed:
        assert now.get(p, ("file",))[0] == "file", p
        assert not policy.path_reason(p, frozenset(), frozenset({"pkg", "pkg/a.py"})), p
    assert not any(kind == "link" for kind, *_ in now.values())


def _contents(root: Path) -> dict[str, tuple]:
    """Every entry under ``root``: what it is and holds (links not followed)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", os.stat(path).st_mode & 0o777, Path(path).read_bytes())
    return out


def test_prepare_repo_is_unchanged_by_the_pristine_move(tmp_path: Path) -> None:
    """The pristine cache moved next to prepare_repo (tasks/pristine.py): its copy is what prepare_repo writes."""
    from legorl.tasks.pristine import PRISTINE

    base = prepare_repo(TASK, tmp_path / "a")
    entry = PRISTINE.copy(TASK, tmp_path / "b")
    assert entry.base == base and effect.snapshot(tmp_path / "a").keys() == effect.snapshot(tmp_path / "b").keys()


def test_a_large_patch_is_filtered_in_a_worker_process_with_the_same_result() -> None:
    from legorl.grading.grader import BIG_PATCH_BYTES, filter_off_loop

    diff = ATTACKS["conftest after a hunk"] + new_file_git(f"{PKG}/data.py", "x = 1\n" * (BIG_PATCH_BYTES // 7))
    assert len(diff) > BIG_PATCH_BYTES
    off = asyncio.run(filter_off_loop(diff, {"tests/test_hidden.py"}, frozenset({PKG})))
    assert off == filter_diff_detailed(diff, protected={"tests/test_hidden.py"}, base_paths=frozenset({PKG}))
    assert off.reasons == {"conftest.py": "test or test-infrastructure path"}
