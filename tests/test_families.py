"""Every model family through the embedded engine and the proxy (issue #43): no downloads.

Each family of tests/families.py (its template, its special tokens, a tiny random model of its architecture):

- **engine**: `LocalEngine` loads the checkpoint (its fast path where it covers the architecture, else the HF
  fallback) and samples a few tokens of a rendered prompt with their logprobs; the chat format's stop ids stop it.
- **proxy**: a `ScriptedEngine` answers in the family's own tool-call syntax (the template's rendering of the call,
  as its model would sample it), and every wire format (Chat Completions, Responses, Anthropic Messages, Gemini),
  streamed and not, through the official SDKs, returns the call with its name and arguments, read by the family's
  auto-chosen tool format; the next call (with the tool result) is bridged onto the first, 0 fidelity violations.
- **gpt-oss**: a harmony reply (an analysis message, `<|end|>`, then a commentary tool call closed by `<|call|>`) is
  sampled whole: `<|end|>` closes a message, not the turn.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import torch
from families import FAMILIES, NO_TOOLS, family_tokenizer, save_checkpoint
from google import genai
from google.genai import types
from transformers import AutoModelForCausalLM, AutoTokenizer

from legorl.engine import ScriptedEngine, UpstreamEngine
from legorl.engine.local import LocalEngine
from legorl.models import render_tool_call_text
from legorl.models.chat_format import chat_format
from legorl.models.replies import reply_ids
from legorl.proxy.server import Proxy
from legorl.records import SamplingParams
from legorl.store import Store

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALL = [*FAMILIES, NO_TOOLS]
PARAMS = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a command", "parameters": PARAMS}}
LS = {"command": "ls -la"}
USER = "List the files."
RESULT = "a.py b.py"


def load(folder: Path):
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    return tok, model, chat_format(tok, folder)


def engine_of(model, tok, fmt, **kw) -> LocalEngine:
    return LocalEngine(model, tok, chat_format=fmt, max_context=1024, max_batch=1, prefix_cache_mb=0, **kw)


def force(model, ids: list[int]):
    """Make the model's n-th forward put all its probability on ids[n] (the HF forward; a hook on the output
    embeddings), so an engine samples `ids` and shows where it stops."""
    step = iter(ids)

    def hook(_module, _inputs, logits):
        forced = torch.full_like(logits[:, -1], -1e4)
        forced[:, next(step)] = 0.0
        logits = logits.clone()
        logits[:, -1] = forced
        return logits

    return model.get_output_embeddings().register_forward_hook(hook)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: save_checkpoint(root / f, f) for f in ALL}


# ---- through the engine ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ALL)
def test_the_engine_samples_each_family(family, checkpoints):
    tok, model, fmt = load(checkpoints[family])
    text = tok.apply_chat_template([{"role": "user", "content": USER}], tools=[BASH], add_generation_prompt=True,
                                   tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)

    async def main():
        engine = engine_of(model, tok, fmt)
        try:
            free = await engine.generate(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=0))
            return engine.backend, engine.stop_token_ids, free
        finally:
            await engine.close()

    backend, stops, free = asyncio.run(main())
    assert set(fmt.stop_ids) <= set(stops)
    assert 1 <= len(free.completion_ids) == len(free.logprobs) <= 4
    assert all(math.isfinite(lp) and lp <= 0 for lp in free.logprobs)
    assert not set(free.completion_ids[:-1]) & set(stops)  # it stops at the first stop id
    assert free.finish_reason == ("stop" if free.completion_ids[-1] in stops else "length")
    assert backend in ("fast", "hf")

    # a model that writes a word and then the end of its turn: the engine stops there (the HF forward, forced)
    word = tok.encode(" ls", add_special_tokens=False)
    with force(model, [*word, fmt.stop_ids[0], *word]):
        async def forced():
            engine = engine_of(model, tok, fmt, fast=False)
            try:
                return await engine.generate(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
            finally:
                await engine.close()

        got = asyncio.run(forced())
    assert got.completion_ids == [*word, fmt.stop_ids[0]] and got.finish_reason == "stop"


# ---- gpt-oss: <|end|> closes a message, <|call|> the turn ---------------------------------------------------------

HARMONY_REPLY = ("<|channel|>analysis<|message|>List first.<|end|><|start|>assistant<|channel|>commentary "
                 'to=functions.bash <|constrain|>json<|message|>{"command": "ls -la"}<|call|>')


def test_harmony_stops_on_call_and_return_not_end(checkpoints):
    tok, model, fmt = load(checkpoints["harmony"])
    names = tok.convert_ids_to_tokens(list(fmt.stop_ids))
    assert fmt.end_of_turn == "<|end|>" and "<|end|>" not in names  # a turn end for the bridge, never a stop
    assert {"<|call|>", "<|return|>"} <= set(names) and tok.convert_tokens_to_ids("<|call|>") in fmt.turn_end_ids
    reply = tok.encode(HARMONY_REPLY, add_special_tokens=False)
    after = tok.encode("<|start|>assistant<|channel|>final", add_special_tokens=False)  # never sampled

    async def main():
        engine = engine_of(model, tok, fmt, fast=False)
        assert tok.convert_tokens_to_ids("<|end|>") not in engine.stop_token_ids
        calls: list = []
        proxy = Proxy(engine, tok, chat_format=fmt, on_call=calls.append)
        await proxy.start()
        try:
            s = proxy.open_session("r")
            c = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x", max_retries=0)
            with force(model, [*reply, *after]):
                m = (await c.chat.completions.create(model="m", messages=[{"role": "user", "content": USER}],
                                                     tools=[BASH], max_tokens=len(reply) + 5)).choices[0]
            await c.close()
            return m, calls
        finally:
            await proxy.stop()
            await engine.close()

    m, calls = asyncio.run(main())
    assert calls[0].completion_text == HARMONY_REPLY, (calls[0].completion_text, calls[0].finish_reason)
    assert calls[0].completion_ids == reply  # sampled whole
    assert m.finish_reason == "tool_calls" and m.message.reasoning_content == "List first."
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.message.tool_calls] == [("bash", LS)]

    # the scripted engine plays it the same: ends on its <|call|>, adds nothing; a final answer gets <|return|>
    scripted = ScriptedEngine(tok, chat_format=fmt)
    scripted.set_script("r", [HARMONY_REPLY, "<|channel|>final<|message|>Done."])
    got = [asyncio.run(scripted.generate([1], SamplingParams(), rollout_id="r")).completion_ids for _ in range(2)]
    assert got[0] == reply and tok.convert_ids_to_tokens(got[1][-1]) == "<|return|>"


# ---- through the proxy: every wire format, streamed and not -----------------------------------------------------

def scripted_call(tok, content: str | None) -> str:
    """The family's tool call as its model samples it: the template's rendering of the assistant turn after the
    generation prompt, up to and including the first stop id (where an engine stops)."""
    call = {"role": "assistant", "content": content, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "bash", "arguments": LS}}]}
    ids = reply_ids(tok, chat_format(tok), [{"role": "user", "content": USER}], [BASH], call)
    return tok.decode(ids, skip_special_tokens=False)


async def chat(c, stream: bool, msgs: list) -> tuple[list, str | None, dict]:
    if not stream:
        m = (await c.chat.completions.create(model="m", messages=msgs, tools=[BASH])).choices[0].message
        calls = [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls or []]
        return calls, m.content, m.model_dump(exclude_none=True)
    content, by_index = "", {}
    async for ch in await c.chat.completions.create(model="m", messages=msgs, tools=[BASH], stream=True):
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            t = by_index.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            t["id"] += tc.id or ""
            t["function"]["name"] += tc.function.name or ""
            t["function"]["arguments"] += tc.function.arguments or ""
    echo = {"role": "assistant", "content": content or None, "tool_calls": list(by_index.values()) or None}
    calls = [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in by_index.values()]
    return calls, content or None, {k: v for k, v in echo.items() if v is not None}


async def session_chat(proxy, s, stream: bool) -> tuple[list, str | None]:
    c = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x", max_retries=0)
    msgs: list = [{"role": "user", "content": USER}]
    calls, content, echo = await chat(c, stream, msgs)
    msgs += [echo, *[{"role": "tool", "tool_call_id": t["id"], "content": RESULT} for t in echo.get("tool_calls", [])]]
    await chat(c, stream, msgs)
    await c.close()
    return calls, content


async def session_responses(proxy, s, stream: bool) -> tuple[list, str | None]:
    c = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x", max_retries=0)
    tools = [{"type": "function", "name": "bash", "description": "Run a command", "parameters": PARAMS}]
    inp: list = [{"role": "user", "content": USER}]
    first = None
    for _ in range(2):
        if stream:
            async with c.responses.stream(model="m", input=inp, tools=tools) as st:
                r = await st.get_final_response()
        else:
            r = await c.responses.create(model="m", input=inp, tools=tools)
        first = first or r.output
        inp += [o.model_dump(exclude_none=True) for o in r.output]
        inp += [{"type": "function_call_output", "call_id": o.call_id, "output": RESULT}
                for o in r.output if o.type == "function_call"]
    await c.close()
    calls = [(o.name, json.loads(o.arguments)) for o in first if o.type == "function_call"]
    texts = [p.text for o in first if o.type == "message" for p in o.content]
    return calls, "".join(texts) or None


async def session_anthropic(proxy, s, stream: bool) -> tuple[list, str | None]:
    c = anthropic.AsyncAnthropic(base_url=proxy.anthropic_base_url(s.token), api_key="x", max_retries=0)
    tools = [{"name": "bash", "description": "Run a command", "input_schema": PARAMS}]
    msgs: list = [{"role": "user", "content": USER}]
    first = None
    for _ in range(2):
        if stream:
            async with c.messages.stream(model="m", max_tokens=500, messages=msgs, tools=tools) as st:
                r = await st.get_final_message()
        else:
            r = await c.messages.create(model="m", max_tokens=500, messages=msgs, tools=tools)
        first = first or r.content
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        uses = [b for b in r.content if b.type == "tool_use"]
        if uses:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": RESULT}
                                                     for b in uses]})
    await c.close()
    return [(b.name, b.input) for b in first if b.type == "tool_use"], \
        "".join(b.text for b in first if b.type == "text") or None


async def session_gemini(proxy, s, stream: bool) -> tuple[list, str | None]:
    c = genai.Client(api_key="x", http_options=types.HttpOptions(base_url=proxy.gemini_base_url(s.token)))
    cfg = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(
            name="bash", description="Run a command", parameters_json_schema=PARAMS)])],
        automatic_function_calling=types.AutomaticFunctionCallingConfig(disable=True))
    contents = [types.Content(role="user", parts=[types.Part(text=USER)])]
    first = None
    for _ in range(2):
        if stream:
            chunks = [x async for x in await c.aio.models.generate_content_stream(model="m", contents=contents,
                                                                                 config=cfg)]
            parts = [p for ch in chunks for p in ch.candidates[0].content.parts]
        else:
            parts = (await c.aio.models.generate_content(model="m", contents=contents, config=cfg)
                     ).candidates[0].content.parts
        first = first or parts
        contents.append(types.Content(role="model", parts=parts))
        fcs = [p.function_call for p in parts if p.function_call]
        if fcs:
            contents.append(types.Content(role="user", parts=[types.Part.from_function_response(
                name=f.name, response={"output": RESULT}) for f in fcs]))
    calls = [(p.function_call.name, dict(p.function_call.args)) for p in first if p.function_call]
    return calls, "".join(p.text for p in first if p.text and not p.thought) or None


WIRES = {"chat": session_chat, "responses": session_responses, "anthropic": session_anthropic,
         "gemini": session_gemini}


@pytest.fixture(scope="module")
def tokenizers():
    return {f: family_tokenizer(f) for f in ALL}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("wire", list(WIRES))
@pytest.mark.parametrize("family", ALL)
def test_every_wire_format_reads_the_familys_call_and_bridges_the_next(family, wire, stream, tokenizers, tmp_path):
    tok = tokenizers[family]
    content = "I will look." if family == NO_TOOLS or FAMILIES[family][3] else None
    reply = scripted_call(tok, content)

    async def main():
        engine = ScriptedEngine(tok)
        calls: list = []
        proxy = Proxy(engine, tok, on_call=calls.append)  # the tool format: auto, the checkpoint's
        await proxy.start()
        try:
            s = proxy.open_session("r")
            engine.set_script("r", [reply, "Two files."])
            got = await WIRES[wire](proxy, s, stream)
            return got, calls
        finally:
            await proxy.stop()

    (got_calls, got_content), calls = asyncio.run(main())
    assert got_calls == [("bash", LS)], reply
    assert got_content == content
    assert len(calls) == 2 and calls[0].tool_calls and not calls[0].malformed_tool_call
    assert calls[1].parent_index == 0 and calls[1].segment_break is None  # the tool result's call is bridged
    with Store(tmp_path / "store.sqlite") as store:
        for c in calls:
            store.add_call(c)
        fidelity = store.report(decode=lambda ids: tok.decode(ids, skip_special_tokens=False))["fidelity"]
    assert fidelity["violations"] == 0 and fidelity["bridge_hits"] == 1 and fidelity["segments"] == 1, fidelity


# ---- teachers: demonstrations in the family's own syntax ---------------------------------------------------------

def upstream_teacher(tok, content: str | None) -> UpstreamEngine:
    """A hosted model (OpenAI Chat Completions, on a mock transport) that calls bash, then answers."""
    answers = iter([{"content": content, "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "bash", "arguments": json.dumps(LS)}}]},
        {"content": "Two files."}])

    def answer(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", **next(answers)},
                                                      "finish_reason": "stop"}]})

    return UpstreamEngine("http://teacher.invalid/v1", "hosted", tok,
                          client=httpx.AsyncClient(transport=httpx.MockTransport(answer)))


@pytest.mark.parametrize("teacher", ["scripted", "upstream"])
@pytest.mark.parametrize("family", ALL)
def test_a_teachers_call_reaches_the_policy_in_its_familys_syntax(family, teacher, tokenizers, tmp_path):
    """A script writes calls in legorl's <tool_call> syntax and a hosted teacher answers in messages: either way
    the recorded ids are what a model of this family samples (its template's syntax, closed by its stop id), the
    proxy reads the call back, and the next call is bridged onto them."""
    tok = tokenizers[family]
    content = "I will look." if family == NO_TOOLS or FAMILIES[family][3] else None

    async def main():
        if teacher == "scripted":
            engine = ScriptedEngine(tok)
            engine.set_script("r", [(content + "\n" if content else "") + render_tool_call_text("bash", LS),
                                    "Two files."])
        else:
            engine = upstream_teacher(tok, content)
        calls: list = []
        proxy = Proxy(engine, tok, on_call=calls.append)
        await proxy.start()
        try:
            got = await session_chat(proxy, proxy.open_session("r"), stream=False)
            return got, calls
        finally:
            await proxy.stop()
            await engine.close()

    (got_calls, got_content), calls = asyncio.run(main())
    assert got_calls == [("bash", LS)] and got_content == content
    assert calls[0].completion_text == scripted_call(tok, content)  # the family's syntax, as its model samples it
    assert calls[0].completion_ids[-1] in chat_format(tok).stop_ids and not calls[0].malformed_tool_call
    assert calls[1].parent_index == 0 and calls[1].segment_break is None
    with Store(tmp_path / "store.sqlite") as store:
        for c in calls:
            store.add_call(c)
        fidelity = store.report(decode=lambda ids: tok.decode(ids, skip_special_tokens=False))["fidelity"]
    assert fidelity["violations"] == 0 and fidelity["bridge_hits"] == 1, fidelity
