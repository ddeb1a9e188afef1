"""Host side of the verifier stream: a one-connection Unix socket server and the parsed run."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

PLUGIN_SOURCE = Path(__file__).with_name("verifier_plugin.py")
PLUGIN_MODULE = "legorl_verifier"
SOCKET_NAME = "results.sock"
# The test run's pytest configuration when the pristine repository has none: ``-c`` with this file, so no
# config file of the repository (of any name) is read (grader.py).
EMPTY_CONFIG = "legorl-pytest.ini"


def install_verifier_files(verifier: Path, *extra: tuple[Path, str]) -> None:
    """The plugin (and ``extra`` modules: (source, module name)) and the empty config, read-only, in ``verifier``."""
    for src, name in ((PLUGIN_SOURCE, PLUGIN_MODULE), *extra):
        shutil.copyfile(src, verifier / f"{name}.py")
        os.chmod(verifier / f"{name}.py", 0o444)
    (verifier / EMPTY_CONFIG).write_text("[pytest]\n")
    os.chmod(verifier / EMPTY_CONFIG, 0o444)
MAX_EVENTS = 200_000
MAX_LINE = 16 * 1024 * 1024


@dataclass
class StreamedRun:
    """What the verifier plugin reported, in order, plus any sign of tampering with the stream."""

    started: bool = False
    configured: bool = False
    ended: bool = False
    rootdir: str = ""
    collection_started: bool = False
    collected: list[str] | None = None
    collect_errors: dict[str, str] = field(default_factory=dict)
    phases: dict[str, dict[str, str]] = field(default_factory=dict)  # nodeid -> when -> outcome
    xfail: set[str] = field(default_factory=set)
    longrepr: dict[str, str] = field(default_factory=dict)
    exitstatus: int | None = None
    anomalies: list[str] = field(default_factory=list)
    tampering: list[str] = field(default_factory=list)  # the verifier saw the test runner patched

    def status(self, nodeid: str) -> str:
        """passed | failed | error | skipped | xfailed | xpassed | missing (explicit pass needs all phases)."""
        ph = self.phases.get(nodeid)
        if not ph:
            return "missing"
        if ph.get("setup") == "failed" or ph.get("teardown") == "failed":
            return "error"
        if ph.get("call") == "failed":
            return "failed"
        if "skipped" in (ph.get("setup"), ph.get("call")):
            return "xfailed" if nodeid in self.xfail else "skipped"
        if ph.get("setup") == ph.get("call") == ph.get("teardown") == "passed":
            return "xpassed" if nodeid in self.xfail else "passed"
        return "missing"  # a phase never reported (the run died mid-test)

    def statuses(self) -> dict[str, str]:
        ids = list(self.collected or []) + [n for n in self.phases if n not in (self.collected or [])]
        return {n: self.status(n) for n in ids}

    def any_failure(self) -> bool:
        return bool(self.collect_errors) or any(
            s in ("failed", "error") for s in self.statuses().values()
        )

    def feed(self, event: object) -> None:
        if not isinstance(event, dict) or not isinstance(event.get("ev"), str):
            self.anomalies.append("malformed event in the result stream")
            return
        ev = event["ev"]
        if ev != "start" and not self.started:
            self.anomalies.append(f"event {ev!r} before start")
        if self.ended:
            self.anomalies.append(f"event {ev!r} after end")
        if ev == "start":
            if self.started:
                self.anomalies.append("second start event")
            self.started = True
        elif ev == "configured":
            self.configured, self.rootdir = True, str(event.get("rootdir", ""))
        elif ev == "plugin":
            self._plugin(event)
        elif ev == "collection_start":
            self.collection_started = True
        elif ev == "collect_error":
            self.collect_errors[str(event.get("nodeid"))] = str(event.get("longrepr", ""))[-1500:]
        elif ev == "collected":
            if self.collected is not None:
                self.anomalies.append("second collection result")
            ids = event.get("ids")
            self.collected = [str(i) for i in ids] if isinstance(ids, list) else []
        elif ev == "report":
            self._report(event)
        elif ev == "finish":
            if self.exitstatus is not None:
                self.anomalies.append("second session finish")
            self.exitstatus = int(event.get("exitstatus", -1))
        elif ev == "end":
            self.ended = True
        elif ev == "tamper":
            self.tampering.append(str(event.get("what", "?"))[:500])
        else:
            self.anomalies.append(f"unknown event {ev!r}")

    def _plugin(self, event: dict) -> None:
        if event.get("caller"):  # registered from repository code, e.g. a library that a conftest imports
            self.anomalies.append(f"plugin {event.get('name')!r} registered from {event['caller']}")
            return
        if not self.collection_started:
            return  # pytest's own plugins and initial conftests: registered before any repo code ran
        file = str(event.get("file") or "")
        if Path(file).name == "conftest.py":
            return  # a (pristine: agents cannot add one) conftest of a collected directory
        self.anomalies.append(f"plugin {event.get('name')!r} ({file or 'no file'}) registered during the run")

    def _report(self, event: dict) -> None:
        nodeid, when, outcome = str(event.get("nodeid")), str(event.get("when")), str(event.get("outcome"))
        ph = self.phases.setdefault(nodeid, {})
        if when in ph:
            self.anomalies.append(f"duplicate {when} result for {nodeid}")
            ph[when] = "failed"  # contradictory reports never count as a pass
        else:
            ph[when] = outcome
        if event.get("wasxfail"):
            self.xfail.add(nodeid)
        if outcome == "failed" and event.get("longrepr"):
            self.longrepr[nodeid] = str(event["longrepr"])


class ResultServer:
    """Listens on a short Unix socket path; the first connection is the plugin's, later ones are refused."""

    def __init__(self, shared: Path | None = None) -> None:
        """``shared``: a verifier dir already shown to a grading sandbox (the pool's, which holds the
        plugin); the socket then lives in a dir of its own there, ``name``. Without it, a dir of its own
        with the plugin, to be bind-mounted."""
        # Short (sun_path holds 108 bytes); the outer dir is the driver's alone (0700), the inner one is
        # bind-mounted into the grading sandbox, whose uid needs to enter it.
        self.name = ""
        if shared is not None:
            self._outer = self.dir = shared / secrets.token_hex(6)
            self.name = self.dir.name
            self.dir.mkdir(mode=0o755)
            os.chmod(self.dir, 0o755)
        else:
            self._outer = Path(tempfile.mkdtemp(prefix="lgv-"))
            self.dir = self._outer / "v"
            self.dir.mkdir(mode=0o755)
            os.chmod(self.dir, 0o755)
            install_verifier_files(self.dir)
        self.socket_path = self.dir / SOCKET_NAME
        self.run = StreamedRun()
        self._server: asyncio.AbstractServer | None = None
        self._done = asyncio.Event()
        self._connections = 0

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_unix_server(self._handle, path=str(self.socket_path), limit=MAX_LINE)
        os.chmod(self.socket_path, 0o666)  # the sandbox's uid connects
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
        shutil.rmtree(self._outer, ignore_errors=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections += 1
        if self._connections > 1:
            self.run.anomalies.append("a second connection to the result socket")
            writer.close()
            return
        try:
            n = 0
            while line := await reader.readline():
                n += 1
                if n > MAX_EVENTS:
                    self.run.anomalies.append("result stream too long")
                    break
                try:
                    self.run.feed(json.loads(line))
                except (ValueError, TypeError):
                    self.run.anomalies.append("malformed line in the result stream")
        except (ValueError, OSError, asyncio.LimitOverrunError):
            self.run.anomalies.append("unreadable result stream")
        finally:
            writer.close()
            self._done.set()

    async def wait_done(self, timeout: float) -> bool:
        """True once the plugin's connection closed (always true after the sandbox is gone). Called once
        the test process has ended, so its connection is made, but a busy event loop may not have
        accepted it yet: wait for it too, else the whole stream is lost (False after `timeout`: the
        plugin never connected, i.e. pytest never started)."""
        try:
            await asyncio.wait_for(self._done.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
