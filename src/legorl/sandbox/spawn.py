"""A child process watched by the event loop without asyncio's subprocess machinery.

``asyncio.create_subprocess_exec`` connects the child's pipes in a task of its own and learns of its exit
through a child watcher (a thread per child on CPython 3.11). Cancelled midway, as every task is at the end
of ``asyncio.run``, that set-up can wait forever for an exit it already missed (the loop's end with it), or
leave the started child unowned. Here the child is started synchronously (``subprocess.Popen``: the same
fork and exec asyncio does), so there is no set-up to interrupt; its first stdout line is read through the
loop's reader callbacks and its exit is seen on a pidfd (Linux >= 5.3; polled elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Sequence
from typing import IO


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _LineReader:
    """``readline()`` on a non-blocking pipe, through the running loop."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = b""
        self._eof = False
        os.set_blocking(fd, False)

    async def readline(self) -> bytes:
        while b"\n" not in self._buf and not self._eof:
            loop = asyncio.get_running_loop()
            ready = loop.create_future()
            loop.add_reader(self.fd, _wake, ready)
            try:
                await ready
            finally:
                loop.remove_reader(self.fd)
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            self._buf += chunk
            self._eof = not chunk
        line, sep, self._buf = self._buf.partition(b"\n")
        return line + sep


class Spawned:
    """What the sandbox backends use of a process: ``pid``, ``returncode``, ``stdin`` (the write end of its
    stdin pipe, when asked for), ``stdout.readline()`` and ``wait()``."""

    def __init__(self, popen: subprocess.Popen) -> None:
        self._popen = popen
        self.pid = popen.pid
        self.stdin: IO[bytes] | None = popen.stdin
        self.stdout = _LineReader(popen.stdout.fileno()) if popen.stdout is not None else None

    @property
    def returncode(self) -> int | None:
        return self._popen.poll()

    async def wait(self) -> int:
        """Its exit status, once it has exited (reaped here)."""
        if (rc := self._popen.poll()) is not None:
            return rc
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd: poll
            while (rc := self._popen.poll()) is None:
                await asyncio.sleep(0.01)
            return rc
        loop = asyncio.get_running_loop()
        try:
            while (rc := self._popen.poll()) is None:
                exited = loop.create_future()
                loop.add_reader(pidfd, _wake, exited)
                try:
                    await exited
                finally:
                    loop.remove_reader(pidfd)
            return rc
        finally:
            os.close(pidfd)

    def close_pipes(self) -> None:
        for f in (self._popen.stdin, self._popen.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


def spawn(argv: Sequence[str], stderr: int) -> Spawned:
    """Start ``argv`` in a session of its own, stdin and stdout pipes to this process, stderr to ``stderr``."""
    popen = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                             start_new_session=True)  # fmt: skip
    return Spawned(popen)
