"""The core records every part of legorl shares (see docs/design.md, "Core records").

They are plain dataclasses: cheap to build in hot paths, easy to serialise into
the SQLite store. Nothing here imports torch or any backend.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class Outcome(str, enum.Enum):
    """How a rollout ended. Exactly one per rollout."""

    RESOLVED = "resolved"
    UNRESOLVED = "unresolved"
    AGENT_TIMEOUT = "agent_timeout"
    AGENT_CRASH = "agent_crash"
    NO_MODEL_CALLS = "no_model_calls"
    CONTEXT_OVERFLOW = "context_overflow"
    MAX_TURNS = "max_turns"
    SANDBOX_ERROR = "sandbox_error"
    ENGINE_ERROR = "engine_error"
    GRADER_ERROR = "grader_error"
    INVALID_CAPTURE = "invalid_capture"


# Outcomes whose reward is meaningful for the policy (the agent did the thing).
GRADED_OUTCOMES = frozenset({Outcome.RESOLVED, Outcome.UNRESOLVED, Outcome.MAX_TURNS})

# `LLMCall.finish_reason` of a call whose client went away before its answer (docs/proxy.md): the
# generation was cancelled, no completion tokens are kept, and it is never trained on.
ABANDONED = "abandoned"
# `LLMCall.segment_break` of a call whose rendered prompt no longer holds the reasoning its parent sampled (the
# template leaves past reasoning out, or the harness did not send it back): a new segment (docs/proxy.md, "Reasoning").
REASONING_DROPPED = "template drops past reasoning"
# The session of a rollout's own agent turns. A harness's side calls (a title, a next-speaker or loop check, a
# memory agent, a sub-agent) are recorded in sessions of their own, named by the harness (Harness.call_kind).
MAIN_SESSION = "main"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off; applied before top_p (see engine/sampling.py)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class GenerationResult:
    """What an engine returns for one prompt. Token fidelity starts here."""

    completion_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token under the sampled distribution
    finish_reason: str  # "stop" | "length"
    weight_version: int
    # True when the tokens were sampled from the policy (False for upstream/teacher text
    # that was tokenized afterwards: usable for SFT, never for policy gradient).
    sampled_from_policy: bool = True
    routed_experts: list[list[list[int]]] | None = None  # [tokens][layers][top_k]
    # Asynchronous RL: the weight version each completion token was sampled under, when a weight update
    # reached the engine mid-generation (None: every token under `weight_version`, the first token's).
    token_versions: list[int] | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the wire formats carry it


@dataclass
class LLMCall:
    """One model call made by a harness through the proxy, recorded token-exactly."""

    rollout_id: str
    index: int  # order within the rollout (session)
    wire_format: str  # "openai_chat" | "openai_responses" | "anthropic_messages"
    request: dict[str, Any]  # the request body as received
    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | ABANDONED (no completion: the client went away)
    weight_version: int
    completion_text: str  # decode(completion_ids): the text the answer was made from
    tool_calls: list[ToolCall] = field(default_factory=list)
    parent_index: int | None = None  # the call whose prompt+completion this prompt extends
    segment_break: str | None = None  # why this call could not extend its predecessor
    naive_prompt_differs: bool = False  # re-rendering would have drifted from the bridged ids
    sampled_from_policy: bool = True
    routed_experts: list[list[list[int]]] | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    session: str = MAIN_SESSION  # MAIN_SESSION, or the side session this call belongs to ("title", ...)
    malformed_tool_call: str | None = None  # why an attempted tool call did not parse (it was answered as text)
    token_versions: list[int] | None = None  # per completion token, when an update came mid-call (GenerationResult)

    def versions(self) -> list[int]:
        """The weight version of each completion token."""
        return self.token_versions if self.token_versions is not None else [self.weight_version] * len(
            self.completion_ids)


@dataclass
class GraderReport:
    resolved: bool
    outcome: Outcome  # resolved | unresolved | grader_error
    reason: str = ""
    tests: dict[str, str] = field(default_factory=dict)  # test id -> passed|failed|error|skipped|missing
    applied_paths: list[str] = field(default_factory=list)
    dropped_paths: list[str] = field(default_factory=list)
    applied_diff: str = ""  # the parts of the agent's diff that were applied
    dropped_diff: str = ""  # the parts the path policy dropped (tests, test infrastructure)
    collected: int = 0
    exit_code: int | None = None
    log_tail: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d["outcome"] = self.outcome.value
        return d


@dataclass
class Rollout:
    id: str
    step: int
    task_id: str
    group_id: str
    sample_index: int
    harness: str
    outcome: Outcome | None = None
    outcome_reason: str = ""
    reward: float | None = None
    diff: str = ""
    report: GraderReport | None = None
    weight_version_start: int = 0
    weight_version_end: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    calls: list[LLMCall] = field(default_factory=list)  # the main session's: the agent's own turns
    split: str = "train"
    # Calls of its side sessions (titles, checks, sub-agents): recorded and shown, trained only with
    # rollout.train_side_calls; they share the rollout's call indices.
    side_calls: list[LLMCall] = field(default_factory=list)


@dataclass
class TrainingSequence:
    """One token-exact training sample: a merged chain of calls of one rollout."""

    rollout_id: str
    token_ids: list[int]
    loss_mask: list[int]  # 1 on sampled completion tokens only
    rollout_logprobs: list[float]  # sampler logprobs aligned to token_ids (0.0 where mask is 0)
    advantage: float
    n_sequences_in_rollout: int = 1  # for per-rollout normalisation
    routed_experts: list[list[list[int]]] | None = None
