"""Grading: fresh-sandbox grader, diff path policy, streamed verdicts, JUnit, workspace diffs, validation.

Attributes load lazily so that ``legorl.grading.cli`` stays cheap to import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "filter_diff": "legorl.grading.policy",
    "filter_diff_detailed": "legorl.grading.policy",
    "is_test_path": "legorl.grading.policy",
    "grade": "legorl.grading.grader",
    "empty_patch_report": "legorl.grading.grader",
    "junit_key": "legorl.grading.junit",
    "parse_junit": "legorl.grading.junit",
    "workspace_diff": "legorl.grading.diff",
    "validate_task": "legorl.grading.validate",
    "validate_tasks": "legorl.grading.validate",
}
__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - the names _EXPORTS loads lazily


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(name)
