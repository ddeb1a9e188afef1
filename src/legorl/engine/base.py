"""The Engine protocol: prompt token ids in, sampled token ids + logprobs out.

Engines never see text or messages: the proxy renders prompts and owns the token bridge.
Every result is stamped with the weight version it was generated under.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from legorl.records import GenerationResult, SamplingParams


class EngineError(Exception):
    """The engine could not serve a request (bad input, closed engine, backend failure)."""


class ContextOverflowError(EngineError):
    """The prompt leaves no room for even one completion token."""


@runtime_checkable
class Engine(Protocol):
    weight_version: int

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, rollout_id: str = ""
    ) -> GenerationResult:
        """Sample a completion. Raises ContextOverflowError when len(prompt_ids) + 1 > max_context();
        when prompt + max_tokens does not fit, max_tokens is capped and the result ends with "length"."""
        ...

    def max_context(self) -> int: ...

    async def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Load new weights between requests/steps; returns the new weight_version."""
        ...

    async def close(self) -> None: ...


def check_prompt(prompt_ids: list[int], vocab_size: int, max_context: int) -> None:
    """Validate prompt ids up front so bad input fails one request, not the engine."""
    if not prompt_ids:
        raise EngineError("empty prompt: an engine needs at least one prompt token")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise EngineError(f"prompt has {len(bad)} token ids outside [0, {vocab_size}), e.g. {bad[:3]}")
    if len(prompt_ids) + 1 > max_context:
        raise ContextOverflowError(
            f"prompt of {len(prompt_ids)} tokens leaves no room in a context of {max_context} tokens"
        )
