"""legorl's verifier plugin for pytest: streams every result to the grader the moment it exists.

Copied into a verifier dir that is bind-mounted read-only into the grading sandbox and
loaded with ``-p legorl_verifier`` (stdlib + pytest only; no legorl imports). It connects to
the grader's Unix socket (``LEGORL_VERIFIER_SOCKET``) when pytest loads it, before any
conftest or repository code runs; the grader accepts that one connection only. Events are
JSON lines:

  start · configured · plugin (every registration, with its file) · collection_start ·
  collect_error · collected (node ids) · report (one per test phase) · finish (pytest's
  own exit status, seen before any other sessionfinish hook) · end

What was sent cannot be retracted: an atexit hook, a rewritten report file or exit status,
or forged stdout afterwards only creates an inconsistency the grader refuses.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest

_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
_sock.connect(os.environ["LEGORL_VERIFIER_SOCKET"])


def _send(event: dict) -> None:
    try:
        _sock.sendall(json.dumps(event).encode() + b"\n")
    except OSError:
        pass  # the grader sees the stream end early


def _short(longrepr: object) -> str:
    text = str(longrepr) if longrepr is not None else ""
    return text[-1500:]


_send({"ev": "start", "pid": os.getpid(), "argv": sys.argv[1:], "pytest": pytest.__version__})


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    names = sorted(str(name) for name, _ in config.pluginmanager.list_name_plugin())
    _send({"ev": "configured", "plugins": names, "rootdir": str(config.rootpath)})


# Code that may register plugins: pytest, pluggy and what is installed beside them, the standard library,
# this file and conftest.py files (pristine: the grader takes none from the agent). Repository code is
# anything else: a registration with a repository frame on the stack is reported, whatever the phase
# (library code imported by a pristine conftest runs before collection starts).
_TRUSTED = tuple(
    sorted({os.path.dirname(os.path.dirname(pytest.__file__)) + os.sep, os.path.dirname(os.__file__) + os.sep})
) + (os.path.abspath(__file__),)


def _repository_caller() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        trusted = path.startswith(("<", *_TRUSTED)) or os.path.basename(path) == "conftest.py"
        if not trusted:
            return path
        frame = frame.f_back
    return None


def pytest_plugin_registered(plugin: object, manager: object) -> None:
    get_name = getattr(manager, "get_name", None)
    name = get_name(plugin) if get_name else None
    _send({"ev": "plugin", "name": str(name), "file": getattr(plugin, "__file__", None),
           "caller": _repository_caller()})


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    _send({"ev": "collection_start"})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _send({"ev": "collect_error", "nodeid": report.nodeid, "longrepr": _short(report.longrepr)})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    _send({"ev": "collected", "ids": [item.nodeid for item in session.items]})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    event = {
        "ev": "report",
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "wasxfail": hasattr(report, "wasxfail"),
    }
    if report.failed:
        event["longrepr"] = _short(report.longrepr)
    _send(event)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _send({"ev": "finish", "exitstatus": int(exitstatus), "testsfailed": session.testsfailed})


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    _send({"ev": "end"})
    try:
        _sock.close()
    except OSError:
        pass
