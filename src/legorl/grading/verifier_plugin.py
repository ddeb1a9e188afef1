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
import types

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


def _repository_caller(depth: int = 2) -> str | None:
    frame = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename
        trusted = path.startswith(("<", *_TRUSTED)) or os.path.basename(path) == "conftest.py"
        if not trusted:
            return path
        frame = frame.f_back
    return None


# ---- tampering with the runner, whatever it is spelt like ----------------------------------------------
# Repository code runs inside this process and could patch pytest (`Function.runtest`, `call_and_report`)
# with names built at run time. Two checks no spelling avoids, both set up before any repository code runs:
# a PEP 578 audit hook (it cannot be removed) that refuses and reports every attribute write on a class or
# function of pytest, pluggy or this plugin made with repository code on the stack, and an identity check
# of every function and class those modules hold (and every attribute of those classes), taken when
# collection starts, before each result is sent. Both report through a socket method bound here, which a rebound module name cannot redirect.
_GUARDED = ("_pytest", "pytest", "pluggy", "iniconfig", __name__)


def _guarded_module(name: object) -> bool:
    return isinstance(name, str) and (name == __name__ or name.split(".")[0] in _GUARDED)


def _runner_snapshot() -> list[tuple[dict | types.MappingProxyType, str, object, str]]:
    entries: list[tuple[dict | types.MappingProxyType, str, object, str]] = []
    for modname, module in list(sys.modules.items()):
        if module is None or not _guarded_module(modname):
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, (type, types.FunctionType)):
                entries.append((vars(module), name, value, f"{modname}.{name}"))
                if isinstance(value, type) and value.__module__ == modname:
                    entries.extend((vars(value), attr, v, f"{value.__qualname__}.{attr}")
                                   for attr, v in list(vars(value).items()))  # fmt: skip
    return entries


def _make_tamper_checks():
    sendall, missing, reported = _sock.sendall, object(), set()
    snapshot: list = []
    is_guarded, repository_caller, take_snapshot = _guarded_module, _repository_caller, _runner_snapshot

    def report(what: str) -> None:
        if what not in reported:
            reported.add(what)
            try:
                sendall(json.dumps({"ev": "tamper", "what": what}).encode() + b"\n")
            except OSError:
                pass

    def check(start: bool = False) -> None:
        """At collection start: the runner as pytest configured it (its own plugins patch a few of its
        classes in pytest_configure). Before every result is sent after that: a replaced runner function
        shows here, however it was done."""
        if start:
            snapshot[:] = take_snapshot()
        for namespace, name, value, label in snapshot:
            if namespace.get(name, missing) is not value:
                report(f"{label} replaced")

    def audit(event: str, args: tuple) -> None:
        if event not in ("object.__setattr__", "object.__delattr__"):
            return
        target = args[0]
        if not isinstance(target, (type, types.FunctionType)) or not is_guarded(getattr(target, "__module__", None)):
            return
        caller = repository_caller(2)
        if caller is None:
            return  # pytest or a pristine conftest setting its own attributes
        what = f"{getattr(target, '__qualname__', target)}.{args[1]} {'set' if len(args) > 2 else 'deleted'} from {caller}"
        report(what)
        raise RuntimeError(f"legorl verifier: code under test may not patch the test runner ({what})")

    sys.addaudithook(audit)
    return check


_check_runner = _make_tamper_checks()


def pytest_plugin_registered(plugin: object, manager: object) -> None:
    get_name = getattr(manager, "get_name", None)
    name = get_name(plugin) if get_name else None
    _send({"ev": "plugin", "name": str(name), "file": getattr(plugin, "__file__", None),
           "caller": _repository_caller()})


@pytest.hookimpl(tryfirst=True)
def pytest_collection(session: pytest.Session) -> None:
    _check_runner(start=True)
    _send({"ev": "collection_start"})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _send({"ev": "collect_error", "nodeid": report.nodeid, "longrepr": _short(report.longrepr)})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    _check_runner()
    _send({"ev": "collected", "ids": [item.nodeid for item in session.items]})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _check_runner()
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
    _check_runner()
    _send({"ev": "finish", "exitstatus": int(exitstatus), "testsfailed": session.testsfailed})


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    _send({"ev": "end"})
    try:
        _sock.close()
    except OSError:
        pass
