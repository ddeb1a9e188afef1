"""legorl's command line: train, report, doctor (and more as the parts grow)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from legorl.config import ConfigError, load_config, unpulled_model
from legorl.models.chat_format import ChatFormatError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="RL for LLM coding agents inside the harnesses people already use.")
console = Console(stderr=True)


def _fail(message: str) -> None:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def train(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config, e.g. configs/smoke.yaml")]
    = None,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="where the store, logs and checkpoints go")]
    = None,
    resume: Annotated[Path | None, typer.Option(
        "--resume", help="continue a killed run, or extend a finished one (run.steps=N)")] = None,
) -> None:
    """Run the job (demos, SFT, RL steps, evals as configured). Extra arguments are dotted overrides."""
    if resume is not None:
        saved = resume / "config.json"
        if not saved.is_file():
            _fail(f"{resume} has no config.json: is it a run directory written by `legorl train`?")
        config, run_dir = saved, resume
    if config is None or run_dir is None:
        _fail("give --config FILE and --run-dir DIR (or --resume RUN_DIR)")
    try:
        cfg = load_config(config, list(ctx.args))
    except ConfigError as e:
        _fail(str(e))
    if (why := unpulled_model(cfg)) is not None:
        _fail(why)
    from legorl.pipeline import run_job

    console.print(f"run directory: [bold]{run_dir.resolve()}[/]")
    try:
        summary = asyncio.run(run_job(cfg, run_dir, resume=resume is not None))
    except (ConfigError, ChatFormatError) as e:  # what only the loaded tasks / the model's template can show
        _fail(str(e))
    console.print(f"done in {summary['wall_time_s']:.0f}s. summary: {run_dir / 'summary.json'}; "
                  f"report: legorl report {run_dir} --json")


@app.command("eval", context_settings={"allow_extra_args": True})
def evaluate(
    ctx: typer.Context,
    config: Annotated[Path, typer.Option("--config", "-c", help="YAML config (harness, tasks, sampling)")],
    model: Annotated[Path | None, typer.Option("--model", help="a local model directory (e.g. RUN/checkpoints/latest)")]
    = None,
    split: Annotated[str, typer.Option("--split", help="heldout | train")] = "heldout",
    samples: Annotated[int, typer.Option("--samples", "-k", help="samples per task: reports pass@1 and pass@k")] = 1,
    run_dir: Annotated[Path | None, typer.Option("--run-dir", help="where to record the eval rollouts")] = None,
) -> None:
    """Evaluate a model on a task split through the real harness: pass@1, pass@k, outcome counts."""
    overrides = list(ctx.args) + [f"eval.split={split}", f"eval.samples={samples}", "monitor.dashboard=false"]
    if model is not None:
        overrides += [f"model.path={model.resolve()}", "model.name=null"]  # --model wins over the config's
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        _fail(str(e))
    if (why := unpulled_model(cfg)) is not None:
        _fail(why)
    from legorl.pipeline import Driver

    async def main() -> dict:
        async with Driver(cfg, run_dir or Path(tempfile.mkdtemp(prefix="legorl-eval-"))) as driver:
            return await driver.evaluate(step=0)

    try:
        metrics = asyncio.run(main())
    except ChatFormatError as e:  # the model's chat template: what is missing and the fix
        _fail(str(e))
    print(json.dumps(metrics, indent=2, sort_keys=True))


@app.command()
def export(
    run_dir: Annotated[Path, typer.Argument(help="a run directory")],
    fmt: Annotated[str, typer.Option("--format", help="jsonl | parquet")] = "jsonl",
    out: Annotated[Path | None, typer.Option("--out", help="output file (default RUN_DIR/calls.FORMAT)")] = None,
) -> None:
    """Write every captured call (token ids, logprobs, request, outcome of its rollout) for other tools."""
    from legorl.store import Store

    if fmt not in ("jsonl", "parquet"):
        _fail(f"--format must be jsonl or parquet, not {fmt!r}")
    db = run_dir / "store.sqlite"
    if not db.is_file():
        _fail(f"{run_dir} has no store.sqlite: is it a run directory written by `legorl train`?")
    out = out or run_dir / f"calls.{fmt}"
    store = Store(db)
    if fmt == "jsonl":
        n = store.export_calls_jsonl(out)
    else:
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            _fail("parquet export needs pyarrow: pip install pyarrow")
        n = store.export_calls_parquet(out)
    console.print(f"wrote {n} calls to {out}")


@app.command()
def report(
    run_dir: Annotated[Path, typer.Argument(help="a run directory written by `legorl train`")],
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Summarise a run: steps, outcomes, calls, token fidelity, the last step's metrics."""
    from legorl.store import Store

    db = run_dir / "store.sqlite"
    if not db.is_file():
        _fail(f"{run_dir} has no store.sqlite: is it a run directory written by `legorl train`?")
    decode = None
    if (run_dir / "tokenizer").is_dir():
        from legorl.models import load_tokenizer

        tok = load_tokenizer(run_dir / "tokenizer")
        decode = lambda ids: tok.decode(ids, skip_special_tokens=False)
    summary = Store(db).report(decode=decode)
    if as_json:
        print(json.dumps(summary, indent=2, sort_keys=True))
        return
    t = Table(title=f"legorl run {run_dir}")
    t.add_column("what")
    t.add_column("value")
    for k, v in summary.items():
        t.add_row(k, json.dumps(v, sort_keys=True) if isinstance(v, dict) else str(v))
    Console().print(t)


def _check(cmd: list[str]) -> tuple[bool, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return p.returncode == 0, (p.stderr or p.stdout).strip()[-200:]


@app.command()
def doctor(
    model: Annotated[Path | None, typer.Option(
        "--model", help="check a model directory instead: will legorl train this checkpoint?")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="with --model: the checks as JSON")] = False,
    tool_format: Annotated[str, typer.Option("--tool-format", help="with --model: model.tool_format to check")]
    = "auto",
    max_context: Annotated[int | None, typer.Option(
        "--max-context", help="with --model: the context the runs need, in tokens")] = None,
) -> None:
    """Check this machine can run legorl (or, with --model DIR, that legorl can train that checkpoint), and say
    how to fix what is missing."""
    if model is not None:
        _doctor_model(model, as_json, tool_format, max_context)
        return
    rows: list[tuple[str, bool, str, bool]] = []  # name, ok, detail/fix, required
    bwrap = shutil.which("bwrap")
    rows.append(("bubblewrap", bwrap is not None, bwrap or "apt-get install -y bubblewrap", True))
    if bwrap:
        ok, out = _check([bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
                          "--dev", "/dev", "true"])
        rows.append(("user/pid/net namespaces", ok, "ok" if ok else
                     f"{out} (enable unprivileged user namespaces: sysctl kernel.unprivileged_userns_clone=1)",
                     True))
    ok, out = _check([sys.executable, "-c", "import minisweagent.agents.default"])
    rows.append(("mini-swe-agent", ok, "importable" if ok else f"pip install mini-swe-agent ({out})", True))
    try:
        import torch

        rows.append(("torch", True, torch.__version__, True))
        gpu = torch.cuda.is_available()
        rows.append(("GPU", gpu, torch.cuda.get_device_name(0) if gpu else "none: the CPU path is used", False))
    except ImportError:
        rows.append(("torch", False, "pip install torch==2.13.0", True))
    for mod in ("transformers", "tokenizers", "fastapi", "uvicorn"):
        found = importlib.util.find_spec(mod) is not None
        rows.append((mod, found, "importable" if found else f"pip install {mod}", True))
    git = shutil.which("git")
    rows.append(("git", git is not None, git or "apt-get install -y git", True))
    from legorl.sandbox.cpushare import fallback_meaning, support

    share = support()  # one busy sandbox must not take the cores from the engine and the other rollouts
    rows.append(("sandbox CPU share", share.kind != "nice",
                 share.detail if share.kind != "nice" else f"no cgroup: {share.detail}. {fallback_meaning()}", False))
    ray = importlib.util.find_spec("ray") is not None
    rows.append(("ray", ray, "importable (ray.address=...)" if ray else "optional: pip install 'legorl[ray]'",
                 False))
    t = Table(title="legorl doctor")
    for col in ("check", "status", "detail / fix"):
        t.add_column(col)
    for name, ok, detail, required in rows:
        status = "[green]ok" if ok else ("[red]missing" if required else "[yellow]absent")
        t.add_row(name, status, detail)
    Console().print(t)
    if not all(ok for _, ok, _, required in rows if required):
        raise typer.Exit(1)


def _doctor_model(model: Path, as_json: bool, tool_format: str, max_context: int | None) -> None:
    """`legorl doctor --model DIR`: the preflight's checks as a table (or JSON); status 1 when one fails."""
    from dataclasses import asdict

    from legorl.models.toolformats import parser_names
    from legorl.preflight import FAIL, OK, failed, preflight

    if not model.is_dir():
        _fail(f"{model} is not a directory (give a model directory as save_pretrained writes it)")
    if tool_format not in parser_names():
        _fail(f"unknown tool-call format '{tool_format}'; choose one of {', '.join(parser_names())}")
    checks = preflight(model, tool_format=tool_format, max_context=max_context)
    if as_json:
        print(json.dumps({"model": str(model), "ok": not failed(checks), "checks": [asdict(c) for c in checks]},
                         indent=2))
    else:
        t = Table(title=f"legorl doctor --model {model}")
        for col in ("check", "status", "found", "what to set"):
            t.add_column(col, overflow="fold")
        colour = {OK: "green", FAIL: "red"}
        for c in checks:
            t.add_row(c.name, f"[{colour.get(c.status, 'yellow')}]{c.status}", c.found, c.fix)
        Console().print(t)
    if failed(checks):
        raise typer.Exit(1)


# ---- commands that live with their part (each module keeps its imports light) -------------------
# One line per command: app.command("name")(function) or app.add_typer(sub_app, name="name").
from legorl.grading.cli import grade_command, tasks_app

app.command("grade")(grade_command)
app.add_typer(tasks_app, name="tasks")
from legorl.monitor.cli import dashboard_command

app.command("dashboard")(dashboard_command)
from legorl.engine.cli import serve_command, vllm_app

app.command("serve")(serve_command)
app.add_typer(vllm_app, name="vllm")
from legorl.proxy.cli import proxy_command

app.command("proxy")(proxy_command)
from legorl.models.cli import models_app

app.add_typer(models_app, name="models")


def main() -> None:
    # Torch's OpenMP threads spin while they wait for each other; on a shared or busy CPU a
    # spinning thread takes the core its partner needs (trainer 1.4x slower than with PASSIVE at
    # load 11-16: bench/trainer.py, docs/training.md). Read when torch loads, which no command has
    # done yet here (tests/test_cli.py checks); a user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    app()


if __name__ == "__main__":
    main()
