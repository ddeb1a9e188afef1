"""`legorl dashboard RUN_DIR`: serve a run's dashboard (live while the run is training). Import-light."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def dashboard_command(
    run_dir: Annotated[Path, typer.Argument(help="a run directory written by `legorl train` (live or finished)")],
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port; 0 picks a free one")] = 8765,
    host: Annotated[str, typer.Option("--host", help="bind address; anything but loopback needs --token")]
    = "127.0.0.1",
    token: Annotated[str | None, typer.Option("--token", help="required on every request (?token=, then a cookie)",
                                              envvar="LEGORL_DASHBOARD_TOKEN")] = None,
) -> None:
    """Serve the monitoring dashboard of a run: curves, rollouts, trajectories, failures, behaviour, alarms."""
    import asyncio

    from rich.console import Console

    from legorl.monitor.db import StoreMissing
    from legorl.monitor.server import DashboardConfigError, serve_dashboard

    console = Console(stderr=True)

    async def main() -> None:
        url, stop = await serve_dashboard(run_dir, host=host, port=port, token=token)
        console.print(f"dashboard of {run_dir.resolve()}: [bold]{url}[/] (Ctrl-C stops)")
        try:
            await asyncio.Event().wait()
        finally:
            await stop()

    try:
        asyncio.run(main())
    except (DashboardConfigError, StoreMissing, OSError) as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        pass
