"""Fuzzing the request parsers: any JSON gives a request or a ProxyError (a 4xx), never a crash."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_proxy import Harness

from legorl.engine import ScriptedEngine
from legorl.models.toolformats.tagged import TaggedJsonParser, XmlFunctionParser
from legorl.proxy.anthropic_messages import AnthropicMessages
from legorl.proxy.errors import ProxyError
from legorl.proxy.openai_chat import OpenAIChat
from legorl.proxy.openai_responses import OpenAIResponses

SCALARS = st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False) | st.text(max_size=12)
JSON = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=20)
ROLE = st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot"])
BLOCK = st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_use", "tool_result", "image", "input_text",
                                                        "function_call", "thinking", 3])},
                              optional={"text": JSON, "name": JSON, "input": JSON, "id": JSON,
                                        "tool_use_id": JSON, "content": JSON, "arguments": JSON,
                                        "call_id": JSON, "output": JSON})
MESSAGE = st.fixed_dictionaries({"role": ROLE}, optional={"content": st.text(max_size=8) | st.lists(BLOCK, max_size=3)
                                                          | JSON, "tool_calls": JSON, "tool_call_id": JSON,
                                                          "type": JSON, "name": JSON, "call_id": JSON})
FIELDS = {"model": st.text(max_size=5) | JSON, "messages": st.lists(MESSAGE, max_size=3) | JSON,
          "input": st.lists(MESSAGE | BLOCK, max_size=3) | st.text(max_size=5) | JSON, "max_tokens": JSON,
          "tools": st.lists(JSON | st.fixed_dictionaries({"type": JSON, "name": JSON, "function": JSON}),
                            max_size=2), "stream": JSON, "n": JSON, "stop": JSON, "logprobs": JSON,
          "top_logprobs": JSON, "system": JSON | st.lists(BLOCK, max_size=2), "tool_choice": JSON,
          "stop_sequences": JSON, "instructions": JSON, "temperature": JSON}
BODY = st.fixed_dictionaries({}, optional=FIELDS) | JSON


class Headers(dict):
    def get(self, k, default=None):
        return super().get(k, default)


def _parsers(tokenizer):
    return [OpenAIChat(tokenizer), OpenAIResponses(tokenizer), AnthropicMessages(tokenizer)]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=BODY, beta=st.booleans())
def test_parsers_never_crash(tokenizer, body, beta):
    for fmt in _parsers(tokenizer):
        try:
            req = fmt.parse(body, Headers({"anthropic-beta": "x"} if beta else {}))
        except ProxyError as e:
            assert 400 <= e.status < 500 and e.message
            json.dumps(fmt.error_body(e))
            continue
        assert req.messages and all(isinstance(m["role"], str) for m in req.messages)
        json.dumps(req.messages)


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60) | st.builds(lambda a, b: f"{a}<tool_call>{b}</tool_call>",
                                             st.text(max_size=10), JSON.map(json.dumps) | st.text(max_size=20)))
def test_tool_call_parsers_never_crash(text):
    for parser in (TaggedJsonParser(), XmlFunctionParser()):
        parsed = parser.parse(text)
        for c in parsed.calls:
            assert isinstance(json.loads(c.arguments), dict)
        if not parsed.calls:
            assert parsed.content == (text or None)
            assert (parsed.malformed is not None) == ("<tool_call>" in text)


def test_qwen3_coder_xml_tool_calls():
    text = ("I will run it.\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n"
            "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>")
    parsed = XmlFunctionParser().parse(text)
    content, (call,) = parsed.content, parsed.calls
    assert content == "I will run it." and call.name == "bash"
    assert json.loads(call.arguments) == {"command": "ls -la", "timeout": 30}


@pytest.fixture(scope="module")
def live_proxy(tokenizer):
    """One proxy serving from its own thread and event loop for the whole module."""
    loop = asyncio.new_event_loop()
    engine = ScriptedEngine(tokenizer)
    engine.set_script("r", lambda i, ids: "ok")
    h = Harness(engine, tokenizer)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(h.proxy.start(), loop).result(30)
    s = h.proxy.open_session("r")
    yield h.proxy.openai_base_url(s.token)
    asyncio.run_coroutine_threadsafe(h.proxy.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(["/chat/completions", "/responses", "/messages"]), body=BODY)
def test_live_proxy_answers_fuzz_with_4xx_or_200_and_keeps_serving(live_proxy, path, body):
    with httpx.Client(timeout=30) as http:
        r = http.post(live_proxy + path, content=json.dumps(body))
        assert r.status_code in (200, 400), (path, body, r.text)
        assert "error" in r.json() or r.status_code == 200
        r = http.post(live_proxy + "/chat/completions",
                      json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
