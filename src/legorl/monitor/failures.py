"""Why a rollout failed: one kind per rollout, from its outcome, its calls, its diff and the gold patch.

The kinds, in the order they are decided (the first that holds):

- ``resolved``;
- ``error``: the episode did not end as the agent's own work (crash, sandbox, engine or grader error,
  an invalid capture, no model call): nothing to say about the policy;
- ``format``: no turn held a valid action (every turn text only or malformed): the model did not
  speak the harness's format;
- ``no_edit``: it acted, but the workspace is unchanged;
- ``fixed_unsubmitted``: the hidden tests pass on its diff, but it never submitted (``rollout.require_submit``);
- ``wrong_file``: its diff touches none of the files the gold patch changes;
- ``wrong_fix``: it changed a file the gold patch changes (or the gold files are unknown), and the tests fail.

`legorl eval` and the pipeline's evaluations report the share of each as ``eval/SPLIT/failures/KIND``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from legorl.monitor.behaviour import analyse_rollout
from legorl.records import Outcome, Rollout
from legorl.tasks.schema import Task

KINDS = ("resolved", "error", "format", "no_edit", "fixed_unsubmitted", "wrong_file", "wrong_fix")
# Outcomes of an episode that ended as the agent's own work; any other is an `error`.
_AGENT_ENDED = (Outcome.RESOLVED, Outcome.UNRESOLVED, Outcome.MAX_TURNS, Outcome.CONTEXT_OVERFLOW,
                Outcome.AGENT_TIMEOUT)
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


def diff_paths(diff: str) -> set[str]:
    """The files a unified git diff changes (both sides of a rename)."""
    return {p for m in _DIFF_FILE.finditer(diff) for p in m.groups() if p != "/dev/null"}


def failure_kind(rollout: Rollout, task: Task | None) -> str:
    if rollout.outcome == Outcome.RESOLVED:
        return "resolved"
    if rollout.outcome not in _AGENT_ENDED:
        return "error"
    b = analyse_rollout(rollout)
    if b.tool_calls == 0 or b.format_errors >= b.turns:
        return "format"
    touched = diff_paths(rollout.diff)
    if not touched:
        return "no_edit"
    if rollout.report is not None and rollout.report.resolved:
        return "fixed_unsubmitted"
    gold = diff_paths(task.patch) if task is not None else set()
    if gold and not touched & gold:
        return "wrong_file"
    return "wrong_fix"


def failure_shares(kinds: Iterable[str], prefix: str) -> dict[str, float]:
    """``PREFIXfailures/KIND``: the share of each kind among ``kinds`` (one `failure_kind` a rollout; every
    kind present, 0.0 when none)."""
    counts = Counter(kinds)
    n = sum(counts.values())
    return {f"{prefix}failures/{k}": counts[k] / n if n else 0.0 for k in KINDS}
