"""uvicorn inside the caller's event loop (proxy, engine server): no signal capture, bounded shutdown; and
the wait of a standalone server's command until Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from typing import Any

import uvicorn


class LoopServer:
    """Serves an ASGI app on given sockets from the running loop; the process keeps SIGINT."""

    def __init__(self, app: Any):
        self.app = app
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self, sockets: list[socket.socket]) -> None:
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=30, backlog=2048, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server._serve(sockets=sockets))  # _serve: no signal capture
        while not self._server.started:
            if self._task.done():
                self._task.result()
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._task, timeout=5)


async def until_stopped() -> None:
    """Return on SIGINT or SIGTERM. Its own handlers: a server started with SIGINT ignored (a background job
    of a script, as bash starts them) still stops on Ctrl-C, and `kill` stops it cleanly too."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
