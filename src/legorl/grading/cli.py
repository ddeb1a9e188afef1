"""``legorl grade``: grade one patch for one task, the way a rollout is graded (import-light)."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def grade_command(
    tasks: Annotated[str, typer.Option("--tasks", help="a .jsonl file, a Harbor task dir, builtin or builtin:N")],
    instance: Annotated[str, typer.Option("--instance", help="instance_id of the task to grade")],
    patch: Annotated[Path, typer.Option("--patch", help="the diff to grade ('-' reads stdin)")],
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds for the test command")] = 120.0,
    artifacts: Annotated[Path | None, typer.Option("--artifacts", help="dir for junit.xml and report.json")] = None,
) -> None:
    """Grade PATCH for one task in a fresh sandbox; exit 0 when resolved, 1 when not, 2 on errors."""
    from legorl.grading.grader import grade
    from legorl.records import Outcome
    from legorl.tasks.loaders import load_tasks
    from legorl.tasks.schema import TaskError

    try:
        all_tasks = load_tasks(tasks)
    except (TaskError, OSError) as e:
        _fail(str(e))
    task = next((t for t in all_tasks if t.instance_id == instance), None)
    if task is None:
        ids = [t.instance_id for t in all_tasks]
        _fail(f"no task {instance!r} in {tasks} ({len(ids)} tasks, e.g. {ids[:3]})")
    diff = sys.stdin.read() if str(patch) == "-" else patch.read_text(encoding="utf-8", errors="replace")
    hide = [Path(tasks).resolve().parent] if Path(tasks).exists() else []
    with tempfile.TemporaryDirectory(prefix="legorl-grade-") as work:
        report = asyncio.run(
            grade(task, diff, work_dir=Path(work), timeout=timeout, hide_paths=hide, artifacts_dir=artifacts)
        )
    out = {
        "instance_id": task.instance_id,
        "resolved": report.resolved,
        "outcome": report.outcome.value,
        "reason": report.reason,
        "tests": report.tests,
        "applied_paths": report.applied_paths,
        "dropped_paths": report.dropped_paths,
        "collected": report.collected,
        "exit_code": report.exit_code,
    }
    if as_json:
        typer.echo(json.dumps(out, indent=2))
    else:
        typer.echo(f"{task.instance_id}: {report.outcome.value}" + (f" ({report.reason})" if report.reason else ""))
        for tid, status in report.tests.items():
            typer.echo(f"  {status:8s} {tid}")
        if report.dropped_paths:
            typer.echo(f"  dropped from the diff: {', '.join(report.dropped_paths)}")
    if report.outcome == Outcome.GRADER_ERROR:
        raise typer.Exit(2)
    raise typer.Exit(0 if report.resolved else 1)
