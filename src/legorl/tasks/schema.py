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
    files: dict[str, str] = {}  # repo contents for built-in tasks
    family: str = ""
    split: str = "train"
    setup: str = ""
    limits: dict[str, Any] = {}

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

    @property
    def test_ids(self) -> list[str]:
        return [*self.FAIL_TO_PASS, *self.PASS_TO_PASS]
