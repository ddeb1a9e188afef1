"""Engines: prompt token ids in, sampled completion ids + logprobs out (see base.Engine).

LocalEngine (embedded, fast path + prefix reuse), VLLMEngine / SGLangEngine (remote servers),
ScriptedEngine (replays texts), UpstreamEngine (a hosted teacher). docs/engines.md describes them; `legorl serve` is engine/server.py.

Names load lazily: `legorl.engine.cli` (and so the `legorl` command) must not pay for a torch import.
"""

from importlib import import_module
from typing import Any

_WHERE = {
    "ContextOverflowError": "base", "Engine": "base", "EngineError": "base", "Weights": "base",
    "LocalEngine": "local", "SGLangEngine": "remote", "VLLMEngine": "remote", "ScriptedEngine": "scripted",
    "UpstreamEngine": "upstream",
    "sample_token": "sampling", "sampling_logprobs": "sampling", "token_logprobs": "sampling",
}

__all__ = list(_WHERE)  # the lazy names, listed once above


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'legorl.engine' has no attribute {name!r}")
    return getattr(import_module(f"legorl.engine.{_WHERE[name]}"), name)
