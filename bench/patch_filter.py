"""Filtering a patch at the size limit, and what it costs the other sessions of the same driver.

The grader filters every agent diff (``policy.filter_diff_detailed``) in a worker thread of the driver's
event loop, which also serves the proxy to every other rollout. Measured in one run:

* filter time of a 2 MB patch (git and traditional sections, 2 MB of added lines; target < 0.5 s);
* a small session's proxy latency (p50, sequential calls through legorl's proxy, in-process, as in the
  driver) while the grader's ``filter_off_loop`` filters that patch back to back, as a ratio to its latency
  with nothing else running (target: at most 2x). A thread would not do: its pure-Python work holds the
  GIL the loop needs (measured 45x); above 256 KB the grader filters in a worker process.

    .venv/bin/python bench/patch_filter.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy import chat_path, free_port, serve_legorl, session

from legorl.grading.grader import filter_off_loop
from legorl.grading.policy import MAX_PATCH_BYTES, filter_diff_detailed


def big_patch(size: int) -> str:
    """Git sections on existing modules and traditional new-file sections, ``size`` bytes in all."""
    parts, total, i = [], 0, 0
    while total < size:
        body = "".join(f"+value_{i}_{k} = {k} * {i}  # a generated constant\n" for k in range(400))
        if i % 2:
            head = f"diff --git a/pkg/mod_{i}.py b/pkg/mod_{i}.py\n--- a/pkg/mod_{i}.py\n+++ b/pkg/mod_{i}.py\n"
            sec = head + "@@ -1,1 +1,401 @@\n x = 0\n" + body
        else:
            sec = f"--- /dev/null\n+++ b/pkg/new_{i}.py\n@@ -0,0 +1,400 @@\n" + body
        parts.append(sec)
        total += len(sec)
        i += 1
    return "".join(parts)[: size - 1].rsplit("\n", 1)[0] + "\n"


async def measure(turns: int, sessions: int) -> dict[str, float]:
    patch = big_patch(MAX_PATCH_BYTES)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        filter_diff_detailed(patch)
        times.append(time.perf_counter() - t0)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        server = asyncio.create_task(serve_legorl(port, Path(tmp) / "tok", Path(tmp) / "store.db"))
        for _ in range(600):
            try:
                (await asyncio.open_connection("127.0.0.1", port))[1].close()
                break
            except OSError:
                await asyncio.sleep(0.1)
        warm: list[float] = []
        await session(port, chat_path("warm"), {}, turns, warm)

        async def round_(tag: str) -> list[float]:
            lat: list[float] = []
            for i in range(sessions):
                await session(port, chat_path(f"{tag}-{i}"), {}, turns, lat)
            return lat

        quiet = await round_("quiet")
        stop = asyncio.Event()
        filtered = 0

        async def filter_loop() -> None:  # back to back, as the grader filters (the worst case: no pause)
            nonlocal filtered
            while not stop.is_set():
                await filter_off_loop(patch, set(), frozenset())
                filtered += 1

        worker = asyncio.create_task(filter_loop())
        await asyncio.sleep(1.0)  # the worker process started
        filtered = 0
        busy = await round_("busy")
        stop.set()
        await worker
        server.cancel()
    q, b = statistics.median(quiet), statistics.median(busy)
    return {"patch_mb": len(patch) / 1e6, "filter_s": min(times), "quiet_ms": q * 1e3, "busy_ms": b * 1e3,
            "ratio": b / q, "filters_during": filtered, "calls": len(busy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--sessions", type=int, default=40)
    a = ap.parse_args()
    r = asyncio.run(measure(a.turns, a.sessions))
    print("| patch | filter s (target < 0.5) | proxy p50 ms, quiet | p50 ms, while the grader filters it | ratio (target <= 2) |")
    print("|---|---|---|---|---|")
    print(f"| {r['patch_mb']:.1f} MB | **{r['filter_s']:.3f}** | {r['quiet_ms']:.2f} | {r['busy_ms']:.2f} | "
          f"**{r['ratio']:.2f}x** |")
    print(f"({r['calls']} calls each; {r['filters_during']} filters of the whole patch ran during the busy round)")


if __name__ == "__main__":
    main()
