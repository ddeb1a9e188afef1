"""``legorl tasks ...``: validate task sets (import-light: heavy imports happen inside commands)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Annotated

import typer

SHORT = {
    "conftest_hook": "conftest", "stdout_forgery": "stdout", "syntax_error": "syntax",
    "exit_status_rewrite": "exit-code", "reward_file_write": "reward-file", "runner_hook": "runner-hook",
    "hidden_test_lookup": "lookup", "test_edit": "test-edit",
}  # fmt: skip
tasks_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Inspect and validate task sets.")


@tasks_app.command("validate")
def validate_command(
    source: Annotated[str, typer.Argument(help="a .jsonl file, a Harbor/terminal-bench task dir, builtin or builtin:N")],
    instance: Annotated[list[str] | None, typer.Option("--instance", help="only these instance ids")] = None,
    canary: Annotated[list[str] | None, typer.Option("--canary", help="only these canaries")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds per test command")] = 120.0,
    concurrency: Annotated[int, typer.Option("--concurrency", help="gradings at once per task")] = 2,
) -> None:
    """Per task: the gold patch must resolve, the empty patch must not, and every adversarial canary
    (conftest hook, test edit, stdout forgery, syntax error, exit-status rewrite, reward-file write,
    runner hook, hidden-test lookup) must fail. Prints a table; exits 1 if any check fails."""
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
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if instance:
        tasks = [t for t in tasks if t.instance_id in set(instance)]
        if not tasks:
            typer.echo(f"error: none of {instance} in {source}", err=True)
            raise typer.Exit(2)
    if canary and (unknown := sorted(set(canary) - set(ALL_CANARIES))):
        typer.echo(f"error: unknown canaries {unknown}; known: {list(ALL_CANARIES)}", err=True)
        raise typer.Exit(2)
    hide = [Path(source).resolve() if Path(source).is_dir() else Path(source).resolve().parent] if (
        Path(source).exists()) else []

    def progress(res: TaskValidation) -> None:
        mark = "[green]ok" if res.ok else "[red]FAIL"
        console.print(f"{mark}[/] {res.task_id}", highlight=False)

    with tempfile.TemporaryDirectory(prefix="legorl-validate-") as work:
        results = asyncio.run(validate_tasks(
            tasks, Path(work), timeout=timeout, hide_paths=hide, canaries=tuple(canary) if canary else None,
            concurrency=concurrency, on_result=progress,
        ))  # fmt: skip
    names: list[str] = []
    for res in results:
        names += [c.name for c in res.checks if c.name not in names]
    table = Table(title=f"legorl tasks validate {source}")
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
    raise typer.Exit(1 if failures else 0)
