"""An engine that replays scripted assistant texts: for tests, demos and teacher data.

The text is tokenized with the (byte-level) tokenizer and the chat format's end-of-turn token
appended (``<|im_end|>`` for the built-in tokenizer, ``<|eot_id|>`` for Llama 3), so
``decode(ids[:-1]) == text`` and the result looks exactly like a sampled assistant turn.
Results are marked ``sampled_from_policy=False``: usable for SFT, never for policy gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedTokenizerBase

from legorl.engine.base import EngineError
from legorl.models.chat_format import ChatFormat
from legorl.models.chat_format import chat_format as read_chat_format
from legorl.records import GenerationResult, SamplingParams

ScriptFn = Callable[[int, list[int]], str]  # (call index within the rollout, prompt ids) -> text


class ScriptedEngine:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_context: int = 1 << 20, *,
                 chat_format: ChatFormat | None = None) -> None:
        self.tokenizer = tokenizer
        self.weight_version = 0
        self._max_context = max_context
        fmt = chat_format if chat_format is not None else read_chat_format(tokenizer)
        self.end_of_turn_id = fmt.end_of_turn_id
        self._scripts: dict[str, list[str] | ScriptFn] = {}
        self._calls: dict[str, int] = {}

    def set_script(self, rollout_id: str, script: list[str] | ScriptFn) -> None:
        self._scripts[rollout_id] = script if callable(script) else list(script)
        self._calls[rollout_id] = 0

    def calls(self, rollout_id: str) -> int:
        return self._calls.get(rollout_id, 0)

    def max_context(self) -> int:
        return self._max_context

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, rollout_id: str = ""
    ) -> GenerationResult:
        script = self._scripts.get(rollout_id)
        if script is None:
            raise EngineError(f"no script set for rollout {rollout_id!r}; call set_script first")
        i = self._calls[rollout_id]
        if callable(script):
            text = script(i, list(prompt_ids))
        elif i < len(script):
            text = script[i]
        else:
            raise EngineError(f"script exhausted for rollout {rollout_id} after {len(script)} calls")
        self._calls[rollout_id] = i + 1
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.end_of_turn_id]
        return GenerationResult(
            completion_ids=ids,
            logprobs=[0.0] * len(ids),
            finish_reason="stop",
            weight_version=self.weight_version,
            sampled_from_policy=False,
        )

    async def update_weights(self, state_dict: dict[str, torch.Tensor]) -> int:
        self.weight_version += 1
        return self.weight_version

    async def close(self) -> None:
        self._scripts.clear()
