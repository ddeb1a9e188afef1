"""Ends a vLLM server's process group when the process that started it dies, even by SIGKILL.

The server itself gets SIGTERM then (PR_SET_PDEATHSIG, vllm_server.start), but vLLM's graceful shutdown
can wait forever on a request whose client died (a weight reload in flight: uvicorn's "Waiting for
background tasks to complete"), and its engine processes would outlive it. This process, in a session of
its own, SIGTERMs the group when its parent dies and SIGKILLs it ``GRACE_S`` later. When the server is
stopped normally it exits within a second of the group's end. Nothing of legorl is imported: stdlib only.

Usage: python -P vllm_reaper.py PGID PARENT_PID GRACE_S
"""

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def reap(pgid: int, grace_s: float) -> None:
    """SIGTERM the group, SIGKILL what is left after ``grace_s``, then exit."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + wait_s
        while alive(pgid) and time.monotonic() < end:
            time.sleep(0.2)
    os._exit(0)


def main(pgid: int, parent: int, grace_s: float) -> None:
    signal.signal(signal.SIGTERM, lambda *_: reap(pgid, grace_s))
    # Set here, after the handler (set before exec, a SIGTERM in the interpreter's start would end this
    # process without reaping); a parent that died before it is caught by the getppid check.
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    while alive(pgid):
        if os.getppid() != parent:
            reap(pgid, grace_s)
        time.sleep(1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
