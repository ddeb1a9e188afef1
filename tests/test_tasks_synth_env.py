"""`legorl tasks synth` with task environments: a package's test dependencies read from its sdist, built
once (offline here: a local wheelhouse), used by its test runs, named in every row it yields and mounted by
the grader; a build that fails or outlasts its timeout is the package's typed error, never a crash."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from legorl.tasks.envs import STAMP, built, suite_requirements
from legorl.tasks.loaders import load_jsonl
from legorl.tasks.synth import SynthConfig, summary, synthesize_package, write_rows
from legorl.tasks.synth_runner import Runner


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    return root


def test_suite_requirements_reads_extras_groups_setup_files_and_markers(tmp_path: Path) -> None:
    root = _write(tmp_path / "p", {
        "pyproject.toml": """\
            [project]
            name = "My_Pkg"
            version = "1.0"
            dependencies = ["attrs>=22", "tomli; python_version < '3.0'"]
            [project.optional-dependencies]
            test = ["pytest>=7", "pytest-cov", "freezegun", "my-pkg[extra]", "coverage[toml]"]
            docs = ["sphinx", "furo", "markdown"]
            [dependency-groups]
            tests = ["hypothesis>=6", {include-group = "test"}]
            """,
        "setup.cfg": "[options]\ninstall_requires =\n    six\n[options.extras_require]\ntesting =\n    pretend\n",
        "setup.py": "from setuptools import setup\nsetup(tests_require=['mock'], extras_require={'test': ['wcwidth']})\n",
        "requirements/tests.txt": "# pinned\niniconfig==2.0.0\npluggy==1.4.0\nfreezegun==1.4.0\n-r base.txt\n",
    })  # fmt: skip
    # pytest, its plugins and its own dependencies stay the runner's; docs extras and the package itself are not
    # test dependencies; a marker false here drops its requirement; a requirements file's pin comes before an
    # extra's spelling of the same name.
    assert suite_requirements(root) == ["attrs>=22", "freezegun==1.4.0", "hypothesis>=6", "mock", "pretend", "six",
                                        "wcwidth"]  # fmt: skip
    assert suite_requirements(_write(tmp_path / "bare", {"setup.py": "import setuptools\n"})) == []


WHEEL_SRC = {
    "pyproject.toml": """\
        [build-system]
        requires = ["setuptools"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "envdep"
        version = "0.3"
        """,
    "envdep/__init__.py": "def double(x):\n    return 2 * x\n",
}

PKG = {
    "pyproject.toml": """\
        [project]
        name = "usesdep"
        version = "0.1"
        dependencies = ["envdep"]
        """,
    "usesdep/__init__.py": """\
        from envdep import double


        def quad(x):
            return double(x) + double(x)


        def is_big(x):
            return quad(x) > 100
        """,
    "tests/test_usesdep.py": """\
        from usesdep import is_big, quad


        def test_quad():
            assert quad(3) == 12


        def test_big():
            assert is_big(30) and not is_big(2)
        """,
}


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("wheels")
    src = _write(base / "envdep-src", WHEEL_SRC)
    house = base / "house"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-index", "--no-build-isolation",
                    "--no-deps", "-w", str(house), str(src)], check=True, capture_output=True)  # fmt: skip
    return house


def _cfg(wheelhouse: Path, **kw) -> SynthConfig:
    return SynthConfig(n=1, seed=0, max_attempts=6, env_pip_args=("--no-index", "--find-links", str(wheelhouse)),
                       **kw)  # fmt: skip


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_synth_builds_the_environment_once_uses_it_and_the_grader_mounts_it(wheelhouse: Path, tmp_path: Path) -> None:
    from legorl.grading.validate import validate_task

    pkg = _write(tmp_path / "usesdep-src", PKG)
    out = tmp_path / "out"
    # Without its environment the suite cannot import its dependency: nothing passes, nothing to mine.
    bare = synthesize_package(str(pkg), out, _cfg(wheelhouse, environments=False), runner=Runner(),
                              cache=tmp_path / "c")  # fmt: skip
    assert "no test passes" in bare.error and not bare.rows

    res = synthesize_package(str(pkg), out, _cfg(wheelhouse), runner=Runner(), cache=tmp_path / "c")
    assert not res.error, res.error
    assert res.requirements == ["envdep"] and "envdep==0.3" in res.environment and res.rows
    env = out / "envs" / "usesdep-0.1"
    assert built(env) and (env / "envdep" / "__init__.py").is_file()
    stamp = (env / STAMP).read_text()
    again = synthesize_package(str(pkg), out, _cfg(wheelhouse), runner=Runner(), cache=tmp_path / "c")
    assert (env / STAMP).read_text() == stamp and again.rows  # found, not rebuilt
    write_rows(out, [res])
    rep = summary([res])["packages"][0]
    assert "envdep==0.3" in rep["environment"] and rep["requirements"] == ["envdep"]
    row = json.loads((out / "tasks.jsonl").read_text().splitlines()[0])
    assert row["environment"] == "envs/usesdep-0.1"  # relative to the tasks file, like repo_path
    task = load_jsonl(out / "tasks.jsonl")[0]
    assert task.environment == str(env.resolve())
    result = asyncio.run(validate_task(task, tmp_path, timeout=60, hide_paths=[out.resolve()],
                                       canaries=("test_edit",), concurrency=3))  # fmt: skip
    assert result.ok, [(c.name, c.detail) for c in result.checks if not c.ok]
    assert {c.name for c in result.checks} == {"gold", "empty", "test_edit"}


def test_a_broken_or_slow_environment_is_the_packages_typed_error(wheelhouse: Path, tmp_path: Path) -> None:
    broken = dict(PKG, **{"pyproject.toml": PKG["pyproject.toml"].replace('["envdep"]', '["no-such-dist-legorl"]')})
    pkg = _write(tmp_path / "broken", broken)
    res = synthesize_package(str(pkg), tmp_path / "out", _cfg(wheelhouse), runner=Runner(), cache=tmp_path / "c")
    assert "building the environment usesdep-0.1 failed" in res.error and "no-such-dist-legorl" in res.error
    assert not res.rows and not (tmp_path / "out" / "envs" / "usesdep-0.1").exists()  # nothing half-built

    slow = synthesize_package(str(_write(tmp_path / "slow", PKG)), tmp_path / "out2", _cfg(wheelhouse, env_timeout=0.05),
                              runner=Runner(), cache=tmp_path / "c")  # fmt: skip
    assert "took longer than" in slow.error and not slow.rows
    assert not (tmp_path / "out2" / "envs" / "usesdep-0.1").exists()


def test_only_new_keeps_earlier_packages_and_names_what_this_run_mined(tmp_path: Path) -> None:
    """`legorl tasks synth --only-new`: packages with rows in OUT are skipped; their report entries stay."""
    from typer.testing import CliRunner

    from legorl.cli import app
    from legorl.grading.synth_cli import _existing_packages, _write_report
    from legorl.tasks.synth import PackageResult, PackageSource

    out = tmp_path / "out"
    out.mkdir()
    (out / "tasks.jsonl").write_text(json.dumps({"instance_id": "a-1__x", "repo_path": "repos/a-1"}) + "\n")
    earlier = {"packages": [{"package": "a-1", "kept": 1}, {"package": "b-2", "kept": 0}], "kept": 1,
               "validated": True, "invalid": {"b-2": {"b": "gold"}}, "errors": {}}  # fmt: skip
    (out / "synth-report.json").write_text(json.dumps(earlier))
    assert _existing_packages(out) == {"a-1"}
    res = PackageResult(PackageSource("b", "2", tmp_path, "pypi:b==2"), rows=[{"instance_id": "b-2__y"}] * 3)
    rep = _write_report(out, [res], True, {}, {}, earlier)
    assert [p["package"] for p in rep["packages"]] == ["a-1", "b-2"] and rep["this_run"] == ["b-2"]
    assert rep["kept"] == 4 and rep["invalid"] == {} and rep["validated"]
    # Every named package already has tasks: nothing is fetched, the earlier report stays.
    (out / "synth-report.json").write_text(json.dumps(earlier))
    r = CliRunner().invoke(app, ["tasks", "synth", "--package", "A==1", "--out", str(out), "--only-new"])
    assert r.exit_code == 0, r.output
    assert "1 packages already have tasks" in r.output and json.loads((out / "synth-report.json").read_text()) == earlier


def test_suite_requirements_adds_an_optional_dependency_the_tests_import(tmp_path: Path) -> None:
    """tabulate's case: `wcwidth` is the `widechars` extra, not a test extra, but its tests import it."""
    files = {
        "pyproject.toml": '[project]\nname = "tab"\nversion = "1"\n[project.optional-dependencies]\n'
        'widechars = ["wcwidth"]\ndocs = ["sphinx-thing"]\n',
        "tab/__init__.py": "",
    }  # fmt: skip
    assert suite_requirements(_write(tmp_path / "no-import", files)) == []
    uses = _write(tmp_path / "imports", {**files, "test/test_tab.py": "import wcwidth\n\ndef test_w():\n    pass\n"})
    assert suite_requirements(uses) == ["wcwidth"]
    # The same extra read from PKG-INFO (an sdist whose pyproject has no [project] table), importorskip too.
    meta = _write(tmp_path / "pkg-info", {
        "PKG-INFO": 'Metadata-Version: 2.1\nName: tab\nVersion: 1\nProvides-Extra: widechars\n'
                    'Requires-Dist: wcwidth; extra == "widechars"\n',
        "tests/test_tab.py": "import pytest\n\nwcwidth = pytest.importorskip('wcwidth')\n",
    })  # fmt: skip
    assert suite_requirements(meta) == ["wcwidth"]


# A src layout without any pytest ini file (`-o pythonpath=src`: pytest 7.2, the image's, stops at collection there:
# cachetools, humanize, text-unidecode), and a test that uses a module this interpreter's venv has and the image
# does not (`rich`; tabulate's wcwidth, numpy, pandas): mined against the venv, both made tasks whose gold patch
# failed on the docker backend.
ISOLATED_PKG = {
    "pyproject.toml": '[project]\nname = "isopkg"\nversion = "0.2"\n',
    "src/isopkg/__init__.py": """\
        def clamp(x, lo, hi):
            if x < lo:
                return lo
            if x > hi:
                return hi
            return x
        """,
    "tests/test_isopkg.py": """\
        import pytest

        from isopkg import clamp


        def test_inside():
            assert clamp(5, 0, 9) == 5


        def test_edges():
            assert clamp(-3, 0, 9) == 0 and clamp(12, 0, 9) == 9


        def test_with_an_undeclared_module():
            rich = pytest.importorskip("rich")
            assert rich and clamp(1, 0, 9) == 1
        """,
}


@pytest.fixture(scope="module")
def isolated_task(tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed")
    base = tmp_path_factory.mktemp("isolated")
    out = base / "out"
    res = synthesize_package(str(_write(base / "src", ISOLATED_PKG)), out, SynthConfig(n=1, seed=0, max_attempts=6),
                             runner=Runner(), cache=base / "c")  # fmt: skip
    assert not res.error and res.rows, res.error
    write_rows(out, [res])
    return out, res, load_jsonl(out / "tasks.jsonl")[0]


def test_mining_runs_in_the_tasks_own_environment(isolated_task) -> None:
    """Mined with `python -S` on the package's environment, which carries this interpreter's pytest: a test
    that needs a module of the venv only is skipped there, so no task grades it."""
    import importlib.metadata

    from legorl.tasks.envs import has_runner

    out, res, task = isolated_task
    assert task.test_command == "python -S -m pytest -q -o addopts= -o pythonpath=src"
    env = out / "envs" / "isopkg-0.2"
    assert task.environment == str(env.resolve()) and has_runner(env)
    assert f"pytest=={importlib.metadata.version('pytest')}" in res.environment
    assert (env / "pytest" / "__init__.py").is_file() and (env / "_pytest").is_dir()
    graded = [*task.FAIL_TO_PASS, *task.PASS_TO_PASS]
    assert "tests/test_isopkg.py::test_inside" in graded and "tests/test_isopkg.py::test_edges" in graded
    assert not [t for t in graded if "undeclared" in t]


def test_a_mined_task_grades_the_same_on_both_backends(isolated_task, tmp_path: Path, box_cfg) -> None:
    """Gold resolves and the empty patch does not, on bwrap and in the image alike."""
    from legorl.grading.validate import validate_task

    out, _, task = isolated_task
    result = asyncio.run(validate_task(task, tmp_path, timeout=60, hide_paths=[out.resolve()], canaries=(),
                                       concurrency=2, sandbox=box_cfg))  # fmt: skip
    assert result.ok, [(c.name, c.detail) for c in result.checks if not c.ok]
    assert {c.name for c in result.checks} == {"gold", "empty"}


def test_add_environments_moves_rows_mined_without_one_onto_their_own(tmp_path: Path) -> None:
    """`legorl tasks synth --add-environments`: rows mined before environments get their package's (runner
    included) and the `python -S` command; rows that have one are left alone; an unknown command is refused."""
    from legorl.tasks.envs import has_runner
    from legorl.tasks.schema import TaskError
    from legorl.tasks.synth import add_environments

    out = tmp_path / "out"
    _write(out / "repos" / "p-1", {"PKG-INFO": "Metadata-Version: 2.1\nName: p\nVersion: 1\n"})
    rows = [{"instance_id": "p-1__a", "repo_path": "repos/p-1", "test_command": "python -m pytest -q -o addopts="},
            {"instance_id": "p-1__b", "repo_path": "repos/p-1", "test_command": "python -m pytest -q"}]  # fmt: skip
    (out / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = add_environments(out, SynthConfig())
    assert list(done) == ["p-1"] and any(d.startswith("pytest==") for d in done["p-1"])
    got = [json.loads(line) for line in (out / "tasks.jsonl").read_text().splitlines()]
    assert [r["test_command"] for r in got] == ["python -S -m pytest -q -o addopts=", "python -S -m pytest -q"]
    assert {r["environment"] for r in got} == {"envs/p-1"} and has_runner(out / "envs" / "p-1")
    assert add_environments(out, SynthConfig()) == {}  # already done
    rows[0]["instance_id"], rows[0]["test_command"] = "p-1__c", "make check"
    (out / "tasks.jsonl").write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(TaskError, match="is not `python -m pytest"):
        add_environments(out, SynthConfig())
