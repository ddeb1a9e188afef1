"""``legorl tasks synth`` and ``legorl tasks predictions`` (import-light: heavy imports inside).

``synth`` lives with the grader, not in ``legorl.tasks``, because it validates what it mines the
way ``legorl tasks validate`` does: tasks know nothing of grading, and grading reads tasks.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from legorl.tasks.synth import PackageResult


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _validate(result: PackageResult, out: Path, timeout: float, concurrency: int) -> dict[str, str]:
    """``legorl tasks validate``'s checks on one package's kept rows; returns {instance_id: failure}."""
    from legorl.grading.validate import validate_tasks
    from legorl.tasks.schema import Task

    if not result.rows:
        return {}
    # repo_path and environment are relative to the output dir, as load_jsonl resolves them from out/tasks.jsonl
    tasks = [
        Task.model_validate({**r, **{k: str((out / r[k]).resolve()) for k in ("repo_path", "environment") if r.get(k)}})
        for r in result.rows
    ]
    with tempfile.TemporaryDirectory(prefix="legorl-synth-validate-") as work:
        results = asyncio.run(
            validate_tasks(
                tasks, Path(work), timeout=timeout, hide_paths=[out.resolve()], concurrency=concurrency
            )
        )
    return {
        r.task_id: "; ".join(f"{c.name}: {c.detail}" for c in r.checks if not c.ok)[:300]
        for r in results
        if not r.ok
    }


def _write_report(out: Path, results: list, validate: bool, invalid: dict, errors: dict,
                  earlier: dict[str, Any] | None = None) -> dict[str, Any]:
    """OUT/synth-report.json; with ``earlier`` (the report already there), the packages this run left alone
    keep their entries, and ``this_run`` names the ones it mined."""
    from legorl.tasks.synth import summary

    report = {**summary(results), "validated": validate, "invalid": invalid, "errors": errors}
    report["this_run"] = [p["package"] for p in report["packages"]]
    if earlier:
        mined = set(report["this_run"])
        kept = [p for p in earlier.get("packages", []) if p["package"] not in mined]
        report["packages"] = sorted([*kept, *report["packages"]], key=lambda p: p["package"])
        report["kept"] = sum(p["kept"] for p in report["packages"])
        report["validated"] = validate and earlier.get("validated", False)
        report["invalid"] = {**{k: v for k, v in earlier.get("invalid", {}).items() if k not in mined}, **invalid}
        report["errors"] = {**earlier.get("errors", {}), **errors}
    (out / "synth-report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _existing_packages(out: Path) -> set[str]:
    """NAME-VERSION slugs that already have rows in OUT/tasks.jsonl."""
    path = out / "tasks.jsonl"
    if not path.is_file():
        return set()
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {Path(str(r.get("repo_path", ""))).name for r in rows}


def synth_command(
    package: Annotated[
        list[str] | None,
        typer.Option(
            "--package", help="NAME==VERSION from PyPI (sdist), a local sdist or a source dir; repeatable"
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option("--out", help="output dir: tasks.jsonl, repos/, synth-report.json")
    ] = Path("tasks/real"),
    n: Annotated[int, typer.Option("--n", help="tasks per package (at most)")] = 20,
    seed: Annotated[int, typer.Option("--seed", help="order in which candidate bugs are tried")] = 0,
    bundled: Annotated[bool, typer.Option("--bundled", help="every package of the bundled list")] = False,
    max_attempts: Annotated[
        int, typer.Option("--max-attempts", help="mutants run per package (0: 8 x N)")
    ] = 0,
    max_hidden_files: Annotated[
        int, typer.Option("--max-hidden-files", help="test files a bug may break")
    ] = 2,
    operator: Annotated[
        list[str] | None, typer.Option("--operator", help="only these mutation operators; repeatable")
    ] = None,
    heldout_fraction: Annotated[
        float, typer.Option("--heldout-fraction", help="share of tasks marked split=heldout")
    ] = 0.0,
    timeout: Annotated[
        float, typer.Option("--timeout", help="seconds per test run of a mutant (at most)")
    ] = 120.0,
    sandbox: Annotated[
        str, typer.Option("--sandbox", help="auto | bwrap | none (test runs of the package)")
    ] = "auto",
    cache: Annotated[Path | None, typer.Option("--cache", help="sdist download dir")] = None,
    validate: Annotated[
        bool,
        typer.Option("--validate/--no-validate", help="run `legorl tasks validate` checks; drop failures"),
    ] = True,
    validate_timeout: Annotated[
        float, typer.Option("--validate-timeout", help="seconds per grading")
    ] = 120.0,
    concurrency: Annotated[int, typer.Option("--concurrency", help="gradings at once per task")] = 2,
    environments: Annotated[
        bool,
        typer.Option("--environments/--no-environments",
                     help="build each package's task environment (its test dependencies from PyPI) once"),
    ] = True,
    env_timeout: Annotated[
        float, typer.Option("--env-timeout", help="seconds for one environment build")
    ] = 600.0,
    only_new: Annotated[
        bool,
        typer.Option("--only-new", help="skip NAME==VERSION packages that already have tasks in OUT (kept as they are)"),
    ] = False,
    add_environments: Annotated[
        bool,
        typer.Option("--add-environments",
                     help="mine nothing: give OUT's rows without one their package's environment (its test deps and "
                          "pytest) and the `python -S` test command; validate them afterwards with --drop-failing"),
    ] = False,
) -> None:
    """Mine SWE-bench-style tasks from real Python packages by planting bugs.

    Runs each package's own tests, plants bugs by AST mutation, keeps those that some tests catch
    (FAIL_TO_PASS) while the rest of their files pass (PASS_TO_PASS), and (default) only tasks that
    pass every `legorl tasks validate` check."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from legorl.tasks.mutate import OPERATORS
    from legorl.tasks.packages import BUNDLED_PACKAGES
    from legorl.tasks.schema import TaskError
    from legorl.tasks.synth import SynthConfig, normalize, synthesize_package, write_rows
    from legorl.tasks.synth_runner import Runner

    if add_environments:
        from legorl.tasks.synth import add_environments as add_envs

        if not (out / "tasks.jsonl").is_file():
            _fail(f"--add-environments: {out / 'tasks.jsonl'} does not exist")
        try:
            done = add_envs(out, SynthConfig(env_timeout=env_timeout),
                            progress=lambda kind, info: typer.echo(f"building the environment of {info['name']}", err=True))
        except TaskError as e:
            _fail(str(e), code=1)
        for slug, dists in done.items():
            typer.echo(f"{slug}: {', '.join(dists)}")
        typer.echo(f"{len(done)} environments built under {out / 'envs'}; run `legorl tasks validate {out / 'tasks.jsonl'} --drop-failing` "
                   "(it drops a row whose bug no longer shows in its new environment)")
        raise typer.Exit(0)
    specs = [*(package or []), *(BUNDLED_PACKAGES if bundled else ())]
    if not specs:
        _fail("name at least one --package NAME==VERSION (or a local sdist / dir), or --bundled")
    # Other packages' rows stay in OUT/tasks.jsonl (write_rows), so their report entries stay too.
    earlier: dict[str, Any] | None = None
    if (out / "synth-report.json").is_file():
        earlier = json.loads((out / "synth-report.json").read_text())
    if only_new:
        have = _existing_packages(out)
        pinned = {spec: f"{normalize(spec.split('==')[0].strip())}-{spec.split('==')[1].strip()}"
                  for spec in specs if "==" in spec and not Path(spec).exists()}  # fmt: skip
        skipped = [spec for spec in specs if pinned.get(spec) in have]
        specs = [spec for spec in specs if spec not in skipped]
        typer.echo(f"--only-new: {len(skipped)} packages already have tasks in {out}; mining {len(specs)}", err=True)
        if not specs:
            raise typer.Exit(0)
    if operator and (unknown := sorted(set(operator) - set(OPERATORS))):
        _fail(f"unknown operators {unknown}; known: {list(OPERATORS)}")
    if n <= 0:
        _fail("--n must be positive")
    try:
        runner = Runner(sandbox=sandbox)
    except (ValueError, RuntimeError) as e:
        _fail(str(e))
    cfg = SynthConfig(n=n, seed=seed, max_attempts=max_attempts, max_hidden_files=max_hidden_files, timeout=timeout,
                      heldout_fraction=heldout_fraction, operators=tuple(operator) if operator else None,
                      environments=environments, env_timeout=env_timeout)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    cache = cache or Path(tempfile.gettempdir()) / "legorl-sdists"
    console = Console(stderr=True)
    console.print(
        f"test runs: {'bubblewrap sandbox' if runner.sandbox == 'bwrap' else 'no sandbox (time limit only)'}"
    )
    results = []
    invalid: dict[str, dict[str, str]] = {}
    errors: dict[str, str] = {}
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        for spec in specs:
            job = bar.add_task(f"{spec}: fetching", total=None)
            state: dict[str, Any] = {"name": spec, "kept": 0}

            def progress(
                kind: str, info: dict[str, Any], job: int = job, state: dict[str, Any] = state
            ) -> None:
                if kind == "package":
                    state["name"] = info["name"]
                elif kind == "stage" and info["stage"] == "environment":
                    bar.update(job, description=f"{state['name']}: building its test environment")
                elif kind == "stage" and info["stage"] == "baseline":
                    bar.update(job, description=f"{state['name']}: its own test suite (twice)")
                elif kind == "stage":
                    bar.update(job, total=info["total"], description=f"{state['name']}: kept 0/{n}")
                elif kind == "tried":
                    state["kept"] += bool(info["kept"])
                    bar.update(job, advance=1, description=f"{state['name']}: kept {state['kept']}/{n}")

            try:
                res = synthesize_package(spec, out, cfg, runner=runner, cache=cache, progress=progress)
            except TaskError as e:
                bar.update(job, description=f"{spec}: [red]failed", total=1, completed=1)
                errors[spec] = str(e)
                bar.console.print(f"{spec}: error: {e}", highlight=False)
                continue
            if res.error:
                bar.update(job, description=f"{res.source.slug}: [red]{res.error}"[:160])
            elif validate and res.rows:
                bar.update(job, description=f"{res.source.slug}: validating {len(res.rows)} tasks")
                t0 = time.monotonic()
                bad = _validate(res, out, validate_timeout, concurrency)
                res.validate_s = time.monotonic() - t0
                if bad:
                    invalid[res.source.slug] = bad
                    res.rows = [r for r in res.rows if r["instance_id"] not in bad]
                    res.rejected["validation"] += len(bad)
                bar.update(job, description=f"{res.source.slug}: kept {len(res.rows)}/{n}, validated")
            results.append(res)
            write_rows(out, results)  # after every package: an interrupted run keeps what it made
            _write_report(out, results, validate, invalid, errors, earlier)
            rejected = ", ".join(f"{k} {v}" for k, v in sorted(res.rejected.items())) or "none"
            bar.console.print(
                f"{res.source.slug}: kept {len(res.rows)} of {res.tried} tried ({rejected}); "
                f"{res.seconds:.0f} s mining" + (f", {res.validate_s:.0f} s validating" if validate else ""),
                highlight=False,
            )
    report = _write_report(out, results, validate, invalid, errors, earlier)
    table = Table(title=f"legorl tasks synth -> {out / 'tasks.jsonl'}")
    for col in ("package", "kept", "tried", "usable tests", "rejected", "minutes"):
        table.add_column(col)
    for p in report["packages"]:
        rejected = ", ".join(f"{k} {v}" for k, v in p["rejected"].items()) or "-"
        table.add_row(p["package"], str(p["kept"]), str(p["tried"]), str(p["usable_tests"]),
                      rejected if not p["error"] else f"[red]{p['error'][:80]}", f"{p['seconds'] / 60:.1f}")  # fmt: skip
    Console().print(table)
    Console().print(
        f"{report['kept']} tasks kept from {sum(1 for p in report['packages'] if p['kept'])} packages"
        + (" (every one passed the `legorl tasks validate` checks)" if validate else " (not validated)")
    )
    for spec, err in errors.items():
        console.print(f"[red]error[/] {spec}: {err}", highlight=False)
    for bad in invalid.values():
        for iid, why in bad.items():
            console.print(f"[yellow]dropped[/] {iid}: {why}", highlight=False)
    raise typer.Exit(0 if report["kept"] else 1)


def predictions_command(
    run_dir: Annotated[
        Path, typer.Argument(help="a run directory written by `legorl train` or `legorl eval`")
    ],
    out: Annotated[Path, typer.Argument(help="predictions file to write (JSONL)")],
    model: Annotated[
        str | None, typer.Option("--model", help="model_name_or_path (default legorl/RUN)")
    ] = None,
    split: Annotated[str | None, typer.Option("--split", help="heldout | train (default: both)")] = None,
    step: Annotated[int | None, typer.Option("--step", help="evaluation step (default: the latest)")] = None,
) -> None:
    """Write SWE-bench predictions from a run's latest evaluation.

    One JSON object per line (instance_id, model_name_or_path, model_patch), one rollout per task
    (the first sample), as the official harness reads them."""
    from legorl.store import Store
    from legorl.tasks.swebench import predictions_from_rollouts, write_predictions

    db = run_dir / "store.sqlite"
    if not db.is_file():
        _fail(f"{run_dir} has no store.sqlite: is it a run directory written by `legorl train`?")
    rollouts = Store(db).rollouts()
    rows = predictions_from_rollouts(
        rollouts, model or f"legorl/{run_dir.resolve().name}", split=split, step=step
    )
    if not rows:
        _fail(f"{run_dir} has no evaluation rollouts" + (f" for split {split!r}" if split else ""), code=1)
    n = write_predictions(out, rows)
    typer.echo(f"wrote {n} predictions to {out}")
