"""The dashboard web app: FastAPI, server-rendered page shells, a small vanilla-JS front end.

    app = create_app(run_dir)                                   # any ASGI server, or TestClient
    url, stop = await serve_dashboard(run_dir)                  # inside the training driver's loop
    ...
    await stop()

Everything it needs ships in this package (static/charts.js draws SVG charts): it
works offline. It binds to loopback by default; binding any other address needs a
token, checked on every request (`?token=` once, then a cookie). Without a token it
answers only requests whose Host names a loopback address: a web page the user visits
cannot read it through a name rebound to 127.0.0.1 (DNS rebinding).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import ipaddress
import json
import math
import socket
import threading
from collections.abc import Awaitable, Callable, Generator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles

from legorl.monitor import analytics
from legorl.monitor.compare import compare
from legorl.monitor.config import AlarmConfig
from legorl.monitor.db import RolloutFilter, RunDB
from legorl.monitor.progress import estimate, read_progress
from legorl.monitor.tasks_grid import task_grid
from legorl.monitor.trajectory import TokenDecoder, trajectory

STATIC = Path(__file__).parent / "static"
COOKIE = "legorl_dashboard_token"
PAGES = [("overview", "/", "Overview"), ("rollouts", "/rollouts", "Rollouts"), ("tasks", "/tasks", "Tasks"),
         ("failures", "/failures", "Failures"),
         ("behaviour", "/behaviour", "Behaviour"), ("alarms", "/alarms", "Alarms")]


class DashboardConfigError(ValueError):
    """The dashboard cannot start as asked (e.g. a public address without a token)."""


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port ('[::1]:8000' -> '::1'); '' when it does not parse."""
    try:
        return urlsplit("//" + host_header).hostname or ""
    except ValueError:
        return ""


def check_bind(host: str, token: str | None) -> None:
    if not is_loopback(host) and not token:
        raise DashboardConfigError(
            f"refusing to serve the dashboard on {host}, which is not a loopback address, without a token: "
            "pass --token (or monitor.token) and open the URL with ?token=..., or bind 127.0.0.1")


def alarm_config_for(run_dir: Path) -> AlarmConfig:
    """The run's `monitor.alarms` settings from RUN_DIR/config.json, else the defaults."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
        return AlarmConfig.model_validate(cfg.get("monitor", {}).get("alarms", {}))
    except (OSError, ValueError, AttributeError):
        return AlarmConfig()


def _page(page: str, title: str, run_name: str, data: dict[str, str] | None = None,
          pages: list[tuple[str, str, str]] = PAGES) -> HTMLResponse:
    nav = "".join(f'<a href="{href}" class="{"active" if key == page else ""}" data-nav="{key}">{label}'
                  + ('<span id="alarm-count" class="badge" hidden></span>' if key == "alarms" else "") + "</a>"
                  for key, href, label in pages)
    attrs = " ".join(f'data-{k}="{html.escape(v, quote=True)}"' for k, v in (data or {}).items())
    body = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)} · legorl · {html.escape(run_name)}</title>
<link rel="icon" href="data:,"><link rel="stylesheet" href="/static/style.css"></head>
<body data-page="{page}" {attrs}>
<header><a class="brand" href="/">legorl</a><span class="run">{html.escape(run_name)}</span><nav>{nav}</nav>
<span id="live" class="live" title="refreshes every few seconds">●</span></header>
<div id="alarm-banner" class="alarm-banner" hidden></div>
<main id="app"><p class="muted">loading…</p></main>
<div id="tip" class="tip" hidden></div>
<script src="/static/charts.js"></script><script src="/static/app.js"></script>
</body></html>"""
    return HTMLResponse(body)


def _finite(o: Any) -> Any:
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def json_bytes(obj: Any) -> bytes:
    """Compact JSON; NaN and infinities (which JSON lacks) become null."""
    try:
        return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        return json.dumps(_finite(obj), separators=(",", ":"), allow_nan=False).encode()


def _json(body: bytes) -> Response:
    return Response(body, media_type="application/json")


def _num(v: str | None, kind: type = int) -> Any:
    if v is None or v == "":
        return None
    try:
        return kind(v)
    except ValueError:
        raise HTTPException(400, f"not a number: {v!r}") from None


def create_app(run_dir: str | Path, token: str | None = None, alarm_config: AlarmConfig | None = None,
               compare_with: Sequence[str | Path] = ()) -> FastAPI:
    """The dashboard for one run directory (its store may still be being written); with `compare_with`, a
    Compare page shows it beside those runs."""
    run_dir = Path(run_dir).resolve()
    db = RunDB(run_dir)
    others = [RunDB(Path(d).resolve()) for d in compare_with]
    pages = PAGES + ([("compare", "/compare", "Compare")] if others else [])
    decoder = TokenDecoder(run_dir / "tokenizer")
    cache = analytics.BehaviourCache(db)
    board = analytics.AlarmBoard(db, cache, alarm_config or alarm_config_for(run_dir))
    run_name = db.run_info()["name"] or run_dir.name
    threading.Thread(target=lambda: decoder.tokenizer, name="legorl-dashboard-tokenizer", daemon=True).start()
    app = FastAPI(title="legorl dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.db, app.state.token = db, token

    if not token:
        @app.middleware("http")
        async def check_host(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            host = request.headers.get("host", "")
            if not is_loopback(host_name(host)):
                return PlainTextResponse(
                    f"421: this dashboard serves loopback addresses only, not Host {host!r}: open it at "
                    "http://127.0.0.1:<port>/, or serve it with a token (--token) to reach it by another name", 421)
            return await call_next(request)

    if token:
        @app.middleware("http")
        async def check_token(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
            if not hmac.compare_digest(given.encode(), token.encode()):
                return PlainTextResponse("401: this dashboard needs its token: open it with ?token=...", 401)
            response = await call_next(request)
            if request.query_params.get("token"):
                response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
            return response

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def page_shell(key: str, label: str) -> Callable[[], HTMLResponse]:
        def shell() -> HTMLResponse:
            return _page(key, label, run_name, pages=pages)

        shell.__name__ = f"{key}_page"
        return shell

    for key, href, label in pages:  # the pages of the navigation bar
        app.get(href, response_class=HTMLResponse)(page_shell(key, label))

    @app.get("/rollout/{rollout_id}", response_class=HTMLResponse)
    def rollout_page(rollout_id: str) -> HTMLResponse:
        return _page("trajectory", rollout_id, run_name, {"rollout": rollout_id}, pages=pages)

    # ---- JSON API (sync handlers: FastAPI runs them in worker threads, off the event loop) -------------
    @app.get("/api/health")
    def health() -> dict[str, Any]:
        return {"ok": True, "run_dir": str(run_dir)}

    @app.get("/api/overview")
    def api_overview() -> Response:
        return _json(db.cached(("overview",), lambda: json_bytes(analytics.overview(db))))

    @app.get("/api/progress")
    def api_progress() -> dict[str, Any]:
        """The run's phase, its progress and the time left (null where nothing measured supports it)."""
        p = read_progress(run_dir)
        return estimate(p) if p is not None else {"phase": None}

    @app.get("/api/config")
    def api_config() -> Response:
        """The resolved config the run was launched with (config.json)."""
        path = run_dir / "config.json"
        if not path.is_file():
            raise HTTPException(404, "this run has no config.json")
        return _json(path.read_bytes())

    @app.get("/api/tasks")
    def api_tasks(split: str = "train", step_max: str | None = None) -> Response:
        """The task grid of a split: per task and step, resolved / failed / masked and a rollout to open."""
        s = _num(step_max)
        return _json(db.cached(("tasks", split, s), lambda: json_bytes(task_grid(db, split, s))))

    @app.get("/api/compare")
    def api_compare() -> Response:
        """This run beside the ones given with it: curves on the same axes, config differences, per harness."""
        key = ("compare", *(d.version() for d in others))
        return _json(db.cached(key, lambda: json_bytes(compare([db, *others]))))

    @app.get("/api/rollouts")
    def api_rollouts(step: str | None = None, step_min: str | None = None, step_max: str | None = None,
                     task: str | None = None, harness: str | None = None, outcome: str | None = None,
                     split: str | None = None, reward_min: str | None = None, reward_max: str | None = None,
                     masked: str | None = None, sort: str = "step", order: str = "desc", page: int = 1,
                     per_page: int = 50) -> Response:
        f = RolloutFilter(step=_num(step), step_min=_num(step_min), step_max=_num(step_max), task=task or None,
                          harness=harness or None, outcome=outcome or None, split=split or None,
                          reward_min=_num(reward_min, float), reward_max=_num(reward_max, float),
                          masked={"1": True, "true": True, "0": False, "false": False}.get(masked or ""))
        p = db.rollouts_page(f, sort=sort, desc=order != "asc", page=page, per_page=per_page)
        return _json(json_bytes({"rows": p.rows, "total": p.total, "page": p.page, "per_page": p.per_page,
                                 "facets": p.facets}))

    @app.get("/api/rollout/{rollout_id}")
    def api_rollout(rollout_id: str) -> Response:
        t = trajectory(db, rollout_id, decoder)
        if t is None:
            raise HTTPException(404, f"no rollout {rollout_id!r} in this run")
        return _json(json_bytes(t))

    @app.get("/api/failures")
    def api_failures(split: str = "train") -> Response:
        s = None if split in ("", "all") else split
        infra = tuple(board.cfg.infra_outcomes)
        return _json(db.cached(("failures", s), lambda: json_bytes(analytics.failures(db, s, infra))))

    @app.get("/api/behaviour")
    def api_behaviour() -> Response:
        summary = run_dir / "summary.json"  # the evaluations before and after RL are read from it
        stamp = summary.stat().st_mtime_ns if summary.exists() else 0
        return _json(db.cached(("behaviour", stamp), lambda: json_bytes(
            analytics.behaviour(cache, analytics.evaluation_shares(db)))))

    @app.get("/api/alarms")
    def api_alarms() -> Response:
        return _json(db.cached(("alarms",), lambda: json_bytes(board.alarms())))

    return app


class _QuietServer:
    """uvicorn.Server without its signal handlers: the training driver keeps Ctrl-C."""

    @staticmethod
    def make(config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Generator[None, None, None]:
                yield

        return Server(config)


async def serve_dashboard(run_dir: str | Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                          alarm_config: AlarmConfig | None = None, compare_with: Sequence[str | Path] = ()
                          ) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve the dashboard on the running event loop. Returns (url, stop); `await stop()` shuts it down.

    Binding a non-loopback host without a token raises DashboardConfigError. The URL carries the token.
    """
    import uvicorn

    check_bind(host, token)
    app = create_app(run_dir, token=token, alarm_config=alarm_config, compare_with=compare_with)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(128)
    sock.setblocking(False)
    bound_port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2)
    server = _QuietServer.make(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="legorl-dashboard")
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise RuntimeError("the dashboard server stopped during start-up")
        await asyncio.sleep(0.01)
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    shown = f"[{shown}]" if ":" in shown and not shown.startswith("[") else shown
    url = f"http://{shown}:{bound_port}/" + (f"?token={token}" if token else "")

    async def stop() -> None:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, timeout=5)
        sock.close()

    return url, stop


@contextlib.contextmanager
def served_in_thread(run_dir: str | Path, compare_with: Sequence[str | Path] = ()) -> Generator[str, None, None]:
    """The dashboard of `run_dir` served from an event loop of its own in a daemon thread, for synchronous
    code (a browser driving it: tests/test_dashboard_browser.py, scripts/dashboard_screenshots.py); yields the
    base URL without its trailing slash, and stops the server on exit."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="legorl-dashboard-loop", daemon=True)
    thread.start()
    url, stop = asyncio.run_coroutine_threadsafe(serve_dashboard(run_dir, compare_with=compare_with), loop).result(60)
    try:
        yield url.rstrip("/")
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
