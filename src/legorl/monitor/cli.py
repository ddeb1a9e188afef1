"""`legorl dashboard RUN_DIR`: serve a run's dashboard (live while the run is training). Import-light."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def dashboard_command(
    run_dirs: Annotated[list[Path], typer.Argument(
        help="run directories written by `legorl train` (live or finished); with several, the first one's pages "
             "and a Compare page of all of them", metavar="RUN_DIR...")],
    port: Annotated[int, typer.Option("--port", "-p", help="TCP port; 0 picks a free one")] = 8765,
    host: Annotated[str, typer.Option("--host", help="bind address; anything but loopback needs --token")]
    = "127.0.0.1",
    token: Annotated[str | None, typer.Option("--token", help="required on every request (?token=, then a cookie)",
                                              envvar="LEGORL_DASHBOARD_TOKEN")] = None,
) -> None:
    """Serve the monitoring dashboard of a run: curves, rollouts, trajectories, failures, behaviour, alarms;
    given several runs, also their comparison."""
    import asyncio

    from rich.console import Console

    from legorl.monitor.db import StoreMissing
    from legorl.monitor.server import DashboardConfigError, serve_dashboard
    from legorl.serving import until_stopped

    console = Console(stderr=True)

    async def main() -> None:
        url, stop = await serve_dashboard(run_dirs[0], host=host, port=port, token=token, compare_with=run_dirs[1:])
        shown = ", ".join(str(d.resolve()) for d in run_dirs)
        also = " (the runs side by side: its Compare page, /compare)" if len(run_dirs) > 1 else ""
        console.print(f"dashboard of {shown}: [bold]{url}[/]{also} (Ctrl-C stops)")
        try:
            await until_stopped()
        finally:
            await stop()

    try:
        asyncio.run(main())
    except (DashboardConfigError, StoreMissing, OSError) as e:
        console.print(f"[bold red]error:[/] {e}")
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        pass
