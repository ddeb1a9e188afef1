"""`engine: upstream`: an OpenAI-compatible chat endpoint as teacher, recorded token-exactly as not-sampled.

The "hosted model" here is a second legorl proxy (standalone mode) with a scripted engine: a real
OpenAI-compatible HTTP server on loopback.
"""

from __future__ import annotations

import asyncio
import json

import openai

from legorl.engine import ScriptedEngine, UpstreamEngine
from legorl.models import render_tool_call_text
from legorl.proxy.server import Proxy

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def test_upstream_teacher_answers_are_recorded_as_not_sampled(tokenizer):
    async def main():
        hosted_engine = ScriptedEngine(tokenizer)
        hosted_engine.set_script("teacher", ["Let me look.\n" + render_tool_call_text("bash", {"command": "ls"}),
                                             "All done."])
        hosted = Proxy(hosted_engine, tokenizer, accept_new_sessions=True)
        await hosted.start()
        teacher = UpstreamEngine(f"http://127.0.0.1:{hosted.port}/v1", "hosted-model", tokenizer,
                                 api_key="teacher")
        calls = []
        proxy = Proxy(teacher, tokenizer, on_call=calls.append)
        await proxy.start()
        try:
            s = proxy.open_session("r1")
            client = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x")
            msgs = [{"role": "user", "content": "Fix it."}]
            r1 = await client.chat.completions.create(model="m", messages=msgs, tools=[BASH])
            (tc,) = r1.choices[0].message.tool_calls
            assert r1.choices[0].message.content == "Let me look."
            assert json.loads(tc.function.arguments) == {"command": "ls"}
            msgs += [r1.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id, "content": "a.py"}]
            r2 = await client.chat.completions.create(model="m", messages=msgs, tools=[BASH])
            assert r2.choices[0].message.content == "All done."
        finally:
            await proxy.stop()
            await hosted.stop()
            await teacher.close()
        assert len(calls) == 2
        for c in calls:
            assert not c.sampled_from_policy  # SFT data, never policy-gradient data
            assert len(c.completion_ids) == len(c.completion_logprobs)
            assert tokenizer.decode(c.completion_ids, skip_special_tokens=False) == c.completion_text
        assert calls[1].parent_index == 0  # the teacher's turn is bridged like any other
        head = calls[0].prompt_ids + calls[0].completion_ids
        assert calls[1].prompt_ids[: len(head)] == head

    asyncio.run(main())
