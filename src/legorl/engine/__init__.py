"""Engines: prompt token ids in, sampled completion ids + logprobs out (see base.Engine)."""

from legorl.engine.base import ContextOverflowError, Engine, EngineError
from legorl.engine.local import LocalEngine
from legorl.engine.sampling import sample_token, sampling_logprobs, token_logprobs
from legorl.engine.scripted import ScriptedEngine

__all__ = [
    "ContextOverflowError",
    "Engine",
    "EngineError",
    "LocalEngine",
    "ScriptedEngine",
    "sample_token",
    "sampling_logprobs",
    "token_logprobs",
]
