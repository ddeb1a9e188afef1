"""Small builders shared by several test modules (tests/ is on sys.path under pytest's default import mode)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import transformers

T = TypeVar("T")

# Prefix of an argv that runs the rest with SIGINT ignored, as bash starts a script's background job: exec
# keeps an ignored signal ignored (no preexec_fn, which is unsafe beside threads).
_IGNORE_SIGINT_AND_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                           "os.execv(sys.argv[1], sys.argv[1:])")
SIGINT_IGNORED = [sys.executable, "-c", _IGNORE_SIGINT_AND_EXEC]


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.01) -> T:
    """Poll `predicate` until it returns something truthy or `timeout` seconds pass; its last value.

    For events a test cannot be told about directly (a process exiting, a row appearing in another
    process's database): the wait ends as soon as the event happens, and a loaded machine gets the
    whole `timeout`. The caller asserts on the value, so a wait that times out fails the test.
    """
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(interval)
    return value


async def wait_until_async(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.005) -> T:
    """`wait_until` inside an event loop: the loop keeps running while it polls."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()) and time.monotonic() < deadline:
        await asyncio.sleep(interval)
    return value


def run_processes(root: Path, kinds: tuple[str, ...] = ("bwrap", "mini_worker")) -> list[str]:
    """Live processes whose command line names `root` and one of `kinds` (sandboxes, harness workers)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(root) in cmd and any(k in cmd for k in kinds):
            found.append(f"{proc.name}: {cmd[:120]}")
    return found


def surviving_processes(root: Path, timeout: float = 30.0) -> list[str]:
    """run_processes(root) once they had `timeout` seconds to exit: teardown after a kill takes a
    moment on a loaded machine, while a real survivor stays forever."""
    found: list[str] = []

    def gone() -> bool:
        nonlocal found
        found = run_processes(root)
        return not found

    wait_until(gone, timeout, interval=0.2)
    return found


def tiny_qwen3(seed: int = 0, **config: object) -> transformers.Qwen3ForCausalLM:
    """A 2-layer Qwen3 with a 300-token vocabulary, deterministic in `seed`; `config` overrides fields."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**{
        "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "tie_word_embeddings": True, **config,
    })
    return transformers.Qwen3ForCausalLM(cfg)


def run_mini_episode(tokenizer, tmp_path: Path, task, harness_cfg=None, *, command_timeout: float = 20,
                     script_for=None, **ctx_kwargs):
    """One mini-swe-agent episode through a ScriptedEngine behind a real proxy, in a real sandbox; the Rollout.

    ``script_for(task, teacher_style)`` writes the episode's script; ``ctx_kwargs`` go to EpisodeContext (label,
    timeouts, limits, sandbox, ...)."""
    from legorl.config import HarnessConfig
    from legorl.engine import ScriptedEngine
    from legorl.harness.mini_swe_agent import MiniSweAgentHarness
    from legorl.proxy.server import Proxy
    from legorl.rollout.episode import EpisodeContext, always, run_episode, scripted
    from legorl.store import Store

    async def main():
        store = Store(tmp_path / "store.sqlite")
        engine = ScriptedEngine(tokenizer)
        proxy = Proxy(engine, tokenizer, on_call=store.add_call)
        await proxy.start(unix_socket=tmp_path / "s" / "proxy.sock")
        harness = MiniSweAgentHarness(harness_cfg or HarnessConfig(), command_timeout=command_timeout,
                                      log_dir=tmp_path / "logs")
        await harness.start()
        try:
            engine_for = scripted(engine, script_for) if script_for is not None else always(engine)
            ctx = EpisodeContext(proxy=proxy, engine_for=engine_for, harnesses={harness.name: harness}, store=store,
                                 run_dir=tmp_path, hide_paths=[tmp_path], **ctx_kwargs)
            return await run_episode(ctx, task, step=0, group_id="g", sample_index=0)
        finally:
            await harness.close()
            await proxy.stop()

    return asyncio.run(main())
