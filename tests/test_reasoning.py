"""Reasoning (docs/proxy.md, "Reasoning"): split from the answer, returned in each wire format's own field
through the official SDKs (streaming and not), read back from requests, and the token bridge when a
Qwen3-style template drops past reasoning (every sampled token stays trainable, 0 fidelity violations).

The tokenizer and the template are built on the spot: ChatML tokens, `<think>` / `</think>` and the tool
tags as added tokens, and a template written after Qwen3's, with its documented behaviour: an assistant
turn's reasoning (its `reasoning_content`, or a `<think>` block in its content) is rendered only for turns
after the last user message; earlier turns are rendered without it.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest
from google import genai
from google.genai import types
from test_chat_format import _CORPUS
from test_proxy import check_fidelity
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from legorl.engine import ScriptedEngine
from legorl.models.chat_format import chat_format
from legorl.models.toolformats import get_parser
from legorl.proxy.reasoning import REASONING_DROPPED, split_reasoning
from legorl.proxy.server import Proxy

QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nCall a function as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
  {%- set index = (messages|length - 1) - loop.index0 %}
  {%- if ns.multi_step_tool and message.role == 'user' and message.content is string
        and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
    {%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}
  {%- endif %}
{%- endfor %}
{%- for message in messages %}
  {%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}{%- endif %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
  {%- elif message.role == 'assistant' %}
    {%- set reasoning_content = '' %}
    {%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}
    {%- elif '</think>' in content %}
      {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
      {{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
    {%- else %}
      {{- '<|im_start|>assistant\\n' + content }}
    {%- endif %}
    {%- for tool_call in message.tool_calls or [] %}
      {%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}
      {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
      {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
      {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
      {{- '}\\n</tool_call>' }}
    {%- endfor %}
    {{- '<|im_end|>\\n' }}
  {%- elif message.role == 'tool' %}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
    {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


@pytest.fixture(scope="module")
def qwen3_tok(tmp_path_factory):
    """A Qwen3-style tokenizer: byte-level BPE, ChatML special tokens, <think> and the tool tags as added tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=[], show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = QWEN3_TEMPLATE
    path = tmp_path_factory.mktemp("qwen3")
    fast.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def think(reasoning: str, rest: str) -> str:
    return f"<think>\n{reasoning}\n</think>\n\n{rest}"


def bash(command: str) -> str:
    return '<tool_call>\n{"name": "bash", "arguments": {"command": "' + command + '"}}\n</tool_call>'


async def serve(tok, replies: list[str], body, **kw):
    """Run `body(proxy, session)` against a proxy whose scripted engine answers `replies`; the recorded calls."""
    engine = ScriptedEngine(tok)
    calls: list = []
    proxy = Proxy(engine, tok, on_call=calls.append, **kw)
    await proxy.start()
    try:
        s = proxy.open_session("r")
        engine.set_script("r", replies)
        await body(proxy, s)
    finally:
        await proxy.stop()
    return calls, proxy


# ---- the checkpoint says whether it reasons -------------------------------------------------------------------

def test_reasoning_markers_come_from_the_template(qwen3_tok, tokenizer):
    assert chat_format(qwen3_tok).reasoning == ("<think>", "</think>")
    assert chat_format(qwen3_tok).tool_format == "hermes"
    assert chat_format(tokenizer).reasoning is None  # the built-in template names no reasoning
    assert chat_format(tokenizer).with_reasoning("mistral").reasoning == ("[THINK]", "[/THINK]")
    assert chat_format(qwen3_tok).with_reasoning("none").reasoning is None
    with pytest.raises(ValueError, match="unknown reasoning style"):
        chat_format(tokenizer).with_reasoning("deep")


@pytest.mark.parametrize(("text", "opened", "reasoning", "rest"), [
    ("<think>\nplan\n</think>\n\nanswer", False, "plan", "answer"),
    ("plan</think>\n\nanswer", True, "plan", "answer"),  # the prompt wrote <think> (DeepSeek-R1, Qwen3-Thinking)
    ("<think>\nplan cut short", False, "plan cut short", ""),  # max_tokens inside the reasoning
    ("<think>\n\n</think>\n\nanswer", False, None, "answer"),  # an empty block (Qwen3's non-thinking mode)
    ("just an answer", False, None, "just an answer"),
])
def test_split_reasoning(text, opened, reasoning, rest):
    got = split_reasoning(text, ("<think>", "</think>"), opened=opened)
    assert (got.reasoning, got.rest) == (reasoning, rest)


def test_split_reasoning_without_markers_and_mistral_style():
    assert split_reasoning("<think>x</think>y", None).rest == "<think>x</think>y"
    got = split_reasoning("[THINK]plan[/THINK]answer", ("[THINK]", "[/THINK]"))
    assert (got.reasoning, got.rest) == ("plan", "answer")


def test_harmony_analysis_channel_is_reasoning():
    text = ("<|channel|>analysis<|message|>Look at the files first.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.bash <|constrain|>json<|message|>{"command": "ls"}')
    got = get_parser("harmony").parse(text, [BASH])
    assert got.reasoning == "Look at the files first." and [c.name for c in got.calls] == ["bash"]
    assert got.content is None


# ---- each wire format's own field, through the official SDKs -------------------------------------------------

REPLY = think("I should list the files.", bash("ls"))
ANSWER = think("Two files.", "There are two files.")


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reasoning_content(qwen3_tok, stream):
    got = {}

    async def body(proxy, s):
        c = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "List the files."}]
        for reply in range(2):
            if not stream:
                m = (await c.chat.completions.create(model="m", messages=msgs, tools=[BASH])).choices[0].message
                reasoning, content, calls = m.reasoning_content, m.content, m.tool_calls or []
                echo = m.model_dump(exclude_none=True)
            else:
                reasoning, content, by_index = "", "", {}
                async for ch in await c.chat.completions.create(model="m", messages=msgs, tools=[BASH], stream=True):
                    d = ch.choices[0].delta
                    reasoning += getattr(d, "reasoning_content", None) or ""
                    content += d.content or ""
                    for tc in d.tool_calls or []:
                        t = by_index.setdefault(tc.index, {"id": "", "type": "function",
                                                           "function": {"name": "", "arguments": ""}})
                        t["id"] += tc.id or ""
                        t["function"]["name"] += tc.function.name or ""
                        t["function"]["arguments"] += tc.function.arguments or ""
                calls = list(by_index.values())
                echo = {"role": "assistant", "content": content or None, "reasoning_content": reasoning}
                if calls:
                    echo["tool_calls"] = calls
            got[reply] = (reasoning, content or None, len(calls))
            msgs.append(echo)  # reasoning_content sent back: the template renders it, the chain continues
            if calls:
                msgs.append({"role": "tool", "tool_call_id": echo["tool_calls"][0]["id"], "content": "a.py b.py"})
        await c.close()

    calls, _ = asyncio.run(serve(qwen3_tok, [REPLY, ANSWER], body))
    assert got[0] == ("I should list the files.", None, 1)
    assert got[1] == ("Two files.", "There are two files.", 0)
    assert calls[1].parent_index == 0 and calls[1].segment_break is None
    assert calls[0].completion_text.startswith("<think>\nI should list the files.\n</think>")  # recorded as sampled
    check_fidelity(qwen3_tok, calls)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_reasoning_item(qwen3_tok, stream):
    got = {}

    async def body(proxy, s):
        c = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x", max_retries=0)
        tools = [{"type": "function", "name": "bash", "parameters": BASH["function"]["parameters"]}]
        inp: list = [{"role": "user", "content": "List the files."}]
        for reply in range(2):
            if stream:
                async with c.responses.stream(model="m", input=inp, tools=tools) as st:
                    deltas = [e.delta async for e in st if e.type == "response.reasoning_text.delta"]
                    r = await st.get_final_response()
                got[f"deltas{reply}"] = deltas
            else:
                r = await c.responses.create(model="m", input=inp, tools=tools)
            got[reply] = r.output
            inp += [o.model_dump(exclude_none=True) for o in r.output]  # reasoning items sent back
            for o in r.output:
                if o.type == "function_call":
                    inp.append({"type": "function_call_output", "call_id": o.call_id, "output": "a.py b.py"})
        await c.close()

    calls, _ = asyncio.run(serve(qwen3_tok, [REPLY, ANSWER], body))
    first, second = got[0], got[1]
    assert [o.type for o in first] == ["reasoning", "function_call"]
    assert isinstance(first[0], openai.types.responses.ResponseReasoningItem)
    assert first[0].content[0].text == "I should list the files." and first[0].summary == []
    assert [o.type for o in second] == ["reasoning", "message"]
    assert second[1].content[0].text == "There are two files."
    if stream:
        assert got["deltas0"] == ["I should list the files."]
    assert calls[1].parent_index == 0 and calls[1].segment_break is None
    check_fidelity(qwen3_tok, calls)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_block(qwen3_tok, stream):
    got = {}

    async def body(proxy, s):
        c = anthropic.AsyncAnthropic(base_url=proxy.anthropic_base_url(s.token), api_key="x", max_retries=0)
        tools = [{"name": "bash", "description": "Run a command", "input_schema": BASH["function"]["parameters"]}]
        msgs: list = [{"role": "user", "content": "List the files."}]
        for reply in range(2):
            if stream:
                async with c.messages.stream(model="m", max_tokens=500, messages=msgs, tools=tools) as st:
                    kinds = [e.delta.type async for e in st if e.type == "content_block_delta"]
                    r = await st.get_final_message()
                got[f"kinds{reply}"] = kinds
            else:
                r = await c.messages.create(model="m", max_tokens=500, messages=msgs, tools=tools)
            got[reply] = r.content
            msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
            uses = [b for b in r.content if b.type == "tool_use"]
            if uses:
                msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                          "content": "a.py b.py"}]})
        await c.close()

    calls, _ = asyncio.run(serve(qwen3_tok, [REPLY, ANSWER], body))
    first, second = got[0], got[1]
    assert [b.type for b in first] == ["thinking", "tool_use"]
    assert isinstance(first[0], anthropic.types.ThinkingBlock)
    assert first[0].thinking == "I should list the files." and first[0].signature
    assert [b.type for b in second] == ["thinking", "text"] and second[1].text == "There are two files."
    if stream:
        assert got["kinds0"][:2] == ["thinking_delta", "signature_delta"]
    assert calls[1].parent_index == 0 and calls[1].segment_break is None  # the thinking block went back in
    check_fidelity(qwen3_tok, calls)


@pytest.mark.parametrize("stream", [False, True])
def test_gemini_thought_part(qwen3_tok, stream):
    got = {}
    decl = types.Tool(function_declarations=[types.FunctionDeclaration(
        name="bash", description="Run a command", parameters_json_schema=BASH["function"]["parameters"])])
    cfg = types.GenerateContentConfig(tools=[decl], automatic_function_calling=types.AutomaticFunctionCallingConfig(
        disable=True))

    async def body(proxy, s):
        c = genai.Client(api_key="x", http_options=types.HttpOptions(base_url=proxy.gemini_base_url(s.token)))
        contents = [types.Content(role="user", parts=[types.Part(text="List the files.")])]
        for reply in range(2):
            if stream:
                parts = [p for ch in [x async for x in await c.aio.models.generate_content_stream(
                    model="m", contents=contents, config=cfg)] for p in ch.candidates[0].content.parts]
            else:
                r = await c.aio.models.generate_content(model="m", contents=contents, config=cfg)
                parts = r.candidates[0].content.parts
            got[reply] = parts
            contents.append(types.Content(role="model", parts=parts))  # thought parts sent back
            fcs = [p.function_call for p in parts if p.function_call]
            if fcs:
                contents.append(types.Content(role="user", parts=[types.Part.from_function_response(
                    name="bash", response={"output": "a.py b.py"})]))

    calls, _ = asyncio.run(serve(qwen3_tok, [REPLY, ANSWER], body))
    first, second = got[0], got[1]
    assert first[0].thought is True and first[0].text == "I should list the files."
    assert first[1].function_call.name == "bash"
    assert second[0].thought is True and second[1].text == "There are two files." and not second[1].thought
    assert calls[1].parent_index == 0 and calls[1].segment_break is None
    check_fidelity(qwen3_tok, calls)


def test_a_model_without_reasoning_markers_is_unchanged(tokenizer):
    """The built-in template names no reasoning: a <think> the model writes stays in the content."""
    got = {}

    async def body(proxy, s):
        c = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x", max_retries=0)
        m = (await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])).choices[0]
        got["msg"] = m.message
        await c.close()

    asyncio.run(serve(tokenizer, ["<think>x</think> hello"], body))
    assert got["msg"].content == "<think>x</think> hello"
    assert getattr(got["msg"], "reasoning_content", None) is None


# ---- the token bridge when the template drops past reasoning ---------------------------------------------------

SESSION = [think("I should list the files.", bash("ls")), think("Now the tests.", bash("pytest -q")),
           think("They pass.", "The tests pass."),  # an answer: the harness then sends a new user message
           think("Check the tree.", bash("git status")), think("Clean.", "Done.")]


async def chat_session(proxy, s, send_reasoning: bool) -> None:
    """A tool session over Chat: tool results for each call, a new user message after an answer; streaming
    every other call; the harness sends each reply's reasoning back or not."""
    c = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x", max_retries=0)
    msgs: list = [{"role": "system", "content": "You are a coding agent."},
                  {"role": "user", "content": "Run the tests."}]
    for turn in range(len(SESSION)):
        m = (await c.chat.completions.create(model="m", messages=msgs, tools=[BASH])).choices[0].message
        echo = m.model_dump(exclude_none=True)
        if not send_reasoning:
            echo.pop("reasoning_content")
        msgs.append(echo)
        if m.tool_calls:
            msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": f"output {turn}"})
        else:
            msgs.append({"role": "user", "content": "Anything else?"})
    await c.close()


def rendered(tok, call) -> str:
    return tok.decode(call.prompt_ids, skip_special_tokens=False)


def test_template_drops_past_reasoning_after_a_new_user_message(qwen3_tok):
    """Reasoning sent back: the tool loop bridges (the template keeps reasoning after the last user message);
    the call after the new user message starts a new segment, its prompt the template's render (without the
    earlier reasoning), never the sampled reasoning re-tokenized; every sampled token stays trainable."""
    calls, proxy = asyncio.run(serve(qwen3_tok, SESSION, lambda p, s: chat_session(p, s, True)))
    assert [c.parent_index for c in calls] == [None, 0, 1, None, 3]
    assert [c.segment_break for c in calls] == [None, None, None, REASONING_DROPPED, None]
    after = rendered(qwen3_tok, calls[3])
    assert "I should list the files." not in after and "They pass." not in after  # dropped, as the template does
    assert "<tool_call>" in after and "Anything else?" in after
    assert "<think>\nNow the tests.\n</think>" in rendered(qwen3_tok, calls[2])  # kept inside the tool loop
    check_fidelity(qwen3_tok, calls)
    stats = proxy.stats()
    assert stats["reasoning_dropped"] == 1 and stats["reasoning_dropped_share"] == pytest.approx(1 / 5)
    assert stats["chat_format"]["reasoning"] == ["<think>", "</think>"]


def test_reasoning_not_sent_back_starts_a_segment_each_call(qwen3_tok):
    """A harness that drops reasoning_content: the template renders each earlier turn without it, so no prompt
    extends its parent's tokens; each call is a new segment with the reason (none bridged silently)."""
    calls, proxy = asyncio.run(serve(qwen3_tok, SESSION, lambda p, s: chat_session(p, s, False)))
    assert [c.parent_index for c in calls] == [None] * 5
    assert [c.segment_break for c in calls] == [None] + [REASONING_DROPPED] * 4
    for c in calls[1:]:  # the prompt is the template's render of the conversation as sent
        assert "<think>" not in rendered(qwen3_tok, c).split("<|im_start|>assistant\n")[1]
    check_fidelity(qwen3_tok, calls)
    assert proxy.stats()["reasoning_dropped"] == 4


def test_fast_reply_end_does_not_bridge_over_dropped_reasoning(qwen3_tok):
    """Once the fast way of finding the parent's reply is trusted (3 verified bridges), a parent whose prompt is
    still a prefix of the new render (a first call, then a user message) must not be bridged with its
    reasoning kept: the check runs before either way."""

    async def body(proxy, s):
        c = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="x", max_retries=0)
        msgs: list = [{"role": "user", "content": "Run the tests."}]
        for turn in range(5):  # 4 bridged tool calls: the fast way is trusted after them
            m = (await c.chat.completions.create(model="m", messages=msgs, tools=[BASH])).choices[0].message
            msgs += [m.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": f"output {turn}"}]
        second = proxy.open_session("r2")
        c2 = openai.AsyncOpenAI(base_url=proxy.openai_base_url(second.token), api_key="x", max_retries=0)
        proxy.default_engine.set_script("r2", [think("Greet back.", "Hello."), "Fine."])
        chat = [{"role": "user", "content": "Hi"}]
        m = (await c2.chat.completions.create(model="m", messages=chat)).choices[0].message
        chat += [m.model_dump(exclude_none=True), {"role": "user", "content": "How are you?"}]
        await c2.chat.completions.create(model="m", messages=chat)
        await c.close()
        await c2.close()

    replies = [think(f"Step {i}.", bash(f"echo {i}")) for i in range(5)]
    calls, _ = asyncio.run(serve(qwen3_tok, replies, body))
    assert [c.parent_index for c in calls[:5]] == [None, 0, 1, 2, 3]  # 4 bridges: the first 3 verify the fast way
    last = calls[-1]
    assert last.rollout_id == "r2" and last.parent_index is None and last.segment_break == REASONING_DROPPED
    assert "Greet back." not in rendered(qwen3_tok, last)
    check_fidelity(qwen3_tok, calls)


def test_report_counts_reasoning_dropped(qwen3_tok, tmp_path):
    from legorl.store import Store

    store = Store(tmp_path / "store.sqlite")
    calls, _ = asyncio.run(serve(qwen3_tok, SESSION, lambda p, s: chat_session(p, s, True)))
    for c in calls:
        store.add_call(c)
    fid = store.report(lambda ids: qwen3_tok.decode(ids, skip_special_tokens=False))["fidelity"]
    assert fid["violations"] == 0 and fid["reasoning_dropped"] == 1
    assert fid["reasoning_dropped_share"] == pytest.approx(1 / 5)
    assert json.dumps(fid)  # JSON as `legorl report --json` prints it
