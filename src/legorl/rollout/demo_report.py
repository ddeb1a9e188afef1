"""What the teacher's demonstrations came to, in words: how many resolved, why the others did not, and the
one mistake that fails them all without saying so (a teacher calling a tool the agent does not declare).

A teacher plays its demonstrations through the harness's shell tool (`Harness.teacher_style`); for
`harness.name: command` the user names that tool (`harness.shell_tool`, `harness.shell_arg`). Named wrong,
every demonstration fails quietly: the agent answers the unknown call with an error, the teacher's script
goes on and ends, and each rollout is an empty patch. The requests the agent sent say which tools it has
(read back with the proxy's parser for their wire format, as the dashboard reads them).
"""

from __future__ import annotations

import json
from collections import Counter

from legorl.proxy.formats import FORMATS
from legorl.records import LLMCall, Outcome, Rollout

REASON_CHARS = 160  # of each failure reason quoted
MISMATCHES_SHOWN = 3  # an upstream model may call many wrong things: the first few say enough


def declared_tools(call: LLMCall) -> dict[str, set[str]]:
    """The tools a call's request offered the model, each with its parameter names, read by the proxy's own
    parser for the call's wire format."""
    fmt = FORMATS.get(call.wire_format)
    offered = fmt.offered_tools(call.request) if fmt is not None else []
    return {t["function"]["name"]: set(t["function"]["parameters"].get("properties") or ()) for t in offered}


def undeclared_calls(demos: list[Rollout]) -> list[str]:
    """Each distinct tool call (or argument) of a teacher that the agent's own request did not declare."""
    problems: dict[str, None] = {}  # ordered, distinct
    for call in (c for r in demos for c in r.calls):
        declared = declared_tools(call)
        if not declared:  # a request without tools: nothing to check against
            continue
        names = ", ".join(sorted(declared))
        for tc in call.tool_calls:
            if tc.name not in declared:
                problems[f"the teacher called the tool `{tc.name}`, which the agent does not declare "
                         f"(its tools: {names})"] = None
                continue
            try:
                args = json.loads(tc.arguments)
            except ValueError:
                continue
            params = declared[tc.name]
            for key in args if isinstance(args, dict) and params else ():
                if key not in params:
                    problems[f"the teacher called `{tc.name}` with the argument `{key}`, which that tool does not "
                             f"declare (its arguments: {', '.join(sorted(params))})"] = None
    return list(problems)


def demo_report(demos: list[Rollout], scripted: bool = True) -> str:
    """One paragraph: resolved of total, the commonest reasons for the rest, and the first undeclared teacher calls
    (`scripted`: the teacher is the scripted one, whose tool the config names, so the fix is the config's)."""
    resolved = sum(r.outcome == Outcome.RESOLVED for r in demos)
    text = f"teacher demonstrations: {resolved} of {len(demos)} resolved"
    failed = Counter(f"{r.outcome.value if r.outcome else 'no outcome'}: {r.outcome_reason[:REASON_CHARS]}"
                     for r in demos if r.outcome != Outcome.RESOLVED)
    if failed:
        text += "; not resolved: " + "; ".join(f"{n} x {why}" for why, n in failed.most_common(3))
    mismatches = undeclared_calls(demos)
    if mismatches:
        text += ". " + "; ".join(mismatches[:MISMATCHES_SHOWN])
        if len(mismatches) > MISMATCHES_SHOWN:
            text += f" (and {len(mismatches) - MISMATCHES_SHOWN} more)"
        if scripted:
            text += (". The teacher plays the harness's own shell tool: for harness.name: command, set "
                     "harness.shell_tool and harness.shell_arg to the agent's (docs/harnesses/command.md)")
    return text
