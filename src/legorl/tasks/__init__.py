"""Tasks: the schema, loaders (SWE-bench JSONL, Harbor / terminal-bench dirs, built-in), repo preparation.

Attributes load lazily so that importing one module of the package (as the command line does)
stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FAMILIES": "legorl.tasks.builtin",
    "builtin_splits": "legorl.tasks.builtin",
    "generate_tasks": "legorl.tasks.builtin",
    "load_jsonl": "legorl.tasks.loaders",
    "load_tasks": "legorl.tasks.loaders",
    "load_task_dirs": "legorl.tasks.harbor",
    "assert_clean_history": "legorl.tasks.repo",
    "assert_no_hidden_tests": "legorl.tasks.repo",
    "prepare_repo": "legorl.tasks.repo",
    "Task": "legorl.tasks.schema",
    "TaskError": "legorl.tasks.schema",
}
__all__ = [
    "FAMILIES",
    "Task",
    "TaskError",
    "assert_clean_history",
    "assert_no_hidden_tests",
    "builtin_splits",
    "generate_tasks",
    "load_jsonl",
    "load_task_dirs",
    "load_tasks",
    "prepare_repo",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
