"""`serving.until_stopped`: how `legorl proxy` and `legorl dashboard` wait; Ctrl-C and `kill` both stop them."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from helpers import SIGINT_IGNORED

WAITER = """
import asyncio, sys
from legorl.serving import until_stopped
async def main():
    # runs once until_stopped awaits, its handlers installed
    asyncio.get_running_loop().call_soon(lambda: print("waiting", flush=True))
    await until_stopped()
    print("stopped", flush=True)
asyncio.run(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_stops_the_wait_even_with_sigint_inherited_ignored(sig):
    # Python keeps an ignored SIGINT as it found it: without its own handler, Ctrl-C would do nothing
    proc = subprocess.Popen([*SIGINT_IGNORED, sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "waiting\n"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out) == (0, "stopped\n")
