"""The Task record: a superset of the SWE-bench instance schema."""

from __future__ import annotations

import json
from typing import Any

import pydantic


class TaskError(ValueError):
    """A task is malformed or its repo could not be prepared safely."""


class Task(pydantic.BaseModel):
    # SWE-bench rows carry more fields (version, created_at, hints_text, ...): keep them.
    model_config = pydantic.ConfigDict(extra="allow")

    instance_id: str
    repo: str  # a label ("owner/name" for SWE-bench, "builtin/<family>" for generated tasks)
    repo_path: str | None = None  # local source: a git dir or a .tar.gz; None when `files` holds the repo
    base_commit: str = ""
    problem_statement: str
    test_patch: str = ""  # unified diff adding/changing the hidden tests
    hidden_files: dict[str, str] = {}  # path -> content: hidden tests given as whole files
    patch: str = ""  # the gold patch
    test_command: str = "python -m pytest -q"
    FAIL_TO_PASS: list[str] = []
    PASS_TO_PASS: list[str] = []
    files: dict[str, str] = {}  # repo contents for built-in tasks (text)
    binary_files: dict[str, str] = {}  # path -> base64 content (Harbor environments ship data files)
    family: str = ""
    split: str = "train"
    setup: str = ""  # run on pristine sources in the grading sandbox before the agent's diff
    limits: dict[str, Any] = {}  # e.g. agent_timeout_s, grading_timeout_s, memory_mb, cpus, workspace_mb
    # Grading and sandbox layout (all optional; SWE-bench rows need none of them):
    protected_paths: list[str] = []  # paths/globs the grader never takes from the agent's diff
    tests_dir: str | None = None  # absolute dir (e.g. "/tests") where hidden_files are mounted read-only
    workdir: str = "/workspace"  # where the repo appears inside the sandbox (terminal-bench: "/app")
    solution_script: str = ""  # a shell script that solves the task (Harbor/terminal-bench oracles)
    image: str | None = None  # container image for the docker backend
    # A host dir of the task's dependencies (legorl.tasks.envs), read-only at /opt/legorl-env and on PYTHONPATH
    # in its sandboxes; relative to the tasks file in a JSONL row.
    environment: str | None = None

    @pydantic.field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _json_list(cls, v: Any) -> Any:
        # SWE-bench ships these as JSON-encoded strings.
        if isinstance(v, str):
            try:
                v = json.loads(v) if v.strip() else []
            except json.JSONDecodeError as e:
                raise ValueError(f"expected a list of test ids or a JSON-encoded list, got {v[:80]!r}") from e
        return v

    @pydantic.field_validator("workdir", "tests_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("/") or ".." in v.split("/") or v.rstrip("/") in ("", "/run")):
            raise ValueError(f"must be an absolute path (not / or /run), got {v!r}")
        return v.rstrip("/") if v else v

    @property
    def test_ids(self) -> list[str]:
        return [*self.FAIL_TO_PASS, *self.PASS_TO_PASS]
