"""`legorl serve`: run the embedded engine as an HTTP server (vLLM / SGLang API subset). Import-light."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from legorl.config import EngineConfig

_ENGINE = EngineConfig()  # the `engine` section's defaults, as `legorl train` has them


def serve_command(
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            "-m",
            help="local HF model directory; default: the built-in tiny Qwen3 of the default model section",
        ),
    ] = None,
    host: Annotated[str, typer.Option("--host", help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port")] = 8000,
    served_model_name: Annotated[
        str, typer.Option("--served-model-name", help="name in /v1/models")
    ] = "legorl-policy",
    max_batch: Annotated[int, typer.Option("--max-batch", help="concurrent sequences (KV slots)")]
    = _ENGINE.max_batch,
    max_context: Annotated[int | None, typer.Option("--max-context", help="cap on context length")] = None,
    prefix_cache_mb: Annotated[
        float, typer.Option("--prefix-cache-mb", help="prefix cache bound; 0 = off")
    ] = _ENGINE.prefix_cache_mb,
    threads: Annotated[int, typer.Option("--threads", help="torch intra-op threads; 0: torch's default")]
    = _ENGINE.torch_threads,
    split_steps: Annotated[
        bool, typer.Option("--split-steps", help="each large step as two halves in two threads (idle 2nd core)")
    ] = _ENGINE.split_steps,
    device: Annotated[str, typer.Option("--device", help="cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[
        str, typer.Option("--dtype", help="float32 (exact logprobs), bfloat16 or float16")
    ] = "float32",
    cache_dir: Annotated[
        Path, typer.Option("--cache-dir", help="where the built-in tiny model is cached")
    ] = Path("~/.cache/legorl"),
) -> None:
    """Serve a model with /v1/completions (vLLM), /generate (SGLang), /health and weight reloads."""
    import uvicorn
    from rich.console import Console

    from legorl.engine.local import LocalEngine
    from legorl.engine.server import EngineServer
    from legorl.models import ModelSpec, load_or_build

    console = Console(stderr=True)
    try:
        policy, tokenizer = load_or_build(model, ModelSpec(), cache_dir.expanduser())
    except (FileNotFoundError, OSError, ValueError) as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from e
    if dtype not in ("float32", "bfloat16", "float16"):
        console.print(f"[bold red]error:[/] --dtype {dtype!r}: use float32, bfloat16 or float16")
        raise typer.Exit(2)
    import torch

    policy = policy.to(device=device, dtype=getattr(torch, dtype))
    engine = LocalEngine(policy, tokenizer, max_batch=max_batch, prefix_cache_mb=prefix_cache_mb,
                         torch_threads=threads, split_steps=split_steps, max_context=max_context)
    server = EngineServer(engine, tokenizer, served_model_name, str(model) if model else None)
    console.print(
        f"legorl serve: {served_model_name} ({engine.backend} engine, context {engine.max_context()}) "
        f"on [bold]http://{host}:{port}[/]"
    )
    uvicorn.run(server.app, host=host, port=port, log_level="warning")
