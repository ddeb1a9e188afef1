"""The proxy, driven by the official openai SDK, with token-fidelity checks on every captured call."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from legorl.engine import LocalEngine, ScriptedEngine
from legorl.models import render_tool_call_text
from legorl.models.toolformats.tagged import TaggedJsonParser
from legorl.proxy.server import Proxy, SamplingOverride

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def check_fidelity(tok, calls):
    by_index = {(c.rollout_id, c.index): c for c in calls}
    for c in calls:
        assert len(c.completion_ids) == len(c.completion_logprobs) > 0
        assert tok.decode(c.completion_ids, skip_special_tokens=False) == c.completion_text
        if c.parent_index is not None:
            p = by_index[(c.rollout_id, c.parent_index)]
            assert c.prompt_ids[: len(p.prompt_ids) + len(p.completion_ids)] == p.prompt_ids + p.completion_ids


class Harness:
    """A proxy on loopback with a list of recorded calls."""

    def __init__(self, engine, tok, **kw):
        self.calls = []
        self.proxy = Proxy(engine, tok, on_call=self.calls.append, **kw)

    async def __aenter__(self):
        await self.proxy.start()
        return self

    async def __aexit__(self, *a):
        await self.proxy.stop()


def test_multi_turn_tool_calls_bridge_tokens(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        first = "Let me look at the files.\n" + render_tool_call_text("bash", {"command": "ls -la"})
        engine.set_script("r1", [first, "All done."])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r1")
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="unused")
            msgs = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
            r1 = await client.chat.completions.create(model="m", messages=msgs, tools=[BASH])
            choice = r1.choices[0]
            assert choice.finish_reason == "tool_calls"
            assert choice.message.content == "Let me look at the files."
            (tc,) = choice.message.tool_calls
            assert tc.function.name == "bash" and json.loads(tc.function.arguments) == {"command": "ls -la"}
            # the harness echoes the reply back (as litellm does, model_dump with extra fields) + a tool result
            msgs2 = msgs + [choice.message.model_dump(), {"role": "tool", "tool_call_id": tc.id, "content": "a.py"}]
            r2 = await client.chat.completions.create(model="m", messages=msgs2, tools=[BASH])
            assert r2.choices[0].message.content == "All done." and r2.choices[0].finish_reason == "stop"
            assert r2.usage.prompt_tokens == len(h.calls[1].prompt_ids)
        c0, c1 = h.calls
        assert (c0.parent_index, c1.parent_index) == (None, 0)
        assert c1.segment_break is None
        check_fidelity(tokenizer, h.calls)
        assert c0.tool_calls[0].name == "bash"

    asyncio.run(main())


def test_rewritten_history_starts_new_segment(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["one", "two"])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x")
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            # the harness condensed its history: the earlier reply is gone
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "summary"},
                                                                      {"role": "user", "content": "go on"}])
        assert h.calls[1].parent_index is None
        assert "history rewritten" in h.calls[1].segment_break

    asyncio.run(main())


def test_sdk_retry_is_answered_from_record(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["only once"])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x")
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            a = await client.chat.completions.create(**body)
            b = await client.chat.completions.create(**body)  # a retry of the same call
            assert a.id == b.id and a.choices[0].message.content == "only once"
        assert len(h.calls) == 1

    asyncio.run(main())


def test_unknown_session_is_refused_and_bad_input_gets_4xx(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["fine"])
        async with Harness(engine, tokenizer) as h:
            bad = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url("not-a-session"), api_key="x", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            s = h.proxy.open_session("r")
            url = h.proxy.openai_base_url(s.token) + "/chat/completions"
            async with httpx.AsyncClient() as http:
                for payload, needle in [(b"{not json", "not valid JSON"), (b'{"messages": []}', "messages"),
                                        (b'{"messages": [{"role": "wizard"}]}', "messages[0]"),
                                        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
                                         "temperature")]:
                    r = await http.post(url, content=payload, headers={"content-type": "application/json"})
                    assert r.status_code == 400, payload
                    assert needle in r.json()["error"]["message"]
            # the proxy keeps serving, and the session key also routes through the plain /v1 URL
            ok = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{h.proxy.port}/v1", api_key=s.token)
            r = await ok.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content == "fine"
            models = await ok.models.list()
            assert [m.id for m in models.data] == ["legorl-policy"]
        assert len(h.calls) == 1

    asyncio.run(main())


def test_local_engine_calls_are_token_exact(tokenizer, tiny_spec):
    from legorl.models import build_model

    async def main():
        engine = LocalEngine(build_model(tiny_spec, tokenizer), tokenizer, max_batch=4)
        try:
            async with Harness(engine, tokenizer, sampling=SamplingOverride(temperature=1.0, max_tokens=24)) as h:
                async def session(i):
                    s = h.proxy.open_session(f"r{i}")
                    client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x")
                    msgs = [{"role": "user", "content": f"task {i}"}]
                    for _ in range(3):
                        r = await client.chat.completions.create(model="m", messages=msgs, tools=[BASH],
                                                                 max_tokens=1000)
                        msgs = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                                       {"role": "user", "content": "continue"}]
                await asyncio.gather(*(session(i) for i in range(3)))
        finally:
            await engine.close()
        assert len(h.calls) == 9
        assert all(len(c.completion_ids) <= 24 for c in h.calls)  # the run's cap beats the harness's ask
        assert all(c.request["max_tokens"] == 1000 for c in h.calls)  # what the harness asked is recorded
        check_fidelity(tokenizer, h.calls)
        assert sum(c.parent_index is not None for c in h.calls) == 6  # every continuation bridged

    asyncio.run(main())


@pytest.mark.parametrize("text,n_calls", [
    ('<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>', 1),
    (('think\n<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{"name": "b", '
     '"arguments": {}}</tool_call>'), 2),
    ('<tool_call>{"name": "bash", "arguments": {"command": </tool_call>', 0),  # broken JSON: plain text
    ("no tools here", 0),
])
def test_tool_call_parser(text, n_calls):
    parsed = TaggedJsonParser().parse(text)
    assert len(parsed.calls) == n_calls
    if n_calls == 0:
        assert parsed.content == text
        assert (parsed.malformed is not None) == ("<tool_call>" in text)  # an attempted call is recorded as such
