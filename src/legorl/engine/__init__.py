"""Engines: prompt token ids in, sampled completion ids + logprobs out (see base.Engine).

LocalEngine (embedded, fast path + prefix reuse), VLLMEngine / SGLangEngine (remote servers),
ScriptedEngine (replays texts). docs/engines.md describes them; `legorl serve` is engine/server.py.
"""

from legorl.engine.base import ContextOverflowError, Engine, EngineError
from legorl.engine.local import LocalEngine
from legorl.engine.remote import SGLangEngine, VLLMEngine
from legorl.engine.sampling import sample_token, sampling_logprobs, token_logprobs
from legorl.engine.scripted import ScriptedEngine

__all__ = [
    "ContextOverflowError",
    "Engine",
    "EngineError",
    "LocalEngine",
    "SGLangEngine",
    "ScriptedEngine",
    "VLLMEngine",
    "sample_token",
    "sampling_logprobs",
    "token_logprobs",
]
