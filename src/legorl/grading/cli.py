"""``legorl grade`` and ``legorl tasks validate``: grade one patch for one task the way a rollout is
graded, and check that a task set grades correctly (import-light: heavy imports happen inside commands).

``tasks validate`` lives here, not in ``legorl.tasks``, because it runs the grader: tasks know nothing
of grading, and grading reads tasks.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from legorl.grading.synth_cli import predictions_command, synth_command


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


SandboxOpt = Annotated[str, typer.Option("--sandbox", help="sandbox backend: bwrap or docker (sandbox.kind)")]
ImageOpt = Annotated[str | None, typer.Option("--image", help="docker: the image (default sandbox.image's)")]
DockerHostOpt = Annotated[str | None, typer.Option(
    "--docker-host", help="docker: the engine, e.g. unix:///run/podman/podman.sock (default DOCKER_HOST)")]


def _sandbox_config(kind: str, image: str | None, docker_host: str | None):  # -> SandboxConfig
    """The sandbox section these commands make their sandboxes with; an unusable backend fails here, clearly."""
    from pydantic import ValidationError

    from legorl.config import SandboxConfig
    from legorl.sandbox.factory import sandbox_unavailable

    try:
        cfg = SandboxConfig(kind=kind, **({"image": image} if image else {}), docker_host=docker_host)
    except ValidationError as e:
        _fail(f"--sandbox: {e.errors()[0]['msg']}")
    if cfg.kind == "docker" and (reason := sandbox_unavailable(cfg)):
        _fail(f"--sandbox docker: {reason}")
    return cfg


def grade_command(
    tasks: Annotated[str, typer.Option("--tasks", help="a .jsonl file, a Harbor task dir, builtin or builtin:N")],
    instance: Annotated[str, typer.Option("--instance", help="instance_id of the task to grade")],
    patch: Annotated[Path, typer.Option("--patch", help="the diff to grade ('-' reads stdin)")],
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds for the test command")] = 120.0,
    artifacts: Annotated[Path | None, typer.Option("--artifacts", help="dir for junit.xml and report.json")] = None,
    sandbox: SandboxOpt = "bwrap",
    image: ImageOpt = None,
    docker_host: DockerHostOpt = None,
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
    box_cfg = _sandbox_config(sandbox, image, docker_host)
    diff = sys.stdin.read() if str(patch) == "-" else patch.read_text(encoding="utf-8", errors="replace")
    hide = [Path(tasks).resolve().parent] if Path(tasks).exists() else []
    with tempfile.TemporaryDirectory(prefix="legorl-grade-") as work:
        report = asyncio.run(
            grade(task, diff, work_dir=Path(work), timeout=timeout, hide_paths=hide, artifacts_dir=artifacts,
                  sandbox=box_cfg)
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


SHORT = {
    "conftest_hook": "conftest", "stdout_forgery": "stdout", "syntax_error": "syntax",
    "exit_status_rewrite": "exit-code", "reward_file_write": "reward-file", "runner_hook": "runner-hook",
    "hidden_test_lookup": "lookup", "test_edit": "test-edit",
}  # fmt: skip
tasks_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect and validate task sets.")
tasks_app.command("synth")(synth_command)
tasks_app.command("predictions")(predictions_command)


@tasks_app.command("validate")
def validate_command(
    source: Annotated[str, typer.Argument(help="a .jsonl file, a Harbor/terminal-bench task dir, builtin or builtin:N")],
    instance: Annotated[list[str] | None, typer.Option("--instance", help="only these instance ids")] = None,
    canary: Annotated[list[str] | None, typer.Option("--canary", help="only these canaries")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds per test command")] = 120.0,
    concurrency: Annotated[int, typer.Option("--concurrency", help="gradings at once per task")] = 2,
    sandbox: SandboxOpt = "bwrap",
    image: ImageOpt = None,
    docker_host: DockerHostOpt = None,
    drop_failing: Annotated[
        bool,
        typer.Option("--drop-failing",
                     help="a .jsonl source only: rewrite it without the rows that failed a check (they move to "
                          "SOURCE.dropped.jsonl with the reason); rows not validated here stay"),
    ] = False,
) -> None:
    """Per task: the gold patch must resolve, the empty patch must not, and every adversarial canary
    (conftest hook, test edit, stdout forgery, syntax error, exit-status rewrite, reward-file write,
    runner hook, hidden-test lookup) must fail. Prints a table; exits 1 if any check fails
    (0 with --drop-failing once the failing rows are dropped)."""
    from rich.console import Console
    from rich.table import Table

    from legorl.grading.canaries import ALL_CANARIES
    from legorl.grading.validate import TaskValidation, validate_tasks
    from legorl.tasks.loaders import load_tasks
    from legorl.tasks.schema import TaskError

    console = Console(width=None if Console().is_terminal else 200)
    try:
        tasks = load_tasks(source)
    except (TaskError, OSError) as e:
        _fail(str(e))
    if instance:
        tasks = [t for t in tasks if t.instance_id in set(instance)]
        if not tasks:
            _fail(f"none of {instance} in {source}")
    if canary and (unknown := sorted(set(canary) - set(ALL_CANARIES))):
        _fail(f"unknown canaries {unknown}; known: {list(ALL_CANARIES)}")
    if drop_failing and not (source.endswith(".jsonl") and Path(source).is_file()):
        _fail(f"--drop-failing rewrites a .jsonl task file; {source!r} is not one")
    box_cfg = _sandbox_config(sandbox, image, docker_host)
    hide = [Path(source).resolve() if Path(source).is_dir() else Path(source).resolve().parent] if (
        Path(source).exists()) else []

    def progress(res: TaskValidation) -> None:
        mark = "[green]ok" if res.ok else "[red]FAIL"
        console.print(f"{mark}[/] {res.task_id}", highlight=False)

    with tempfile.TemporaryDirectory(prefix="legorl-validate-") as work:
        results = asyncio.run(validate_tasks(
            tasks, Path(work), timeout=timeout, hide_paths=hide, canaries=tuple(canary) if canary else None,
            concurrency=concurrency, on_result=progress, sandbox=box_cfg,
        ))  # fmt: skip
    names: list[str] = []
    for res in results:
        names += [c.name for c in res.checks if c.name not in names]
    table = Table(title=f"legorl tasks validate {source} ({box_cfg.kind} sandboxes)")
    table.add_column("task", no_wrap=True)
    for n in names:
        table.add_column(SHORT.get(n, n), no_wrap=True)
    failures = []
    for res in results:
        by = {c.name: c for c in res.checks}
        table.add_row(res.task_id, *("[green]ok" if by[n].ok else "[red]FAIL" if n in by else "-" for n in names))
        failures += [f"{res.task_id} {c.name}: {c.detail}" for c in res.checks if not c.ok]
    console.print(table)
    for f in failures:
        console.print(f"[red]FAIL[/] {f}", highlight=False)
    console.print(f"{len(results)} tasks, {sum(r.ok for r in results)} passed every check")
    if drop_failing and failures:
        failed = {res.task_id: "; ".join(f"{c.name}: {c.detail}" for c in res.checks if not c.ok)
                  for res in results if not res.ok}  # fmt: skip
        dropped = _drop_rows(Path(source), failed, box_cfg.kind)
        console.print(f"dropped {dropped} rows from {source} (kept in {source}.dropped.jsonl with the reason)")
        raise typer.Exit(0)
    raise typer.Exit(1 if failures else 0)


def _drop_rows(path: Path, failed: dict[str, str], backend: str) -> int:
    """Rewrite a task file without the failed rows, appending them (and why) to PATH.dropped.jsonl:
    nothing is lost, and the kept rows are byte-for-byte what they were."""
    kept, dropped = [], []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        row = json.loads(line) if line.strip() else None
        if row is not None and row.get("instance_id") in failed:
            dropped.append(json.dumps({**row, "dropped_because": f"{backend}: {failed[row['instance_id']]}"}) + "\n")
        else:
            kept.append(line)
    with open(f"{path}.dropped.jsonl", "a", encoding="utf-8") as f:
        f.writelines(dropped)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)
    return len(dropped)
