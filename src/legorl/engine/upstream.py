"""`engine: upstream`: any OpenAI-compatible chat endpoint as a teacher, for data collection.

The proxy hands this engine the conversation (not token ids: a hosted model takes messages).
Its answer becomes the ids the policy would sample for it: the policy's chat template writes the
reply after the conversation, in the policy family's own tool-call syntax, up to its stop id
(`legorl.models.replies.reply_ids`). The tokens were not sampled from the policy, so the result is
marked `sampled_from_policy=False`: usable for SFT, never for policy gradient (logprobs are 0.0).
"""

from __future__ import annotations

import os
from typing import Any

import httpx

from legorl.engine.base import EngineError, Weights
from legorl.models.chat_format import ChatFormat, ChatFormatError
from legorl.models.chat_format import chat_format as read_chat_format
from legorl.models.replies import reply_ids
from legorl.records import GenerationResult, SamplingParams


class UpstreamEngine:
    takes_messages = True  # the proxy calls generate_chat with the conversation

    def __init__(self, base_url: str, model: str, tokenizer: Any, *, api_key: str | None = None,
                 timeout_s: float = 600.0, client: httpx.AsyncClient | None = None,
                 chat_format: ChatFormat | None = None):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.tok = tokenizer
        self.format = chat_format if chat_format is not None else read_chat_format(tokenizer)
        key = api_key if api_key is not None else os.environ.get("LEGORL_UPSTREAM_API_KEY", "")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))

    # ---- the Engine protocol ----

    @property
    def weight_version(self) -> int:
        return 0  # a teacher's weights are not ours: they never change under us

    def weights(self) -> Weights:
        return Weights(0)

    def follow(self, weights: Weights) -> None:
        """Nothing to follow: the teacher's weights are not the policy's."""

    def max_context(self) -> int:
        return 1 << 20  # the upstream model enforces its own limit

    def stats(self) -> dict[str, Any]:
        return {}

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       rollout_id: str = "") -> GenerationResult:
        raise EngineError("the upstream engine answers conversations, not token ids: use it behind the proxy")

    async def generate_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            params: SamplingParams, *, rollout_id: str = "") -> GenerationResult:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": params.max_tokens,
                                "temperature": params.temperature, "top_p": params.top_p}
        if tools:
            body["tools"] = tools
        try:
            r = await self.client.post(self.url, json=body, headers=self.headers)
        except httpx.HTTPError as e:
            raise EngineError(f"upstream {self.url} unreachable: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise EngineError(f"upstream {self.url} answered {r.status_code}: {r.text[:300]}")
        try:
            choice = r.json()["choices"][0]
            message = choice["message"]
            reply = {"role": "assistant", "content": message.get("content"), "tool_calls": message.get("tool_calls")}
            if not (reply["content"] or reply["tool_calls"]):
                raise EngineError(f"upstream {self.url} sent an empty answer")
            ids = reply_ids(self.tok, self.format, messages, tools, reply)  # as the policy would sample it
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            what = "an answer the policy's template cannot write" if isinstance(e, ChatFormatError) else \
                "a malformed answer"
            raise EngineError(f"upstream {self.url} sent {what}: {type(e).__name__}: {e}") from None
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        if finish == "length":  # cut off: no stop id was sampled
            ids = ids[:-1]
        return GenerationResult(completion_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish,
                                weight_version=0, sampled_from_policy=False)

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None, *,
                             in_flight: bool = False) -> int:
        return 0  # a teacher's weights are not ours to change

    async def close(self) -> None:
        await self.client.aclose()
