"""The sandbox agent's command runner closes each descriptor once, and says why a command never started."""

from __future__ import annotations

import os

import pytest

from legorl.sandbox import sandbox_agent


def test_a_launcher_killed_on_every_retry_is_reported_and_each_fd_closed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    launched, live, twice = [], set(), []  # a pipe's number is reused once closed: track which are open now
    real_close = os.close

    def launch(bash, command, env, cwd, out_fd):  # a real descriptor per try, as the zygote's reply pipe
        r, w = os.pipe()
        real_close(w)
        launched.append(r)
        live.add(r)
        return r

    def close(fd: int) -> None:
        if fd in launched and fd not in live:
            twice.append(fd)  # closing a number the runner no longer owns: another thread's descriptor
        live.discard(fd)
        real_close(fd)

    monkeypatch.setattr(sandbox_agent, "_launch", launch)
    monkeypatch.setattr(sandbox_agent, "_follow", lambda rfd, deadline, conn_fd: ("", 0, []))  # it died unstarted
    monkeypatch.setattr(sandbox_agent, "_zygote_gone", lambda: True)  # killed between retries, every time
    monkeypatch.setattr(sandbox_agent, "_which", lambda name, env: "/bin/bash")
    monkeypatch.setattr(os, "close", close)
    fds_before = set(os.listdir("/proc/self/fd"))

    reply = sandbox_agent.run_command({"command": "true", "timeout": 5})

    assert reply["returncode"] == -1 and "never started" in reply["output"] and "launcher died" in reply["output"]
    assert len(launched) == len(sandbox_agent.FORK_RETRY_S) + 1  # every retry was taken
    assert twice == [] and live == set()  # each closed once, none left open
    assert set(os.listdir("/proc/self/fd")) <= fds_before
