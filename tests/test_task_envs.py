"""Task environments (legorl.tasks.envs): built once on the host, mounted read-only into the agent's and the
grader's sandboxes on both backends; a broken, missing or slow one is a typed error, never a crash."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from legorl.config import SandboxConfig
from legorl.grading import grade
from legorl.records import Outcome
from legorl.sandbox import SandboxError, create_sandbox
from legorl.tasks import Task
from legorl.tasks.builtin import unified_diff
from legorl.tasks.envs import STAMP, TaskEnvironmentError, build_environment, built
from legorl.tasks.loaders import load_jsonl

OFFLINE = ["--no-index", "--no-build-isolation"]
BUGGY = "from envdemo import double\n\n\ndef quad(x):\n    return double(x) + double(x) - 1\n"
FIXED = "from envdemo import double\n\n\ndef quad(x):\n    return double(x) + double(x)\n"


def demo_package(root: Path) -> Path:
    """A local distribution (no index needed): `envdemo.double`."""
    pkg = root / "envdemo-src"
    (pkg / "envdemo").mkdir(parents=True)
    (pkg / "envdemo" / "__init__.py").write_text("def double(x):\n    return 2 * x\n")
    (pkg / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n\n'
        '[project]\nname = "envdemo"\nversion = "0.1"\n'
    )
    return pkg


@pytest.fixture(scope="module")
def env_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("envs")
    return build_environment([str(demo_package(root))], root / "envdemo-0.1", pip_args=OFFLINE, timeout=300)


def env_task(env: Path | str) -> Task:
    hidden = "from pkg.core import quad\n\n\ndef test_quad():\n    assert quad(3) == 12\n\n\ndef test_zero():\n    assert quad(0) == 0 or True\n"
    return Task(instance_id="env-demo-1", repo="test/envdemo", problem_statement="quad(3) should be 12",
                files={"pkg/__init__.py": "", "pkg/core.py": BUGGY, "tests/test_basic.py": "def test_ok():\n    pass\n"},
                hidden_files={"tests/test_hidden.py": hidden}, patch=unified_diff("pkg/core.py", BUGGY, FIXED),
                FAIL_TO_PASS=["tests/test_hidden.py::test_quad"], PASS_TO_PASS=["tests/test_hidden.py::test_zero"],
                environment=str(env))  # fmt: skip


def test_build_once_then_cached_and_failures_are_typed(tmp_path: Path, env_dir: Path) -> None:
    assert built(env_dir) and (env_dir / "envdemo" / "__init__.py").is_file()
    stamp = (env_dir / STAMP).read_text()
    t0 = time.monotonic()
    assert build_environment([json.loads(stamp)["requirements"][0]], env_dir, pip_args=OFFLINE) == env_dir
    assert time.monotonic() - t0 < 10 and (env_dir / STAMP).read_text() == stamp  # found, not rebuilt
    with pytest.raises(TaskEnvironmentError, match="failed"):
        build_environment([str(tmp_path / "no-such-package")], tmp_path / "broken", pip_args=OFFLINE)
    with pytest.raises(TaskEnvironmentError, match="took longer than"):
        build_environment([str(demo_package(tmp_path))], tmp_path / "slow", pip_args=OFFLINE, timeout=0.01)
    assert not (tmp_path / "broken").exists() and not (tmp_path / "slow").exists()  # nothing half-built
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_environment_is_read_only_in_sandboxes_and_grading_uses_it(tmp_path: Path, env_dir: Path,
                                                                    box_cfg: SandboxConfig) -> None:
    task = env_task(env_dir)

    async def main():
        (tmp_path / "ws").mkdir()
        box = await create_sandbox(box_cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb", label="env",
                                   environment=task.environment)  # fmt: skip
        try:
            r = await box.exec("python3 -c 'import envdemo; print(envdemo.double(21))'; "
                               "touch $LEGORL_TASK_ENV/x 2>/dev/null; echo rc=$?; "
                               "echo 'def double(x): return 0' > $LEGORL_TASK_ENV/envdemo/__init__.py; echo rc=$?")
        finally:
            await box.close()
        gold, empty = await asyncio.gather(grade(task, task.patch, work_dir=tmp_path / "g", sandbox=box_cfg),
                                           grade(task, "", work_dir=tmp_path / "g", sandbox=box_cfg))  # fmt: skip
        return r, gold, empty

    r, gold, empty = asyncio.run(main())
    lines = r.output.split()
    assert lines[0] == "42" and lines[1] != "rc=0" and lines[-1] != "rc=0", r.output
    assert (env_dir / "envdemo" / "__init__.py").read_text().startswith("def double(x):\n    return 2")
    assert gold.outcome == Outcome.RESOLVED, (gold.reason, gold.log_tail)
    assert empty.outcome == Outcome.UNRESOLVED and empty.tests["tests/test_hidden.py::test_quad"] == "failed"


def test_a_missing_environment_is_a_typed_error(tmp_path: Path, box_cfg: SandboxConfig) -> None:
    task = env_task(tmp_path / "never-built")
    (tmp_path / "half").mkdir()

    async def main():
        (tmp_path / "ws").mkdir()
        for env in (task.environment, tmp_path / "half"):
            with pytest.raises(SandboxError, match="task environment"):
                await create_sandbox(box_cfg, workspace=tmp_path / "ws", sandbox_dir=tmp_path / "sb", label="env",
                                     environment=env)  # fmt: skip
        return await grade(task, task.patch, work_dir=tmp_path / "g", sandbox=box_cfg)

    rep = asyncio.run(main())
    assert rep.outcome == Outcome.GRADER_ERROR and "task environment" in rep.reason and "does not exist" in rep.reason


def test_a_relative_environment_in_a_jsonl_row_is_resolved_against_the_file(tmp_path: Path) -> None:
    row = env_task("envs/envdemo-0.1").model_dump(exclude_defaults=True)
    (tmp_path / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    assert load_jsonl(tmp_path / "tasks.jsonl")[0].environment == str(tmp_path / "envs" / "envdemo-0.1")
