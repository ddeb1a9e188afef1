"""An engine that replays scripted assistant texts: for tests, demos and teacher data.

The text is tokenized with the (byte-level) tokenizer and, unless it ends on a stop id already (a
gpt-oss tool call written with its closing ``<|call|>``), the chat format's first stop id appended
(its end-of-turn token: ``<|im_end|>`` for the built-in tokenizer, ``<|eot_id|>`` for Llama 3;
``<|return|>`` for gpt-oss, whose ``<|end|>`` only closes a message), so the result looks exactly like
a sampled assistant turn. Scripts write tool calls in legorl's syntax (``<tool_call>`` JSON blocks, as the
scripted teacher does); for a policy whose family writes calls otherwise (``llama3_json``, ``mistral``,
``harmony``...), a script's reply with calls is written by the policy's own chat template instead
(`legorl.models.replies.reply_ids`), so a demonstration shows the syntax the policy samples and the proxy reads.
Results are marked ``sampled_from_policy=False``: usable for SFT, never for policy gradient.

Each rollout it serves plays its own script (`set_script`, given when the rollout's session is
opened: the scripted teacher's per-task demonstration), or else the engine's default `script`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from legorl.engine.base import EngineError, Weights, no_conversations
from legorl.models.chat_format import ChatFormat
from legorl.models.chat_format import chat_format as read_chat_format
from legorl.models.replies import args_value, reply_ids
from legorl.models.toolformats import PARSERS, ParsedReply
from legorl.models.toolformats.tagged import TaggedJsonParser
from legorl.records import GenerationResult, SamplingParams

ScriptFn = Callable[[int, list[int]], str]  # (call index within the rollout, prompt ids) -> text
Script = list[str] | ScriptFn
_LEGORL_SYNTAX = TaggedJsonParser()  # what scripts write calls in
_PROBE = [{"role": "user", "content": "Fix the bug."}]  # what a rewritten reply follows (its render ignores it)


def _probe_tools(parsed: ParsedReply) -> list[dict[str, Any]]:
    """A schema for each tool the reply calls (a template may look a call's tool up)."""
    tools = {}
    for c in parsed.calls:
        args = args_value(c.arguments)
        properties = {k: {"type": "string"} for k in (args if isinstance(args, dict) else {})}
        tools[c.name] = {"type": "function", "function": {"name": c.name, "parameters": {
            "type": "object", "properties": properties}}}
    return list(tools.values())


class ScriptedEngine:
    takes_messages = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_context: int = 1 << 20, *,
                 script: Script | None = None, chat_format: ChatFormat | None = None) -> None:
        """`script`: what every rollout without a script of its own plays (None: such a rollout's calls fail)."""
        self.tokenizer = tokenizer
        self._weight_version = 0
        self._max_context = max_context
        fmt = chat_format if chat_format is not None else read_chat_format(tokenizer)
        self._format = fmt
        # scripts write calls in legorl's <tool_call> syntax: rewritten for a family that writes them otherwise
        self._rewrite = PARSERS.get(fmt.tool_format) is not TaggedJsonParser
        self.stop_ids = frozenset(fmt.stop_ids)
        self._closer = fmt.stop_ids[0]  # what a sampled turn ends on: the end of turn, gpt-oss's <|return|>
        self._default = script
        self._scripts: dict[str, Script] = {}
        self._calls: dict[str, int] = {}

    def set_script(self, rollout_id: str, script: Script) -> None:
        """What `rollout_id`'s calls play, in order (a list) or computed per call (a function)."""
        self._scripts[rollout_id] = script if callable(script) else list(script)
        self._calls[rollout_id] = 0

    def calls(self, rollout_id: str) -> int:
        return self._calls.get(rollout_id, 0)

    # ---- the Engine protocol ----

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def weights(self) -> Weights:
        return Weights(self._weight_version)

    def follow(self, weights: Weights) -> None:
        """A Ray worker's scripted engine stamps the driver's version (there are no weights to load)."""
        self._weight_version = weights.version

    def max_context(self) -> int:
        return self._max_context

    def stats(self) -> dict[str, Any]:
        return {}  # no counters: a replay has no throughput worth a metric

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, rollout_id: str = ""
    ) -> GenerationResult:
        script = self._scripts.get(rollout_id)
        if script is None:
            if self._default is None:
                raise EngineError(f"no script for rollout {rollout_id!r}: set_script before its session's calls")
            self.set_script(rollout_id, self._default)
            script = self._scripts[rollout_id]
        i = self._calls[rollout_id]
        if callable(script):
            text = script(i, list(prompt_ids))
        elif i < len(script):
            text = script[i]
        else:
            raise EngineError(f"script exhausted for rollout {rollout_id} after {len(script)} calls")
        self._calls[rollout_id] = i + 1
        ids = self._ids(text)
        return GenerationResult(
            completion_ids=ids,
            logprobs=[0.0] * len(ids),
            finish_reason="stop",
            weight_version=self._weight_version,
            sampled_from_policy=False,
        )

    def _ids(self, text: str) -> list[int]:
        """The ids a sampled turn of `text` has: in the policy's own call syntax, closed by a stop id."""
        if self._rewrite:
            parsed = _LEGORL_SYNTAX.parse(text)
            if parsed.calls and parsed.malformed is None:
                reply = {"role": "assistant", "content": parsed.content, "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in parsed.calls]}
                return reply_ids(self.tokenizer, self._format, _PROBE, _probe_tools(parsed), reply)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids or ids[-1] not in self.stop_ids:
            ids.append(self._closer)
        return ids

    async def generate_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            params: SamplingParams, *, rollout_id: str = "") -> GenerationResult:
        raise no_conversations(self)

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None, *,
                             in_flight: bool = False) -> int:
        """No weights: the version moves as the policy's would, so stamps look like a real run's."""
        self._weight_version = version if version is not None else self._weight_version + 1
        return self._weight_version

    async def close(self) -> None:
        self._scripts.clear()
