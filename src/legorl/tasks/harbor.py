"""Harbor and terminal-bench task directories -> Task.

Harbor (``task.toml``)::

    task/  task.toml  instruction.md  environment/Dockerfile (+ build context)
           tests/test.sh  tests/test_*.py ...  solution/solve.sh

terminal-bench v1 (``task.yaml`` with the instruction inside)::

    task/  task.yaml  Dockerfile  docker-compose.yaml  run-tests.sh  solution.sh  tests/test_outputs.py

Mapping: the instruction becomes ``problem_statement``; the files the Dockerfile COPYs/ADDs
under its final WORKDIR become the workspace (``files`` / ``binary_files``) and that WORKDIR
the sandbox's ``workdir`` (``/app`` usually); ``tests/`` becomes ``hidden_files`` mounted
read-only at ``tests_dir = "/tests"`` in the grading sandbox only; the pytest tests found in
those files are the FAIL_TO_PASS list (graded by legorl's verifier, not by test.sh and its
reward file); the solution script is kept as ``solution_script`` (the gold patch is its diff);
timeouts and resources go to ``limits``; ``docker_image`` to ``image``.

Not mapped: Dockerfile RUN steps (listed in ``environment_notes``: the bwrap backend uses the
host's toolchain; build the image and use the docker backend when a task needs them), and
non-pytest verifiers (a TaskError says so).
"""

from __future__ import annotations

import ast
import base64
import json
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from legorl.tasks.schema import Task, TaskError

TESTS_DIR = "/tests"
INFRA_FILES = {
    "task.toml", "task.yaml", "instruction.md", "Dockerfile", "docker-compose.yaml", "docker-compose.yml",
    "run-tests.sh", "solution.sh", "solution.yaml",
}  # fmt: skip
INFRA_DIRS = {"tests", "solution", ".git"}
MAX_FILE_BYTES = 16 * 1024 * 1024


def is_task_dir(path: Path) -> bool:
    return (path / "task.toml").is_file() or (path / "task.yaml").is_file()


def load_task_dirs(path: Path | str) -> list[Task]:
    """One task dir, or a dir whose sub-dirs are task dirs (sorted by name)."""
    path = Path(path)
    if is_task_dir(path):
        return [load_task_dir(path)]
    dirs = sorted(p for p in path.iterdir() if p.is_dir() and is_task_dir(p)) if path.is_dir() else []
    if not dirs:
        raise TaskError(f"{path}: not a Harbor/terminal-bench task dir (no task.toml or task.yaml) nor a dir of them")
    return [load_task_dir(p) for p in dirs]


def _memory_mb(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(value), re.IGNORECASE)
    if not m:
        raise TaskError(f"cannot read a memory size from {value!r} (use e.g. 2048 or '4G')")
    scale = {"": 1 / (1024 * 1024), "k": 1 / 1024, "m": 1, "g": 1024, "t": 1024 * 1024}[m[2].lower()]
    return int(float(m[1]) * scale)


def _read_config(d: Path) -> tuple[dict[str, Any], str, str]:
    """(config, instruction, flavour)."""
    if (d / "task.toml").is_file():
        try:
            cfg = tomllib.loads((d / "task.toml").read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise TaskError(f"{d / 'task.toml'}: not valid TOML: {e}") from e
        instruction_file = d / "instruction.md"
        if not instruction_file.is_file():
            raise TaskError(f"{d}: Harbor task without instruction.md")
        return cfg, instruction_file.read_text(encoding="utf-8"), "harbor"
    try:
        cfg = yaml.safe_load((d / "task.yaml").read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as e:
        raise TaskError(f"{d / 'task.yaml'}: not valid YAML: {e}") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("instruction"), str):
        raise TaskError(f"{d / 'task.yaml'}: terminal-bench task needs an `instruction` string")
    return cfg, cfg["instruction"], "terminal-bench"


def _dockerfile_layout(dockerfile: Path) -> tuple[str, list[tuple[list[str], str]], list[str]]:
    """(final WORKDIR, [(sources, dest)], notes) from a Dockerfile's WORKDIR/COPY/ADD/RUN lines."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text(encoding="utf-8"))
    workdir, copies, notes = "/", [], []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "WORKDIR":
            wd = rest.strip().strip('"')
            workdir = wd if wd.startswith("/") else str(PurePosixPath(workdir) / wd)
        elif word in ("COPY", "ADD"):
            rest = rest.strip()
            if rest.startswith("["):
                args = json.loads(rest)
            else:
                args = [a for a in shlex.split(rest) if not a.startswith("--")]
            if any(a.startswith("--from") for a in shlex.split(rest)) or len(args) < 2:
                notes.append(f"skipped: {line}")
                continue
            dest = args[-1]
            dest = dest if dest.startswith("/") else str(PurePosixPath(workdir) / dest)
            copies.append((args[:-1], dest))
        elif word == "RUN":
            notes.append(f"not run by the bwrap backend: {line[:200]}")
    return workdir, copies, notes


def _add_file(files: dict[str, str], binary: dict[str, str], rel: str, src: Path) -> None:
    data = src.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        raise TaskError(f"{src}: larger than {MAX_FILE_BYTES} bytes")
    try:
        files[rel] = data.decode("utf-8")
    except UnicodeDecodeError:
        binary[rel] = base64.b64encode(data).decode()


def _workspace_files(context: Path, dockerfile: Path | None, skip_infra: bool) -> tuple[str, dict, dict, list[str]]:
    files: dict[str, str] = {}
    binary: dict[str, str] = {}

    def allowed(p: Path) -> bool:
        rel = p.relative_to(context)
        top_file = len(rel.parts) == 1
        if top_file and rel.name in ("Dockerfile", "docker-compose.yaml", "docker-compose.yml"):
            return False
        return not (skip_infra and (rel.parts[0] in INFRA_DIRS or (top_file and rel.name in INFRA_FILES)))

    if dockerfile is None or not dockerfile.is_file():
        for p in sorted(context.rglob("*")):
            if p.is_file() and allowed(p):
                _add_file(files, binary, p.relative_to(context).as_posix(), p)
        return "/app", files, binary, ["no Dockerfile: the whole environment dir is the workspace"]
    workdir, copies, notes = _dockerfile_layout(dockerfile)
    if workdir == "/":
        workdir = "/app"
    for sources, dest in copies:
        for source in sources:
            src = (context / source).resolve()
            if context.resolve() not in (src, *src.parents) or not src.exists():
                notes.append(f"skipped COPY source {source!r} (missing or outside the build context)")
                continue
            if not (dest == workdir or dest.startswith(workdir + "/") or dest.rstrip("/") == workdir):
                notes.append(f"skipped COPY to {dest} (outside WORKDIR {workdir})")
                continue
            under = PurePosixPath(dest).relative_to(workdir) if dest.rstrip("/") != workdir else PurePosixPath(".")
            if src.is_dir():
                for p in sorted(src.rglob("*")):
                    if p.is_file() and allowed(p):
                        _add_file(files, binary, (under / p.relative_to(src)).as_posix(), p)
            elif dest.endswith("/") or len(sources) > 1 or dest.rstrip("/") == workdir:
                _add_file(files, binary, (under / src.name).as_posix(), src)
            else:
                _add_file(files, binary, under.as_posix(), src)
    return workdir, files, binary, notes


def pytest_ids(rel: str, source: str) -> list[str]:
    """Test ids (``file::name`` / ``file::Class::name``) in a pytest file, found statically."""
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise TaskError(f"test file {rel} does not parse: {e}") from e
    ids = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
            ids.append(f"{rel}::{node.name}")
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and sub.name.startswith("test"):
                    ids.append(f"{rel}::{node.name}::{sub.name}")
    return ids


def load_task_dir(path: Path | str) -> Task:
    d = Path(path)
    cfg, instruction, flavour = _read_config(d)
    meta = cfg.get("task", {}) if isinstance(cfg.get("task"), dict) else {}
    name = str(meta.get("name") or d.name).replace("/", "__")
    env_cfg = cfg.get("environment", {}) if isinstance(cfg.get("environment"), dict) else {}
    if flavour == "harbor":
        context = d / "environment"
        workdir, files, binary, notes = _workspace_files(context, context / "Dockerfile", skip_infra=False) if (
            context.is_dir()) else ("/app", {}, {}, ["no environment/ dir: empty workspace"])
        solution = d / "solution" / "solve.sh"
        agent_timeout = (cfg.get("agent") or {}).get("timeout_sec")
        test_timeout = (cfg.get("verifier") or {}).get("timeout_sec")
    else:
        workdir, files, binary, notes = _workspace_files(d, d / "Dockerfile", skip_infra=True)
        solution = d / "solution.sh"
        agent_timeout, test_timeout = cfg.get("max_agent_timeout_sec"), cfg.get("max_test_timeout_sec")
    tests = d / "tests"
    hidden: dict[str, str] = {}
    ids: list[str] = []
    if tests.is_dir():
        for p in sorted(tests.rglob("*")):
            if p.is_file():
                rel = p.relative_to(tests).as_posix()
                try:
                    hidden[rel] = p.read_text(encoding="utf-8")
                except UnicodeDecodeError as e:
                    raise TaskError(f"{p}: hidden test files must be text") from e
                if re.fullmatch(r"(test_.*|.*_test)\.py", p.name):
                    ids += pytest_ids(rel, hidden[rel])
    if not ids:
        raise TaskError(
            f"{d}: no pytest tests under tests/ (legorl grades Harbor/terminal-bench tasks by running their "
            "pytest files with its own verifier; a task graded only by a script's reward file is not supported)"
        )
    if not files and not binary:
        files = {".keep": ""}  # an empty workspace is still a repo
    limits = {
        k: v for k, v in {
            "agent_timeout_s": agent_timeout, "grading_timeout_s": test_timeout,
            "cpus": env_cfg.get("cpus"), "memory_mb": _memory_mb(env_cfg.get("memory_mb", env_cfg.get("memory"))),
            "workspace_mb": _memory_mb(env_cfg.get("storage_mb", env_cfg.get("storage"))),
        }.items() if v is not None
    }  # fmt: skip
    return Task(
        instance_id=name,
        repo=f"{flavour}/{name}",
        problem_statement=instruction,
        files=files,
        binary_files=binary,
        hidden_files=hidden,
        tests_dir=TESTS_DIR,
        workdir=workdir,
        FAIL_TO_PASS=ids,
        solution_script=solution.read_text(encoding="utf-8") if solution.is_file() else "",
        image=env_cfg.get("docker_image"),
        limits=limits,
        family=flavour,
        environment_notes=notes,
        source_dir=str(d.resolve()),
    )
