"""How an episode's outcome and reward are decided once the grader has spoken."""

from __future__ import annotations

import pytest

from legorl.harness.base import HarnessResult
from legorl.records import GraderReport, LLMCall, Outcome
from legorl.rollout.outcomes import EpisodeFacts, decide, reward_for

CALL = LLMCall(rollout_id="r", index=0, wire_format="openai_chat", request={}, prompt_ids=[1, 2],
               completion_ids=[3], completion_logprobs=[-0.1], finish_reason="stop", weight_version=0,
               completion_text="x")
PASSES = GraderReport(resolved=True, outcome=Outcome.RESOLVED)
FAILS = GraderReport(resolved=False, outcome=Outcome.UNRESOLVED, reason="1 FAIL_TO_PASS test failed")


def outcome_of(exit_status: str, report: GraderReport, require_submit: bool = True) -> tuple[Outcome, str]:
    facts = EpisodeFacts(harness=HarnessResult(exit_status=exit_status, n_calls=1), proxy_calls=1)
    return decide(facts, [CALL], report, require_submit)


@pytest.mark.parametrize(("exit_status", "report", "expected"), [
    ("Submitted", PASSES, Outcome.RESOLVED),
    ("Submitted", FAILS, Outcome.UNRESOLVED),
    # No submission, no patch: a passing workspace diff is not credited (mini-swe-agent's SWE-bench
    # prediction would be empty), else RL rewards whatever the agent did after its fix.
    ("LimitsExceeded", PASSES, Outcome.MAX_TURNS),
    ("LimitsExceeded", FAILS, Outcome.MAX_TURNS),
    ("RepeatedFormatError", PASSES, Outcome.UNRESOLVED),
    ("FormatError", FAILS, Outcome.UNRESOLVED),
])
def test_only_a_submitted_episode_is_resolved(exit_status, report, expected):
    outcome, reason = outcome_of(exit_status, report)
    assert outcome == expected, reason
    assert reward_for(outcome) == (1.0 if expected == Outcome.RESOLVED else 0.0)
    if report.resolved and expected != Outcome.RESOLVED:
        assert "not submitted" in reason and exit_status in reason


@pytest.mark.parametrize("exit_status", ["LimitsExceeded", "RepeatedFormatError"])
def test_require_submit_off_grades_the_diff_however_the_episode_ended(exit_status):
    assert outcome_of(exit_status, PASSES, require_submit=False)[0] == Outcome.RESOLVED
    assert outcome_of(exit_status, FAILS, require_submit=False)[0] != Outcome.RESOLVED


def test_infrastructure_failures_dominate_a_passing_diff():
    facts = EpisodeFacts(harness=HarnessResult(exit_status="Submitted", n_calls=1), proxy_calls=1, timed_out=True)
    assert decide(facts, [CALL], PASSES)[0] == Outcome.AGENT_TIMEOUT
    assert reward_for(Outcome.AGENT_TIMEOUT) is None
