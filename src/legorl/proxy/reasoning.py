"""Reasoning: the part of a sampled reply a reasoning model writes between its markers (`ChatFormat.reasoning`).

The answer's text is split into reasoning and the rest before tool calls are parsed; each wire format returns
the reasoning in its own field (Chat `reasoning_content`, a Responses `reasoning` item, an Anthropic `thinking`
block, a Gemini `thought` part). Splitting only shapes the answer: what is recorded and trained is always the
sampled ids (`LLMCall.completion_ids`), reasoning included.
"""

from __future__ import annotations

from dataclasses import dataclass

from legorl.records import REASONING_DROPPED

__all__ = ["REASONING_DROPPED", "Split", "prompt_opens_reasoning", "split_reasoning"]


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # the reasoning text, markers and surrounding newlines removed; None: none (or empty)
    rest: str  # the text after it: content and tool calls


def split_reasoning(text: str, markers: tuple[str, str] | None, opened: bool = False) -> Split:
    """Split `text` at its reasoning block. `opened`: the prompt already wrote the open marker (DeepSeek-R1's and
    Qwen3-Thinking's generation prompt ends with ``<think>``), so the reply starts inside the reasoning.

    A block cut short (no close marker, e.g. by max_tokens) is all reasoning. Text without markers is unchanged.
    """
    if markers is None:
        return Split(None, text)
    start, end = markers
    head = text.lstrip()
    if head.startswith(start):
        opened, head = True, head[len(start):]
    elif not opened:
        return Split(None, text)
    reasoning, closed, rest = head.partition(end)
    return Split(reasoning.strip("\n") or None, rest.lstrip("\n") if closed else "")


def prompt_opens_reasoning(prompt_text: str, markers: tuple[str, str] | None) -> bool:
    """The rendered prompt ends inside an open reasoning block (its generation prompt wrote the open marker)."""
    return markers is not None and prompt_text.rstrip().endswith(markers[0])
