"""Tasks: the schema, loaders, the built-in suite and repo preparation."""

from legorl.tasks.builtin import FAMILIES, builtin_splits, generate_tasks
from legorl.tasks.loaders import load_jsonl
from legorl.tasks.repo import assert_clean_history, prepare_repo
from legorl.tasks.schema import Task, TaskError

__all__ = [
    "FAMILIES",
    "Task",
    "TaskError",
    "assert_clean_history",
    "builtin_splits",
    "generate_tasks",
    "load_jsonl",
    "prepare_repo",
]
