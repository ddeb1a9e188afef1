"""The Engine protocol: prompt token ids (or, for a hosted teacher, the conversation) in, sampled
token ids + logprobs out.

Every proxy session is opened with the engine that serves it (`Proxy.open_session(rid, engine)`):
the policy, a frozen evaluation checkpoint, the scripted teacher, the upstream teacher, or the
fault-injecting wrapper around any of them. `Engine` is the whole surface its users call, so
nobody probes an engine for what it can do: an engine without an ability implements the member
with a clear error or a documented no-op. Every result is stamped with the weight version it was
generated under, and that version is the engine's own: only `update_weights` (and, for clients
of weights loaded by another process, `follow`) changes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from legorl.records import GenerationResult, SamplingParams


class EngineError(Exception):
    """The engine could not serve a request (bad input, closed engine, backend failure)."""


class ContextOverflowError(EngineError):
    """The prompt leaves no room for even one completion token."""


@dataclass(frozen=True)
class Weights:
    """The weights an engine serves, as its clients in other processes (Ray workers) follow them."""

    version: int
    stale_urls: tuple[str, ...] = ()  # remote servers that failed the latest reload: kept out of rotation


@runtime_checkable
class Engine(Protocol):
    """What every engine implements, and who calls it (callers never probe for more).

    | member | called by |
    |---|---|
    | `takes_messages` | the proxy (`CallCore`): True -> `generate_chat` with the conversation, else `generate` |
    | `weight_version` | the episode (the rollout's version range), the Ray driver; stamped on every result |
    | `max_context()` | the proxy: refuses prompts that cannot fit, reports it on `/v1/models` |
    | `generate(...)` | the proxy, for token-id engines (all but the upstream teacher) |
    | `generate_chat(...)` | the proxy, for `takes_messages` engines (the upstream teacher) |
    | `stats()` | the driver: engine metrics per step (`{}` for engines that keep no counters) |
    | `update_weights(...)` | the driver after each SFT / RL update and on resume |
    | `weights()`, `follow(...)` | the Ray driver and its workers: workers' clients follow the driver's updates |
    | `close()` | whoever built the engine |
    """

    # A class constant: True for an engine that answers conversations (a hosted model), not token ids.
    takes_messages: bool

    @property
    def weight_version(self) -> int:
        """The version of the weights served now (0 until the first update); read-only."""
        ...

    def max_context(self) -> int:
        """Prompt + completion tokens one request may hold."""
        ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, rollout_id: str = ""
    ) -> GenerationResult:
        """Sample a completion. Raises ContextOverflowError when len(prompt_ids) + 1 > max_context();
        when prompt + max_tokens does not fit, max_tokens is capped and the result ends with "length".
        A `takes_messages` engine raises EngineError."""
        ...

    async def generate_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, params: SamplingParams, *,
        rollout_id: str = "",
    ) -> GenerationResult:
        """Answer a conversation (OpenAI chat messages and tools). Token-id engines raise EngineError."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters since start (docs/engines.md); `{}` where the engine keeps none."""
        ...

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None, *,
                             in_flight: bool = False) -> int:
        """Load new weights between requests (a request never spans two versions) and return the new
        weight_version: `version` where given (resume keeps the run's stamps continuous), else the current
        one + 1. Engines whose weights are not ours (teachers) change nothing and return the current one.

        `in_flight` (asynchronous RL, `rollout.mode: async`): generations in progress are not drained; they
        continue under the new weights, and a result that spans the update says which version sampled each
        token (`GenerationResult.token_versions`), every token with its exact behaviour logprob."""
        ...

    def weights(self) -> Weights:
        """The weights served now, for clients in other processes to `follow`."""
        ...

    def follow(self, weights: Weights) -> None:
        """Serve `weights`, loaded by another process (a Ray worker's client after the driver's update): stamp
        their version from now on and keep their stale servers out of rotation. Raises EngineError for an
        engine that loads its own weights (the embedded one)."""
        ...

    async def close(self) -> None:
        """Release what the engine holds (threads, connections)."""
        ...


def no_conversations(engine: object) -> EngineError:
    """The error a token-id engine's `generate_chat` raises (the proxy calls it only where `takes_messages`)."""
    return EngineError(f"{type(engine).__name__} takes token ids, not conversations: call generate")


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
