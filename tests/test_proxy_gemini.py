"""The Gemini wire format through Google's official client (google-genai), streaming and not.

Each captured call is checked for token fidelity (test_proxy.check_fidelity); answers are checked
to be made from exactly the decoded completion.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from google import genai
from google.genai import errors, types
from test_proxy import Harness, check_fidelity
from test_proxy_formats import FIRST, SECOND, OverflowEngine, answer_made_from_completion

from legorl.engine import ScriptedEngine
from legorl.models import render_tool_call_text
from legorl.monitor.messages import messages_of
from legorl.proxy.server import SamplingOverride

MODEL = "gemini-2.5-flash"
BASH = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="bash", description="Run a command",
    parameters={"type": "OBJECT", "properties": {"command": {"type": "STRING"}}, "required": ["command"]})])
NO_AFC = types.AutomaticFunctionCallingConfig(disable=True)  # the harness runs the tools, not the SDK


def run(coro):
    return asyncio.run(coro)


def client(base_url: str, api_key: str = "x", **http) -> genai.Client:
    return genai.Client(api_key=api_key, http_options=types.HttpOptions(base_url=base_url, **http))


def user(text: str) -> types.Content:
    return types.Content(role="user", parts=[types.Part(text=text)])


class RecordingEngine(ScriptedEngine):
    """A scripted engine that keeps the sampling params of each call."""

    def __init__(self, tok, *a, **kw):
        super().__init__(tok, *a, **kw)
        self.params = []

    async def generate(self, prompt_ids, params, *, rollout_id=""):
        self.params.append(params)
        return await super().generate(prompt_ids, params, rollout_id=rollout_id)


def test_text_streaming_and_not_and_count_tokens(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["Hello there.", "Streamed answer."])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            c = client(h.proxy.gemini_base_url(s.token))
            cfg = types.GenerateContentConfig(system_instruction="You are brief.")
            r = await c.aio.models.generate_content(model=MODEL, contents="Say hi.", config=cfg)
            assert r.text == "Hello there."
            (cand,) = r.candidates
            assert cand.finish_reason == types.FinishReason.STOP and cand.content.role == "model"
            assert r.model_version == MODEL and r.response_id
            u = r.usage_metadata
            assert u.prompt_token_count == len(h.calls[0].prompt_ids)
            assert u.candidates_token_count == len(h.calls[0].completion_ids)
            assert u.total_token_count == u.prompt_token_count + u.candidates_token_count
            # the conversation continued, streamed
            contents = [user("Say hi."), cand.content, user("Again.")]
            chunks = [ch async for ch in await c.aio.models.generate_content_stream(model=MODEL, contents=contents,
                                                                                    config=cfg)]
            assert "".join(ch.text or "" for ch in chunks) == "Streamed answer."
            assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
            assert chunks[-1].usage_metadata.candidates_token_count == len(h.calls[1].completion_ids)
            n = await c.aio.models.count_tokens(model=MODEL, contents="Say hi.")
            assert n.total_tokens > 0
            # countTokens renders the same prompt the first call got (system prompt aside: the Gemini API's
            # countTokens takes contents only)
            async with httpx.AsyncClient() as http:
                r = await http.post(
                    h.proxy.gemini_base_url(s.token) + f"/v1beta/models/{MODEL}:countTokens",
                    json={"generateContentRequest": {"model": f"models/{MODEL}",
                                                     "contents": [{"role": "user", "parts": [{"text": "Say hi."}]}],
                                                     "systemInstruction": {"parts": [{"text": "You are brief."}]}}})
            assert r.json()["totalTokens"] == len(h.calls[0].prompt_ids)
        assert [c.parent_index for c in h.calls] == [None, 0]
        assert all(c.wire_format == "gemini" for c in h.calls)
        assert h.proxy.stats()["by_format"] == {"gemini": 2}
        check_fidelity(tokenizer, h.calls)

    run(main())


def test_function_call_round_trip_bridges_tokens(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", [FIRST, SECOND, "All done."])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            c = client(h.proxy.gemini_base_url(s.token))
            cfg = types.GenerateContentConfig(system_instruction="You are an agent.", tools=[BASH],
                                              automatic_function_calling=NO_AFC)
            contents = [user("Fix it.")]
            r1 = await c.aio.models.generate_content(model=MODEL, contents=contents, config=cfg)
            text, call = r1.candidates[0].content.parts
            assert text.text == "Let me look."
            assert call.function_call.name == "bash" and call.function_call.args == {"command": "ls -la"}
            assert call.function_call.id  # the proxy names each call, so results can answer it by id
            assert r1.candidates[0].finish_reason == types.FinishReason.STOP
            # the result goes back without an id (Part.from_function_response has none): paired by name
            contents += [r1.candidates[0].content,
                         types.Content(role="user", parts=[types.Part.from_function_response(
                             name="bash", response={"output": "a.py"})])]
            chunks = [ch async for ch in await c.aio.models.generate_content_stream(model=MODEL, contents=contents,
                                                                                    config=cfg)]
            calls = [fc for ch in chunks for fc in ch.function_calls or []]
            assert [(fc.name, fc.args) for fc in calls] == [("bash", {"command": "cat a.py"})]
            # the harness echoes the streamed call and answers it by id
            contents += [types.Content(role="model", parts=[types.Part(function_call=calls[0])]),
                         types.Content(role="user", parts=[types.Part(function_response=types.FunctionResponse(
                             id=calls[0].id, name="bash", response={"output": "print(1)"}))])]
            r3 = await c.aio.models.generate_content(model=MODEL, contents=contents, config=cfg)
            assert r3.text == "All done."
        c0, c1, c2 = h.calls
        assert [c.parent_index for c in h.calls] == [None, 0, 1]
        # the continued calls extend the parent's exact tokens
        assert c1.prompt_ids[:len(c0.prompt_ids) + len(c0.completion_ids)] == c0.prompt_ids + c0.completion_ids
        assert c2.prompt_ids[:len(c1.prompt_ids) + len(c1.completion_ids)] == c1.prompt_ids + c1.completion_ids
        for c in h.calls:
            assert len(c.completion_ids) == len(c.completion_logprobs)
            assert tokenizer.decode(c.completion_ids, skip_special_tokens=False) == c.completion_text
        check_fidelity(tokenizer, h.calls)
        answer_made_from_completion(c0, text.text, [("bash", json.dumps(call.function_call.args))])
        assert json.loads(c0.tool_calls[0].arguments) == call.function_call.args
        # the schema reached the template as JSON Schema, the result as its text, paired with its call
        assert '"type": "object"' in tokenizer.decode(c0.prompt_ids)
        msgs = messages_of(c2.request, "gemini")
        assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "tool"]
        assert msgs[3].text == "a.py" and msgs[3].tool_call_id == msgs[2].tool_calls[0].id
        assert msgs[5].tool_call_id == calls[0].id and msgs[4].tool_calls[0].name == "bash"

    run(main())


def test_generation_config_reaches_the_engine(tokenizer):
    async def main():
        engine = RecordingEngine(tokenizer)
        engine.set_script("r", ["Hello END more", "plain", "cut"])
        orig = engine.generate

        async def generate(prompt_ids, params, **kw):  # the engine stops on the stop string / on length
            r = await orig(prompt_ids, params, **kw)
            if "END" in params.stop:
                ids = tokenizer.encode("Hello END", add_special_tokens=False)
                r.completion_ids, r.logprobs = ids, [-0.5] * len(ids)
            elif params.max_tokens == 3:
                r.completion_ids, r.logprobs, r.finish_reason = r.completion_ids[:-1], r.logprobs[:-1], "length"
            return r

        engine.generate = generate
        sampling = SamplingOverride(temperature=0.7, top_p=0.9, top_k=20, max_tokens=50)
        async with Harness(engine, tokenizer, sampling=sampling) as h:
            s = h.proxy.open_session("r")
            c = client(h.proxy.gemini_base_url(s.token))
            cfg = types.GenerateContentConfig(
                temperature=0.2, top_p=0.5, top_k=3, max_output_tokens=7, stop_sequences=["END"], seed=11,
                candidate_count=1, thinking_config=types.ThinkingConfig(thinking_budget=1024),
                response_mime_type="application/json", response_json_schema={"type": "object"},
                response_logprobs=True, logprobs=2)
            r = await c.aio.models.generate_content(model=MODEL, contents="go", config=cfg)
            assert r.text == "Hello " and r.candidates[0].finish_reason == types.FinishReason.STOP
            lp = r.candidates[0].logprobs_result
            assert len(lp.chosen_candidates) == len(h.calls[0].completion_ids)  # no end-of-turn token here
            assert all(x.log_probability == -0.5 for x in lp.chosen_candidates)
            assert len(lp.top_candidates) == len(lp.chosen_candidates)
            assert "".join(x.token for x in lp.chosen_candidates) == h.calls[0].completion_text
            p = engine.params[0]
            assert (p.max_tokens, p.stop) == (7, ["END"])  # the harness's cap and stop strings
            assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.9, 20)  # the run's sampling section
            gen = h.calls[0].request["generationConfig"]  # what the harness asked for stays recorded
            assert (gen["temperature"], gen["topK"], gen["seed"]) == (0.2, 3, 11)
            r = await c.aio.models.generate_content(model=MODEL, contents="again",
                                                    config=types.GenerateContentConfig(max_output_tokens=500))
            assert engine.params[1].max_tokens == 50 and r.candidates[0].logprobs_result is None  # the run's cap
            r = await c.aio.models.generate_content(model=MODEL, contents="more",
                                                    config=types.GenerateContentConfig(max_output_tokens=3))
            assert r.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
        check_fidelity(tokenizer, h.calls)

    run(main())


def test_candidate_count(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["one", "two", "three", "four"])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            c = client(h.proxy.gemini_base_url(s.token))
            r = await c.aio.models.generate_content(model=MODEL, contents="go",
                                                    config=types.GenerateContentConfig(candidate_count=2))
            assert [(x.index, x.content.parts[0].text) for x in r.candidates] == [(0, "one"), (1, "two")]
            assert r.usage_metadata.candidates_token_count == sum(len(x.completion_ids) for x in h.calls)
            chunks = [ch async for ch in await c.aio.models.generate_content_stream(
                model=MODEL, contents="go on", config=types.GenerateContentConfig(candidate_count=2))]
            texts = {x.index: x.content.parts[0].text for ch in chunks for x in ch.candidates}
            assert texts == {0: "three", 1: "four"} and chunks[-1].usage_metadata is not None
            with pytest.raises(errors.ClientError) as e:
                await c.aio.models.generate_content(model=MODEL, contents="go",
                                                    config=types.GenerateContentConfig(candidate_count=17))
            assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
            assert "generationConfig.candidateCount must be at most 16" in e.value.message
        assert len(h.calls) == 4 and all(c.parent_index is None for c in h.calls)
        check_fidelity(tokenizer, h.calls)

    run(main())


BAD_BODIES = [  # (method, body, needle in the message, field named)
    ("generateContent", b"{not json", "not valid JSON", None),
    ("generateContent", b"{}", "contents must be a non-empty array", "contents"),
    ("generateContent", b'{"contents": [{"role": "robot", "parts": [{"text": "x"}]}]}',
     "contents[0].role must be 'user' or 'model'", "contents[0].role"),
    ("generateContent", b'{"contents": [{"role": "system", "parts": [{"text": "x"}]}]}', "systemInstruction",
     "contents[0].role"),
    ("generateContent", b'{"contents": [{"role": "user", "parts": "x"}]}', "contents[0].parts must be an array",
     "contents[0].parts"),
    ("generateContent", b'{"contents": [{"role": "user", "parts": [{"functionCall": {"name": "f"}}]}]}',
     "contents[0].parts[0].functionCall must be", "contents[0].parts[0].functionCall"),
    ("generateContent", b'{"contents": [{"parts": [{"text": "x"}]}], "bogus": 1}', 'Unknown name "bogus"', "bogus"),
    ("generateContent", b'{"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"temperature": 3}}',
     "generationConfig.temperature must be a number between 0 and 2, got 3", "generationConfig.temperature"),
    ("generateContent", b'{"contents": [{"parts": [{"text": "x"}]}], "generationConfig": {"logprobs": 2}}',
     "requires generationConfig.responseLogprobs", "generationConfig.logprobs"),
    ("generateContent", (b'{"contents": [{"parts": [{"text": "x"}]}], "toolConfig": {"functionCallingConfig": '
                         b'{"mode": "SOMETIMES"}}}'), "AUTO | ANY | NONE", "toolConfig"),
    ("generateContent", b'{"contents": [{"parts": [{"text": "x"}]}], "tools": [{"functionDeclarations": [{}]}]}',
     "tools[0].functionDeclarations[0] must be an object with a string 'name'", "tools[0].functionDeclarations[0]"),
    ("streamGenerateContent", b'{"contents": [{"parts": [{"text": "x"}]}]}', "add ?alt=sse", "alt"),
    ("countTokens", b'{"contents": 3}', "contents must be a non-empty array", "contents"),
]


def test_bad_input_gets_google_shaped_4xx_and_proxy_keeps_serving(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["fine"])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            base = h.proxy.gemini_base_url(s.token) + f"/v1beta/models/{MODEL}:"
            async with httpx.AsyncClient() as http:
                for method, payload, needle, field in BAD_BODIES:
                    r = await http.post(base + method, content=payload, headers={"content-type": "application/json"})
                    assert r.status_code == 400, (method, payload, r.text)
                    err = r.json()["error"]
                    assert set(err) <= {"code", "message", "status", "details"}
                    assert err["code"] == 400 and err["status"] == "INVALID_ARGUMENT"
                    assert needle in err["message"], (needle, err)
                    if field is not None:
                        assert err["details"][0]["fieldViolations"][0]["field"] == field
                r = await http.post(base + "frobnicate", json={})
                assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"
                root = f"http://127.0.0.1:{h.proxy.port}/v1beta/models/{MODEL}:generateContent"
                r = await http.post(root + "?key=nope", json={"contents": [{"parts": [{"text": "x"}]}]})
                assert r.status_code == 401 and r.json()["error"]["status"] == "UNAUTHENTICATED"
                r = await http.get(f"http://127.0.0.1:{h.proxy.port}/v1beta/nowhere", headers={"x-goog-api-key": "x"})
                assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
            c = client(h.proxy.gemini_base_url(s.token))
            with pytest.raises(errors.ClientError) as e:  # through the SDK: a clear message, Google's status
                await c.aio.models.generate_content(model=MODEL, contents="x",
                                                    config=types.GenerateContentConfig(top_p=1.5))
            assert e.value.status == "INVALID_ARGUMENT" and "generationConfig.topP" in e.value.message
            r = await c.aio.models.generate_content(model=MODEL, contents="hi")
            assert r.text == "fine"
        assert len(h.calls) == 1 and s.errors == []

    run(main())


def test_context_overflow_and_engine_errors(tokenizer):
    long = "word " * 100

    async def main():
        engine = OverflowEngine(tokenizer)  # no script: short prompts fail in the engine
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            c = client(h.proxy.gemini_base_url(s.token))
            for stream in (False, True):
                with pytest.raises(errors.ClientError) as e:
                    if stream:
                        [ch async for ch in await c.aio.models.generate_content_stream(model=MODEL, contents=long)]
                    else:
                        await c.aio.models.generate_content(model=MODEL, contents=long)
                assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
                assert "exceeds the maximum number of tokens allowed (40)" in e.value.message
                assert "Shorten 'contents'" in e.value.message
            with pytest.raises(errors.ServerError) as e:
                await c.aio.models.generate_content(model=MODEL, contents="hi")
            assert e.value.code == 500 and e.value.status == "INTERNAL" and "engine error" in e.value.message
        assert s.errors == ["context_overflow"] * 2 + ["engine_error"]
        assert h.calls == []

    run(main())


def test_slow_stream_keepalives_and_late_error(tokenizer):
    """Google's SDKs read a non-`data:` line as JSON: a slow stream's keep-alives must not break them."""
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["slow but fine"])
        orig = engine.generate

        async def generate(prompt_ids, params, **kw):
            await asyncio.sleep(0.2)  # many keep-alive intervals
            if engine.calls("r") == 1:
                raise RuntimeError("engine died")
            return await orig(prompt_ids, params, **kw)

        engine.generate = generate
        async with Harness(engine, tokenizer, keepalive_s=0.01) as h:
            s = h.proxy.open_session("r")
            c = client(h.proxy.gemini_base_url(s.token))
            chunks = [ch async for ch in await c.aio.models.generate_content_stream(model=MODEL, contents="go")]
            assert "".join(ch.text or "" for ch in chunks) == "slow but fine"
            with pytest.raises(errors.APIError) as e:  # an error after the stream started: an error event
                [ch async for ch in await c.aio.models.generate_content_stream(model=MODEL, contents="again")]
            assert e.value.code == 500 and "engine died" in e.value.message
        assert s.errors == ["engine_error"]
        check_fidelity(tokenizer, h.calls)

    run(main())


def test_api_key_routes_v1_and_snake_case_bodies(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        tool_text = render_tool_call_text("bash", {"command": "ls"})
        engine.set_script("r", ["via key", "via v1", tool_text, tool_text])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            root = f"http://127.0.0.1:{h.proxy.port}"
            # the session as the API key (x-goog-api-key), on Google's default path
            r = await client(root, api_key=s.token).aio.models.generate_content(model=MODEL, contents="a")
            assert r.text == "via key"
            r = await client(h.proxy.gemini_base_url(s.token), api_version="v1").aio.models.generate_content(
                model=MODEL, contents="b")
            assert r.text == "via v1"
            m = await client(h.proxy.gemini_base_url(s.token)).aio.models.get(model=h.proxy.model_name)
            assert m.name == f"models/{h.proxy.model_name}" and "generateContent" in m.supported_actions
            # Google's curl examples: snake_case fields and ?key=
            body = {"system_instruction": {"parts": [{"text": "sys"}]},
                    "contents": [{"role": "user", "parts": [{"text": "c"}]}],
                    "tools": [{"function_declarations": [{"name": "bash", "parameters_json_schema": {
                        "type": "object", "properties": {"command": {"type": "string"}}}}]}],
                    "generation_config": {"max_output_tokens": 9, "stop_sequences": ["zz"]}}
            async with httpx.AsyncClient() as http:
                url = f"{root}/v1beta/models/{MODEL}:streamGenerateContent?alt=sse&key={s.token}"
                r = await http.post(url, json=body)
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
                (part,) = events[-1]["candidates"][0]["content"]["parts"]
                assert part["functionCall"]["name"] == "bash" and part["functionCall"]["args"] == {"command": "ls"}
                body["tool_config"] = {"function_calling_config": {"mode": "NONE"}}  # tool-call text stays text
                r = await http.post(f"{root}/v1beta/models/{MODEL}:generateContent?key={s.token}", json=body)
                assert r.json()["candidates"][0]["content"]["parts"] == [{"text": tool_text}]
        assert h.calls[0].request["contents"][0]["parts"] == [{"text": "a"}]
        assert messages_of(h.calls[2].request, "gemini")[0].text == "sys"
        check_fidelity(tokenizer, h.calls)

    run(main())


def test_retry_answered_from_record_unless_the_model_differs(tokenizer):
    async def main():
        engine = ScriptedEngine(tokenizer)
        engine.set_script("r", ["first", "second"])
        async with Harness(engine, tokenizer) as h:
            s = h.proxy.open_session("r")
            base = h.proxy.gemini_base_url(s.token) + "/v1beta/models/"
            body = {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}
            async with httpx.AsyncClient() as http:
                a = (await http.post(base + "m1:generateContent", json=body)).json()
                b = (await http.post(base + "m1:generateContent", json=body)).json()  # an SDK retry
                assert a == b and engine.calls("r") == 1
                other = (await http.post(base + "m2:generateContent", json=body)).json()
                assert other["candidates"][0]["content"]["parts"] == [{"text": "second"}]
                assert other["modelVersion"] == "m2" and engine.calls("r") == 2
        assert h.proxy.stats()["retries_answered_from_record"] == 1

    run(main())


def test_stored_bodies_read_back_as_the_model_saw_them():
    """The dashboard's reader (monitor/messages.py) pairs id-less calls and results and flags errors."""
    call = {"name": "bash", "args": {"command": "ls"}}
    body = {"systemInstruction": {"parts": [{"text": "sys"}]},
            "contents": [{"role": "user", "parts": [{"text": "go"}]},
                         {"role": "model", "parts": [{"text": "two calls", "thoughtSignature": "x"},
                                                     {"text": "hmm", "thought": True},
                                                     {"functionCall": call}, {"functionCall": call}]},
                         {"role": "user", "parts": [{"functionResponse": {"name": "bash", "response": {"output": "a"}}},
                                                    {"functionResponse": {"name": "bash",
                                                                          "response": {"error": "boom"}}},
                                                    {"text": "next"}]}]}
    for fmt in ("gemini", ""):  # named, or guessed from its keys
        msgs = messages_of(body, fmt)
        assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "tool", "user"]
        ids = [t.id for t in msgs[2].tool_calls]
        assert msgs[2].text == "two calls" and len(set(ids)) == 2
        assert [m.tool_call_id for m in msgs[3:5]] == ids
        assert (msgs[3].text, msgs[3].is_error) == ("a", False)
        assert json.loads(msgs[4].text) == {"error": "boom"} and msgs[4].is_error
