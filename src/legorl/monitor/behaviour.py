"""Behaviour analytics: what agents do, computed from captured calls, for any harness.

Per rollout: turns, tool calls per turn, text-only turns, format errors, whether
the agent submitted, command mix (read / search / edit / test / submit / other)
and verification after edit (a file read or test run that touches a file after
the agent edited it). Per step: the same, aggregated, as `behaviour/*` metrics
that the training loop can log next to its other step metrics.

    metrics = step_metrics(rollouts)          # rollouts with their .calls loaded
    metrics["behaviour/verify_after_edit_rate"]
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from legorl.harness.mini_swe_agent import TEXT_ACTION_REGEX
from legorl.monitor.commands import KINDS, Action, Classified, classify_tool_call, same_file
from legorl.monitor.messages import Message, conversation_items, declares_tools, new_messages
from legorl.proxy.reasoning import prompt_opens_reasoning, split_reasoning
from legorl.records import ABANDONED, LLMCall, Rollout, ToolCall

# What harnesses say back when a turn was malformed (mini-swe-agent, SWE-agent, OpenHands, Codex, ...).
FORMAT_ERROR_FEEDBACK = re.compile(
    r"format error|tool call error|no tool calls? (?:were |was )?found|must include (?:at least|exactly) one tool"
    r"|exactly one (?:bash )?(?:tool call|action|code block)|reached the output token limit"
    r"|invalid (?:tool|function) call|unknown tool|could not parse (?:your|the) (?:tool|action|response)"
    r"|malformed (?:tool|function) call|error parsing tool call|missing '\w+' argument",
    re.IGNORECASE,
)
# Harnesses that demand a tool call on every turn: a text-only turn there is a format error, not an answer.
# (Not the OpenHands SDK: a reply without a tool call finishes its conversation, as Claude Code's does.)
# mini-swe-agent is matched by prefix ("mini", "mini-swe-agent", "mini-swe-agent/text").
TOOL_REQUIRED_HARNESSES = ("swe-agent", "sweagent")


def tool_required(harness: str) -> bool:
    h = harness.lower()
    return h.startswith("mini") or h in TOOL_REQUIRED_HARNESSES


@dataclass
class Turn:
    """One assistant turn: what the model emitted, and what the harness said back afterwards."""

    tool_calls: list[ToolCall]
    text: str = ""
    finish_reason: str = "stop"
    feedback: list[Message] = field(default_factory=list)  # tool results and notes that followed this turn


@dataclass
class RolloutBehaviour:
    turns: int = 0
    tool_calls: int = 0
    text_only_turns: int = 0
    format_errors: int = 0
    truncated_turns: int = 0
    submitted: bool = False
    edits: int = 0
    verified_edits: int = 0
    mix: Counter[str] = field(default_factory=Counter)


def text_actions(text: str) -> list[ToolCall]:
    """The commands of a text-mode answer (mini-swe-agent's ```bash blocks), as `bash` tool calls."""
    return [ToolCall(id=f"text-{i}", name="bash", arguments=json.dumps({"command": m.strip()}))
            for i, m in enumerate(re.findall(TEXT_ACTION_REGEX, text, re.DOTALL))]


def turns_from_calls(calls: list[LLMCall]) -> list[Turn]:
    """The agent's turns in call order, each with the harness's reply read from the next request.

    Calls without tools in a rollout whose other calls declare tools (e.g. Claude Code's title or
    summary requests) are side requests, not agent turns, and are left out; so are abandoned calls
    (the client went away before the answer: no turn happened, a retry is the turn). In a rollout that
    declares no tool at all (mini-swe-agent's text mode) a turn's actions are its ```bash blocks.
    """
    calls = sorted((c for c in calls if c.finish_reason != ABANDONED), key=lambda c: c.index)
    convs = [conversation_items(c.request, c.wire_format) for c in calls]
    any_tools = any(declares_tools(c.request) for c in calls)
    keep = [i for i, c in enumerate(calls) if not any_tools or declares_tools(c.request) or c.tool_calls]
    turns = []
    for pos, i in enumerate(keep):
        c = calls[i]
        nxt = keep[pos + 1] if pos + 1 < len(keep) else None
        feedback = new_messages(convs[i], convs[nxt], calls[nxt].wire_format) if nxt is not None else []
        actions = list(c.tool_calls) if any_tools else text_actions(c.completion_text)
        turns.append(Turn(tool_calls=actions, text=c.completion_text, finish_reason=c.finish_reason,
                          feedback=feedback))
    return turns


def _verifies(action: Action, edit: Action) -> bool:
    if action.kind in ("edit", "submit"):
        return False
    if action.all_files or action.kind == "test":
        return True
    if not edit.paths:  # an edit whose file we could not name: any later read checks it
        return action.kind == "read"
    return any(same_file(p, q) for p in edit.paths for q in action.paths)


def analyse_turns(turns: list[Turn], require_tool: bool) -> RolloutBehaviour:
    """Behaviour of one rollout from its turns."""
    b = RolloutBehaviour(turns=len(turns))
    pending: list[Action] = []  # edits not yet verified
    for t in turns:
        classified: list[Classified] = [classify_tool_call(tc.name, tc.arguments) for tc in t.tool_calls]
        b.tool_calls += len(classified)
        text_only = not classified
        b.text_only_turns += text_only
        b.truncated_turns += t.finish_reason == "length"
        said = "\n".join(m.text for m in t.feedback if m.role != "tool" or m.is_error)
        malformed = any(not c.valid for c in classified) or (require_tool and text_only) or \
            bool(FORMAT_ERROR_FEEDBACK.search(said))
        b.format_errors += malformed
        for c in classified:
            b.mix[c.kind] += 1
            for a in c.actions:
                if a.kind == "submit":
                    b.submitted = True
                elif a.kind == "edit":
                    b.edits += 1
                    pending.append(a)
                else:
                    done = [e for e in pending if _verifies(a, e)]
                    b.verified_edits += len(done)
                    pending = [e for e in pending if e not in done]
    if not require_tool and turns:  # Claude Code, Codex...: the agent ends by answering in plain text
        last = turns[-1]
        b.submitted = b.submitted or (not last.tool_calls and last.finish_reason != "length" and bool(last.text.strip()))
    return b


def analyse_calls(calls: list[LLMCall], harness: str) -> RolloutBehaviour:
    return analyse_turns(turns_from_calls(calls), tool_required(harness))


def analyse_rollout(rollout: Rollout) -> RolloutBehaviour:
    return analyse_calls(rollout.calls, rollout.harness)


def aggregate(behaviours: Iterable[RolloutBehaviour], prefix: str = "behaviour/") -> dict[str, float]:
    """Step-level metrics over rollouts: rates are ratios of sums (turn- or call-weighted)."""
    bs = list(behaviours)
    if not bs:
        return {}
    turns = sum(b.turns for b in bs)
    calls = sum(b.tool_calls for b in bs)
    edits = sum(b.edits for b in bs)
    mix: Counter[str] = Counter()
    for b in bs:
        mix.update(b.mix)
    m = {
        "rollouts": float(len(bs)),
        "turns_per_rollout": turns / len(bs),
        "tool_calls_per_turn": calls / turns if turns else 0.0,
        "text_only_turn_rate": sum(b.text_only_turns for b in bs) / turns if turns else 0.0,
        "format_error_rate": sum(b.format_errors for b in bs) / turns if turns else 0.0,
        "truncated_turn_rate": sum(b.truncated_turns for b in bs) / turns if turns else 0.0,
        "submit_rate": sum(b.submitted for b in bs) / len(bs),
        "edit_rollout_rate": sum(b.edits > 0 for b in bs) / len(bs),
        "edits_per_rollout": edits / len(bs),
    }
    if edits:
        m["verify_after_edit_rate"] = sum(b.verified_edits for b in bs) / edits
    for k in KINDS:
        m[f"mix/{k}"] = mix[k] / calls if calls else 0.0
    return {prefix + k: float(v) for k, v in m.items()}


def step_metrics(rollouts: Iterable[Rollout]) -> dict[str, float]:
    """`behaviour/*` metrics of a step's rollouts (their .calls must be loaded)."""
    return aggregate(analyse_rollout(r) for r in rollouts if r.calls)


PROMPT_TAIL = 8  # tokens: enough to hold a generation prompt's open marker and its newline


def output_shares(rollouts: Iterable[Rollout], reasoning: tuple[str, str] | None,
                  decode: Callable[[list[int]], str] | None = None) -> dict[str, float]:
    """Of the agent's own sampled output (main session): `reasoning_share`, the share of its characters inside
    reasoning blocks (`reasoning`: the chat format's markers; None: the model has none, share 0), and
    `tool_call_share`, the share of its calls that made a tool call. Behaviour shifts show here first: reasoning
    can double while the solve rate barely moves.

    `decode` (the tokenizer's) reads each prompt's last tokens: a generation prompt that writes the open marker
    (Qwen3-Thinking's, DeepSeek-R1's) starts the reply inside the reasoning, as the proxy splits it."""
    text = thought = calls = with_tools = 0
    for r in rollouts:
        for c in r.calls:
            if c.finish_reason == ABANDONED:
                continue
            calls += 1
            with_tools += bool(c.tool_calls)
            text += len(c.completion_text)
            tail = decode(c.prompt_ids[-PROMPT_TAIL:]) if decode and reasoning else ""
            split = split_reasoning(c.completion_text, reasoning, prompt_opens_reasoning(tail, reasoning))
            thought += len(split.reasoning or "")
    return {"reasoning_share": thought / text if text else 0.0, "tool_call_share": with_tools / calls if calls else 0.0}
