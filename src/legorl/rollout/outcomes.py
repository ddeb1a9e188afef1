"""How a rollout's outcome is decided, and what training does with each outcome.

One place answers "why is this rollout an engine_error?". Infrastructure
failures are never turned into reward 0: they are masked (they leave the loss
and the group baseline).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

from legorl.harness.base import HarnessResult
from legorl.records import GraderReport, LLMCall, Outcome

Policy = Literal["train", "mask", "retry"]

DEFAULT_POLICIES: dict[Outcome, Policy] = {
    Outcome.RESOLVED: "train",
    Outcome.UNRESOLVED: "train",
    Outcome.MAX_TURNS: "train",  # the agent ran out of turns: its diff is graded like any other
    Outcome.AGENT_TIMEOUT: "mask",
    Outcome.AGENT_CRASH: "mask",
    Outcome.NO_MODEL_CALLS: "mask",
    Outcome.CONTEXT_OVERFLOW: "mask",
    Outcome.INVALID_CAPTURE: "mask",
    # Infrastructure failures say nothing about the policy: run the rollout again (bounded), then mask.
    Outcome.SANDBOX_ERROR: "retry",
    Outcome.ENGINE_ERROR: "retry",
    Outcome.GRADER_ERROR: "retry",
}


def resolve_policies(overrides: dict[str, str] | None = None) -> dict[Outcome, Policy]:
    """The default policies with the config's `rollout.policies` applied."""
    policies = dict(DEFAULT_POLICIES)
    for name, policy in (overrides or {}).items():
        policies[Outcome(name)] = policy  # type: ignore[assignment]
    return policies


@dataclass
class EpisodeFacts:
    """Everything observed about one episode, before grading decides the rest."""

    harness: HarnessResult | None
    crashed: str = ""  # why the harness process died, if it did
    timed_out: bool = False
    sandbox_error: str = ""
    proxy_errors: tuple[str, ...] = ()  # what the proxy saw go wrong in this session
    proxy_calls: int = 0  # calls the proxy answered for this session


def capture_problem(calls: list[LLMCall], proxy_calls: int, one_version: bool = True) -> str:
    """Why this rollout's capture cannot be trusted for training, or "" if it can.

    `one_version` (synchronous RL): every sampled token under one weight version. Asynchronous RL lets
    updates come mid-rollout (the staleness filter bounds how old its tokens are), but its versions can only
    advance: a token sampled under older weights than one before it means the stamps are wrong.
    """
    if len(calls) != proxy_calls:
        return f"{proxy_calls} calls answered but {len(calls)} recorded"
    by_index = {c.index: c for c in calls}
    if sorted(by_index) != list(range(len(calls))):
        return "call indices are not 0..n-1"
    sampled = [by_index[i] for i in sorted(by_index) if by_index[i].sampled_from_policy]
    versions = [v for c in sampled for v in c.versions()]
    if one_version and len(set(versions)) > 1:
        return f"calls span weight versions {sorted(set(versions))}"
    if any(b < a for a, b in itertools.pairwise(versions)):
        return f"weight versions go back within the rollout ({versions[0]} .. {versions[-1]}, not in order)"
    for c in calls:
        if not c.completion_ids or len(c.completion_ids) != len(c.completion_logprobs):
            return f"call {c.index}: {len(c.completion_ids)} ids vs {len(c.completion_logprobs)} logprobs"
        if c.parent_index is not None:
            p = by_index.get(c.parent_index)
            head = None if p is None else p.prompt_ids + p.completion_ids
            if head is None or c.prompt_ids[: len(head)] != head:
                return f"call {c.index}: prompt does not extend its parent call {c.parent_index}"
    return ""


def decide(facts: EpisodeFacts, calls: list[LLMCall], report: GraderReport | None,
           require_submit: bool = True, one_version: bool = True) -> tuple[Outcome, str]:
    """The outcome of an episode and the reason, in order of what dominates.

    With ``require_submit`` only a submitted episode can be resolved: one that ran out of turns or
    stopped on format errors delivered no patch (mini-swe-agent's SWE-bench prediction is then
    empty), even if its workspace diff happens to pass. Crediting such episodes rewards whatever
    the agent did after its fix, and RL then learns to stop submitting.
    """
    if facts.sandbox_error:
        return Outcome.SANDBOX_ERROR, facts.sandbox_error
    if facts.timed_out:
        return Outcome.AGENT_TIMEOUT, "the agent did not finish within rollout.agent_timeout"
    if "engine_error" in facts.proxy_errors:
        return Outcome.ENGINE_ERROR, "the engine failed on a call of this rollout"
    if "context_overflow" in facts.proxy_errors:
        return Outcome.CONTEXT_OVERFLOW, "a prompt exceeded the model's context length"
    if facts.crashed:
        return Outcome.AGENT_CRASH, facts.crashed
    h = facts.harness
    if h is None:
        return Outcome.AGENT_CRASH, "no result from the harness"
    if facts.proxy_calls == 0:
        return Outcome.NO_MODEL_CALLS, f"the harness exited ({h.exit_status or 'no status'}) without a model call"
    problem = capture_problem(calls, facts.proxy_calls, one_version)
    if problem:
        return Outcome.INVALID_CAPTURE, problem
    if "max_turns" in facts.proxy_errors:  # the proxy enforced the turn limit (a harness without one)
        h = HarnessResult(exit_status="LimitsExceeded", n_calls=h.n_calls, error=h.error)
    ended = h.exit_status in ("Submitted", "LimitsExceeded", "RepeatedFormatError", "FormatError")
    if not ended and max(calls, key=lambda c: c.index).finish_reason == "length":
        # Claude Code and Codex end their run with an error on a reply cut at max_tokens. The policy
        # wrote past the cap: a failure of the policy (trained as one), not of the harness.
        return Outcome.UNRESOLVED, (f"the harness stopped on a reply cut at sampling.max_tokens "
                                    f"({h.exit_status}: {h.error[:300]})")
    if not ended:
        return Outcome.AGENT_CRASH, h.error or f"harness ended with {h.exit_status or 'no status'}"
    if report is None or report.outcome == Outcome.GRADER_ERROR:
        return Outcome.GRADER_ERROR, report.reason if report else "not graded"
    if report.resolved and (h.exit_status == "Submitted" or not require_submit):
        return Outcome.RESOLVED, "every FAIL_TO_PASS and PASS_TO_PASS test passed"
    reason = report.reason or "hidden tests failed"
    if report.resolved:
        reason = f"not submitted ({h.exit_status}), although its workspace diff passes the hidden tests"
    if h.exit_status == "LimitsExceeded":
        return Outcome.MAX_TURNS, "step limit reached; " + reason
    return Outcome.UNRESOLVED, reason


def reward_for(outcome: Outcome, policies: dict[Outcome, Policy] | None = None) -> float | None:
    """1/0 for trained outcomes, None (masked) for the rest; a retry that ran out is masked too."""
    policy = (policies or DEFAULT_POLICIES)[outcome]
    if policy != "train":
        return None
    return 1.0 if outcome == Outcome.RESOLVED else 0.0
