"""`legorl proxy`: the proxy on its own, recording any harness against an engine (e.g. to build SFT data).

Import-light on purpose (the CLI imports this module on every start): everything heavy is
imported inside the command.

    legorl proxy --engine local --model RUN/checkpoints/latest --port 8000 --run-dir runs/rec
    # OpenAI:    base_url http://127.0.0.1:8000/s/<any-session-id>/v1
    # Anthropic: base_url http://127.0.0.1:8000/s/<any-session-id>
    # or base_url http://127.0.0.1:8000/v1 with the session id as API key

Sessions are opened on first use (ids of letters, digits, '.', '_' and '-'); every call is
recorded to RUN_DIR/store.sqlite, and `legorl report RUN_DIR --json` checks its token fidelity.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer


def _engine_and_tokenizer(engine: str, model: Path | None, script: Path | None, cache_dir: Path,
                          max_context: int | None = None, tools_first: bool = False) -> tuple[Any, Any]:
    from legorl.config import ModelConfig
    from legorl.engine import LocalEngine, ScriptedEngine
    from legorl.models import ModelSpec, build_tokenizer, load_or_build, load_tokenizer
    from legorl.models.chat_format import chat_format

    if engine == "local":
        # The built-in model gets the context `legorl train` gives it (model.max_position_embeddings)
        # unless --max-context says otherwise; a model directory keeps its own, capped by --max-context.
        spec = ModelSpec(max_position_embeddings=max_context or ModelConfig().max_position_embeddings,
                         tools_first=tools_first)
        m, tok = load_or_build(model, spec, cache_dir)
        fmt = chat_format(tok)  # the checkpoint's end-of-turn, stops, tools: a ChatFormatError names what is missing
        return LocalEngine(m, tok, max_context=max_context, chat_format=fmt), tok
    tok = (load_tokenizer(model) if model is not None
           else build_tokenizer(cache_dir, ModelSpec().vocab_size, tools_first))
    replies = json.loads(script.read_text()) if script is not None else ["OK"]
    if not isinstance(replies, list) or not all(isinstance(r, str) for r in replies):
        raise typer.BadParameter(f"{script} must hold a JSON array of reply strings", param_hint="--script")
    # the same replies in every session (cycling), from its first call on
    return ScriptedEngine(tok, script=lambda i, ids: replies[i % len(replies)]), tok


def proxy_command(
    run_dir: Annotated[Path, typer.Option("--run-dir", help="where store.sqlite (every call) and the tokenizer go")],
    engine: Annotated[str, typer.Option("--engine", help="local (a torch model) | scripted (replays --script)")]
    = "local",
    model: Annotated[Path | None, typer.Option("--model", help="local model dir (config.json + tokenizer); "
                                                               "default: the built-in tiny model")] = None,
    port: Annotated[int, typer.Option("--port", help="TCP port (0: any free port)")] = 8000,
    host: Annotated[str, typer.Option("--host", help="address to listen on")] = "127.0.0.1",
    unix_socket: Annotated[Path | None, typer.Option("--unix-socket", help="also listen on this Unix socket")]
    = None,
    served_model_name: Annotated[str, typer.Option("--served-model-name", help="the model name clients see")]
    = "legorl-policy",
    script: Annotated[Path | None, typer.Option("--script", help="scripted engine: JSON array of replies")] = None,
    temperature: Annotated[float, typer.Option(help="sampling temperature (overrides the harness's)")] = 1.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling (overrides the harness's)")] = 1.0,
    max_tokens: Annotated[int, typer.Option(help="cap on completion tokens per call")] = 1024,
    parser: Annotated[str, typer.Option(help="tool-call format: auto (the checkpoint's own, read from its chat "
                                             "template) or a name: tagged, hermes, qwen3_coder, llama3_json, mistral, "
                                             "deepseek, glm45, kimi_k2, harmony, minimax_m2")] = "auto",
    reasoning: Annotated[str, typer.Option(help="reasoning markers: auto (the checkpoint's, read from its chat "
                                                "template), none, think (<think>), mistral ([THINK])")] = "auto",
    cache_dir: Annotated[Path, typer.Option(help="tokenizer/model build cache")] = Path("~/.cache/legorl"),
    max_context: Annotated[int | None, typer.Option(help="context length in tokens (prompt + completion); default: "
                                                          "the model's own (the built-in one: as in legorl train)")]
    = None,
    tools_first: Annotated[bool, typer.Option("--tools-first", help="the built-in tokenizer's template writes the "
                                                                    "tool section before the system message "
                                                                    "(model.tools_first in legorl train)")] = False,
) -> None:
    """Serve the LLM proxy standalone: any harness, any session id, every call recorded token-exactly."""
    if engine not in ("local", "scripted"):
        raise typer.BadParameter("choose local or scripted", param_hint="--engine")
    if model is not None and not model.is_dir():
        raise typer.BadParameter(f"{model} is not a local model directory", param_hint="--model")
    if tools_first and model is not None:
        raise typer.BadParameter("lays out the built-in tokenizer's template; a --model directory brings its own "
                                 "chat template: drop one of the two", param_hint="--tools-first")
    from legorl.models.toolformats import parser_names

    if parser not in parser_names():
        raise typer.BadParameter(f"unknown tool-call format '{parser}'; choose one of {', '.join(parser_names())}",
                                 param_hint="--parser")
    from legorl.models.chat_format import reasoning_styles

    if reasoning not in reasoning_styles():
        raise typer.BadParameter(f"unknown reasoning style '{reasoning}'; choose one of {', '.join(reasoning_styles())}",
                                 param_hint="--reasoning")
    import asyncio
    import contextlib

    from legorl.models.chat_format import ChatFormatError

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(run_dir, engine, model, port, host, unix_socket, served_model_name, script,
                               temperature, top_p, max_tokens, parser, cache_dir.expanduser(), max_context,
                               reasoning, tools_first))
    except ChatFormatError as e:  # the checkpoint's template: what is missing and the fix, no traceback
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None


async def _serve(run_dir: Path, engine_name: str, model: Path | None, port: int, host: str,
                 unix_socket: Path | None, served: str, script: Path | None, temperature: float, top_p: float,
                 max_tokens: int, parser: str, cache_dir: Path, max_context: int | None = None,
                 reasoning: str = "auto", tools_first: bool = False) -> None:
    from legorl.proxy.server import Proxy, SamplingOverride
    from legorl.serving import until_stopped
    from legorl.store import Store

    engine, tok = _engine_and_tokenizer(engine_name, model, script, cache_dir, max_context, tools_first)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / "tokenizer").exists():
        tok.save_pretrained(run_dir / "tokenizer")  # lets `legorl report` check decode(ids) == text
    store = Store(run_dir / "store.sqlite")
    sampling = SamplingOverride(temperature=temperature, top_p=top_p, max_tokens=max_tokens)
    proxy = Proxy(engine, tok, sampling=sampling, model_name=served, on_call=store.add_call, parser=parser,
                  accept_new_sessions=True, reasoning=reasoning)
    await proxy.start(host, port, unix_socket=unix_socket)
    typer.echo(f"legorl proxy on http://{proxy.host}:{proxy.port} (model {served!r}, engine {engine_name})\n"
               f"  OpenAI base URL:    {proxy.openai_base_url('<session>')}\n"
               f"  Anthropic base URL: {proxy.anthropic_base_url('<session>')}\n"
               f"  recording to {run_dir / 'store.sqlite'}; Ctrl-C to stop", err=True)
    try:
        await until_stopped()  # its own SIGINT/SIGTERM handlers: no KeyboardInterrupt or cancellation to catch
    finally:
        await proxy.stop()
        typer.echo(json.dumps(proxy.stats(), indent=2), err=True)
        store.close()
        await engine.close()
