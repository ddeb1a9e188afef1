"""Every wire format through the official SDKs, streaming and not, multi-turn with tool calls.

Each captured call is checked for token fidelity (see test_proxy.check_fidelity), and each answer
is checked to be made from exactly the decoded completion.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
from helpers import wait_until_async
from test_proxy import BASH, Harness, check_fidelity

from legorl.engine import ScriptedEngine
from legorl.engine.base import ContextOverflowError
from legorl.models import render_tool_call_text
from legorl.proxy.server import SamplingOverride
from legorl.store import Store

ANTHROPIC_BASH = {"name": "bash", "description": "Run a command",
                  "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                   "required": ["command"]}}
RESPONSES_BASH = {"type": "function", "name": "bash", "description": "Run a command",
                  "parameters": BASH["function"]["parameters"]}
FIRST = "Let me look.\n" + render_tool_call_text("bash", {"command": "ls -la"})
SECOND = render_tool_call_text("bash", {"command": "cat a.py"})


def answer_made_from_completion(call, content, tool_calls):
    """The returned text/tool calls come from exactly the decoded completion."""
    if content:
        assert content.strip() in call.completion_text
    for name, args in tool_calls:
        assert f'"name": {json.dumps(name)}' in call.completion_text
        assert json.loads(args) == json.loads(json.dumps(args) if isinstance(args, dict) else args)


def run(coro):
    return asyncio.run(coro)


# ---- OpenAI Chat Completions ---------------------------------------------------------------------

def test_chat_streaming_tool_calls_n_and_logprobs(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", [FIRST, SECOND, "done", "also done"])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x")
            msgs = [{"role": "developer", "content": "You are an agent."}, {"role": "user", "content": "Fix it."}]
            stream = await client.chat.completions.create(model="m", messages=msgs, tools=[BASH], stream=True,
                                                          stream_options={"include_usage": True})
            content, calls, finish, usage = "", {}, None, None
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                for ch in chunk.choices:
                    content += ch.delta.content or ""
                    for tc in ch.delta.tool_calls or []:
                        slot = calls.setdefault(tc.index, {"id": "", "name": "", "args": ""})
                        slot["id"] += tc.id or ""
                        slot["name"] += (tc.function.name or "") if tc.function else ""
                        slot["args"] += (tc.function.arguments or "") if tc.function else ""
                    finish = ch.finish_reason or finish
            assert content == "Let me look." and finish == "tool_calls"
            assert calls[0]["name"] == "bash" and json.loads(calls[0]["args"]) == {"command": "ls -la"}
            assert usage.prompt_tokens == len(h.calls[0].prompt_ids)
            assert usage.completion_tokens == len(h.calls[0].completion_ids)
            msgs += [{"role": "assistant", "content": content,
                      "tool_calls": [{"id": calls[0]["id"], "type": "function",
                                      "function": {"name": "bash", "arguments": calls[0]["args"]}}]},
                     {"role": "tool", "tool_call_id": calls[0]["id"], "content": "a.py"}]
            r2 = await client.chat.completions.create(model="m", messages=msgs, tools=[BASH], logprobs=True,
                                                      top_logprobs=3)
            lp = r2.choices[0].logprobs.content
            assert len(lp) == len(h.calls[1].completion_ids) - 1  # all sampled tokens but the end-of-turn
            assert "".join(t.token for t in lp) == h.calls[1].completion_text.removesuffix("<|im_end|>")
            assert all(len(t.top_logprobs) == 1 and t.top_logprobs[0].token == t.token for t in lp)
            # n = 2: two samples of the same prompt, both recorded
            msgs3 = msgs + [r2.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": r2.choices[0].message.tool_calls[0].id,
                             "content": "print(1)"}]
            r3 = await client.chat.completions.create(model="m", messages=msgs3, tools=[BASH], n=2)
            assert [c.message.content for c in r3.choices] == ["done", "also done"]
            assert [c.finish_reason for c in r3.choices] == ["stop", "stop"]
        assert [c.parent_index for c in h.calls] == [None, 0, 1, 1]
        assert all(c.wire_format == "openai_chat" for c in h.calls)
        check_fidelity(tokenizer, h.calls)
        answer_made_from_completion(h.calls[0], content, [("bash", calls[0]["args"])])

    run(main())


# ---- OpenAI Responses ----------------------------------------------------------------------------

def test_responses_multi_turn_streaming_and_not(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", [FIRST, SECOND, "All done."])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x")
            inp = [{"role": "developer", "content": "You are an agent."},
                   {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix it."}]}]
            r1 = await client.responses.create(model="m", instructions="Be brief.", input=inp,
                                               tools=[RESPONSES_BASH], store=False)
            assert r1.status == "completed" and r1.output_text == "Let me look."
            msg, fc = r1.output
            assert msg.type == "message" and fc.type == "function_call" and fc.name == "bash"
            assert json.loads(fc.arguments) == {"command": "ls -la"}
            assert r1.usage.input_tokens == len(h.calls[0].prompt_ids)
            # the harness echoes the output items (with a reasoning item of its own) and the tool output
            inp2 = inp + [{"type": "reasoning", "id": "rs_1", "summary": []}, msg.model_dump(), fc.model_dump(),
                          {"type": "function_call_output", "call_id": fc.call_id, "output": "a.py"}]
            async with client.responses.stream(model="m", instructions="Be brief.", input=inp2,
                                               tools=[RESPONSES_BASH], store=False) as stream:
                kinds = [e.type async for e in stream]
                r2 = await stream.get_final_response()
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
            assert "response.function_call_arguments.delta" in kinds
            (fc2,) = r2.output
            assert json.loads(fc2.arguments) == {"command": "cat a.py"}
            inp3 = inp2 + [fc2.model_dump(), {"type": "function_call_output", "call_id": fc2.call_id,
                                              "output": [{"type": "input_text", "text": "print(1)"}]}]
            stream = await client.responses.create(model="m", instructions="Be brief.", input=inp3,
                                                   tools=[RESPONSES_BASH], store=False, stream=True)
            seq = [e async for e in stream]
            assert [e.sequence_number for e in seq] == list(range(len(seq)))
            deltas = "".join(e.delta for e in seq if e.type == "response.output_text.delta")
            assert deltas == "All done." and seq[-1].response.output_text == "All done."
        assert [c.parent_index for c in h.calls] == [None, 0, 1]
        assert all(c.wire_format == "openai_responses" for c in h.calls)
        check_fidelity(tokenizer, h.calls)

    run(main())


def test_responses_previous_response_id_and_custom_tools(tokenizer):
    patch = "*** Begin Patch\n*** End Patch"
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", [render_tool_call_text("apply_patch", {"input": patch}), "ok"])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x")
            tools = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch"},
                     {"type": "web_search"}]
            r1 = await client.responses.create(model="m", input="Patch it.", tools=tools)
            (call,) = r1.output
            assert call.type == "custom_tool_call" and call.input == patch
            r2 = await client.responses.create(
                model="m", previous_response_id=r1.id, tools=tools,
                input=[{"type": "custom_tool_call_output", "call_id": call.call_id, "output": "applied"}])
            assert r2.output_text == "ok"
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="m", previous_response_id="resp_nope", input="x")
            assert "resp_nope" in str(e.value)
        assert h.calls[1].parent_index == 0
        check_fidelity(tokenizer, h.calls)

    run(main())


# ---- Anthropic Messages --------------------------------------------------------------------------

def test_anthropic_multi_turn_streaming_and_not(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", [FIRST, SECOND, "All done."])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            client = anthropic.AsyncAnthropic(base_url=h.proxy.anthropic_base_url(s.token), api_key="x")
            system = [{"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}]
            msgs = [{"role": "user", "content": [{"type": "text", "text": "<reminder>\n"},
                                                 {"type": "text", "text": "Fix it."}]}]
            extra = {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                     "brand_new_beta_field": {"x": 1}}
            r1 = await client.messages.create(
                model="m", max_tokens=1000, system=system, messages=msgs, tools=[ANTHROPIC_BASH],
                thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=extra,
                extra_headers={"anthropic-beta": "context-management-2025-06-27"})
            assert r1.stop_reason == "tool_use"
            text, tool = r1.content
            assert text.text == "Let me look." and tool.name == "bash" and tool.input == {"command": "ls -la"}
            assert tool.id.startswith("toolu_")
            assert r1.usage.input_tokens == len(h.calls[0].prompt_ids)
            msgs += [{"role": "assistant", "content": [b.model_dump() for b in r1.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool.id,
                                                   "content": [{"type": "text", "text": "a.py"}]},
                                                  {"type": "text", "text": "<reminder>keep going</reminder>"}]}]
            async with client.messages.stream(model="m", max_tokens=1000, system=system, messages=msgs,
                                              tools=[ANTHROPIC_BASH]) as stream:
                kinds = [e.type async for e in stream]
                r2 = await stream.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert "input_json" in kinds or "content_block_delta" in kinds
            (tool2,) = r2.content
            assert tool2.input == {"command": "cat a.py"} and r2.stop_reason == "tool_use"
            assert r2.usage.output_tokens == len(h.calls[1].completion_ids)
            msgs += [{"role": "assistant", "content": [b.model_dump() for b in r2.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool2.id,
                                                   "content": "print(1)", "is_error": False}]}]
            raw = await client.messages.create(model="m", max_tokens=1000, system=system, messages=msgs,
                                               tools=[ANTHROPIC_BASH], stream=True)
            events = [e async for e in raw]
            text3 = "".join(e.delta.text for e in events if e.type == "content_block_delta")
            assert text3 == "All done."
            assert next(e for e in events if e.type == "message_delta").delta.stop_reason == "end_turn"
            n = await client.messages.count_tokens(model="m", system=system, messages=msgs, tools=[ANTHROPIC_BASH])
            assert n.input_tokens == len(h.calls[2].prompt_ids)  # same render, before the bridge
        assert [c.parent_index for c in h.calls] == [None, 0, 1]
        assert all(c.wire_format == "anthropic_messages" for c in h.calls)
        check_fidelity(tokenizer, h.calls)

    run(main())


def test_anthropic_stop_sequence_and_max_tokens(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["Hello END more text", "cut off"])
        orig = engine.generate

        async def generate(prompt_ids, params, **kw):  # an engine that stopped on the stop string
            r = await orig(prompt_ids, params, **kw)
            if "END" in params.stop:
                ids = tokenizer.encode("Hello END", add_special_tokens=False)
                r.completion_ids, r.logprobs = ids, [0.0] * len(ids)
            else:
                r.completion_ids, r.logprobs, r.finish_reason = r.completion_ids[:-1], r.logprobs[:-1], "length"
            return r

        engine.generate = generate
        async with Harness(engine, tokenizer, sampling=SamplingOverride(max_tokens=50)) as h:
            s = h.proxy.open_session("r")
            client = anthropic.AsyncAnthropic(base_url=h.proxy.anthropic_base_url(s.token), api_key="x")
            r = await client.messages.create(model="m", max_tokens=10, stop_sequences=["END"],
                                             messages=[{"role": "user", "content": "hi"}])
            assert r.stop_reason == "stop_sequence" and r.stop_sequence == "END"
            assert r.content[0].text == "Hello "
            r = await client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": "x"}])
            assert r.stop_reason == "max_tokens"
        check_fidelity(tokenizer, h.calls)

    run(main())


# ---- errors in each format's own shape -----------------------------------------------------------

class OverflowEngine(ScriptedEngine):
    async def generate(self, prompt_ids, params, *, rollout_id=""):
        if len(prompt_ids) > 40:
            raise ContextOverflowError(f"prompt of {len(prompt_ids)} tokens")
        return await super().generate(prompt_ids, params, rollout_id=rollout_id)

    def max_context(self):
        return 40


def test_context_overflow_and_engine_errors_in_each_shape(tokenizer):
    long = "word " * 100

    async def main():
        engine = OverflowEngine(tokenizer)
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")  # no script set: short prompts fail in the engine
            oa = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x", max_retries=0)
            an = anthropic.AsyncAnthropic(base_url=h.proxy.anthropic_base_url(s.token), api_key="x",
                                          max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": long}])
            assert e.value.code == "context_length_exceeded" and "maximum context length is 40" in str(e.value)
            with pytest.raises(openai.BadRequestError) as e:
                await oa.responses.create(model="m", input=long, stream=True)
            assert e.value.code == "context_length_exceeded"
            with pytest.raises(anthropic.BadRequestError) as e:
                await an.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": long}])
            assert e.value.body["error"]["type"] == "invalid_request_error"
            assert "prompt is too long" in e.value.body["error"]["message"]
            with pytest.raises(anthropic.InternalServerError) as e:
                await an.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
            assert e.value.body["error"]["type"] == "api_error"
            with pytest.raises(openai.InternalServerError):
                await oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert s.errors == ["context_overflow"] * 3 + ["engine_error"] * 2
        assert h.calls == []

    run(main())


BAD_BODIES = [  # (path, body, needle in the error message)
    ("/chat/completions", b"{not json", "not valid JSON"),
    ("/chat/completions", b"[1, 2]", "JSON object"),
    ("/chat/completions", b'{"model": "m"}', "messages"),
    ("/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
    ("/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": "2"}', "'n'"),
    ("/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "bogus": 1}', "bogus"),
    ("/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}', "tools"),
    ("/responses", b'{"model": "m"}', "input"),
    ("/responses", b'{"model": "m", "input": [{"type": "frobnicate"}]}', "frobnicate"),
    ("/responses", b'{"model": "m", "input": "x", "max_output_tokens": -1}', "max_output_tokens"),
    ("/messages", b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}', "max_tokens"),
    ("/messages", b'{"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}',
     "messages.0"),
    ("/messages", b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "foo": 1}',
     "foo"),
    ("/messages/count_tokens", b'{"model": "m", "messages": 7}', "messages"),
]


def test_bad_input_gets_4xx_in_the_format_shape_and_proxy_keeps_serving(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["fine"])
        async with Harness(engine, tokenizer, max_body_bytes=100_000) as h:
            s = h.proxy.open_session("r")
            base = h.proxy.openai_base_url(s.token)
            async with httpx.AsyncClient() as http:
                for path, payload, needle in BAD_BODIES:
                    r = await http.post(base + path, content=payload, headers={"content-type": "application/json"})
                    assert r.status_code == 400, (path, payload, r.text)
                    err = r.json()["error"]
                    assert needle in err["message"], (needle, err)
                    if path.startswith("/messages"):
                        assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"
                    else:
                        assert err["type"] == "invalid_request_error" and "param" in err
                big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 200_000 + b'"}]}'
                r = await http.post(base + "/chat/completions", content=big)
                assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
                r = await http.post(base + "/messages", content=b"{}", headers={"x-api-key": "nope"})
                assert r.status_code == 400  # the path session is valid; the body is not
                r = await http.post(f"http://127.0.0.1:{h.proxy.port}/v1/messages", content=b"{}",
                                    headers={"x-api-key": "nope"})
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
                r = await http.get(base + "/nowhere")
                assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
            ok = openai.AsyncOpenAI(base_url=base, api_key="x")
            r = await ok.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert r.choices[0].message.content == "fine"
        assert len(h.calls) == 1 and s.errors == []

    run(main())


# ---- retries, weight updates, stats, store report --------------------------------------------------

def test_retry_dedup_drain_and_stats(tokenizer, tmp_path):
    async def main():
        store = Store(tmp_path / "store.sqlite")
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["first", FIRST, "after update"])
        h = Harness(engine, tokenizer)
        h.proxy.on_call = lambda c: (h.calls.append(c), store.add_call(c))
        async with h:
            s = h.proxy.open_session("r")
            url = h.proxy.anthropic_base_url(s.token) + "/v1/messages"
            body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
            async with httpx.AsyncClient() as http:
                a = (await http.post(url, json=body)).json()
                b = (await http.post(url, json=body, headers={"x-stainless-retry-count": "1"})).json()
                assert a == b and engine.calls("r") == 1  # answered from the record, not sampled twice
                # a weight update: requests arriving during it are held, then served with the new version
                body2 = {**body, "messages": [{"role": "user", "content": "again"}]}
                async with h.proxy.paused():
                    pending = asyncio.create_task(http.post(url, json=body2))
                    assert await wait_until_async(lambda: h.proxy.held == 1)  # it arrived and is held
                    assert not pending.done() and engine.calls("r") == 1 and h.proxy.in_flight == 0
                    await engine.update_weights({})
                await pending
                assert h.proxy.held == 0
                body3 = {**body2, "messages": body2["messages"] + [
                    {"role": "assistant", "content": (await pending).json()["content"]},
                    {"role": "user", "content": "go on"}]}
                r3 = await http.post(url, json=body3)
                assert r3.json()["content"][0]["text"] == "after update"
        assert [c.weight_version for c in h.calls] == [0, 1, 1]
        stats = h.proxy.stats()
        assert stats["calls"] == 3 and stats["retries_answered_from_record"] == 1
        assert stats["segments"] == 2 and stats["bridge_hits"] == 1
        assert stats["by_format"] == {"anthropic_messages": 3}
        rep = store.report(decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
        assert rep["fidelity"]["violations"] == 0
        assert (rep["fidelity"]["segments"], rep["fidelity"]["bridge_hits"]) == (2, 1)
        assert rep["fidelity"]["drift_prevented"] == stats["drift_prevented"]

    run(main())


def test_drift_prevented_is_counted(tokenizer):
    """A sampled tokenization that re-encoding would not reproduce is kept, and counted as drift prevented."""
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["unused", "ok"])
        orig = engine.generate

        async def generate(prompt_ids, params, **kw):
            r = await orig(prompt_ids, params, **kw)
            if engine.calls("r") == 1:  # sample "hello" as single characters: valid but not canonical BPE
                ids = [i for ch in "hello" for i in tokenizer.encode(ch, add_special_tokens=False)]
                ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
                r.completion_ids, r.logprobs = ids, [0.0] * len(ids)
            return r

        engine.generate = generate
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            client = openai.AsyncOpenAI(base_url=h.proxy.openai_base_url(s.token), api_key="x")
            msgs = [{"role": "user", "content": "hi"}]
            r = await client.chat.completions.create(model="m", messages=msgs)
            assert r.choices[0].message.content == "hello"
            msgs += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
            await client.chat.completions.create(model="m", messages=msgs)
        _c0, c1 = h.calls
        assert c1.parent_index == 0 and c1.naive_prompt_differs
        assert h.proxy.stats()["drift_prevented"] == 1
        check_fidelity(tokenizer, h.calls)

    run(main())


def test_standalone_mode_accepts_new_sessions(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("my-run-1", ["hello"])
        async with Harness(engine, tokenizer, accept_new_sessions=True) as h:
            client = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{h.proxy.port}", api_key="my-run-1")
            r = await client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
            assert r.content[0].text == "hello"
            bad = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{h.proxy.port}", api_key="bad key!",
                                           max_retries=0)
            with pytest.raises(anthropic.AuthenticationError):
                await bad.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert h.calls[0].rollout_id == "my-run-1"

    run(main())
