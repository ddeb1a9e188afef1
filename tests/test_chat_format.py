"""The chat format read from the checkpoint (models/chat_format.py), on tokenizers built on the spot.

- the built-in tokenizer reads exactly the constants the code used to hard-wire;
- a Llama 3 checkpoint (Llama 3.1's template, written from Meta's prompt format: ``<|begin_of_text|>``,
  ``<|start_header_id|>role<|end_header_id|>``, ``<|eot_id|>``, tools in the first user turn, tool
  results as ``ipython`` turns) goes through the proxy with the openai SDK, scripted and on a tiny
  random ``LlamaForCausalLM``;
- a template that ignores tools (SmolLM2-135M-Instruct's ChatML) gets legorl's own tool section;
- a checkpoint without a template is a start-up error naming the file and the fix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path

import openai
import pytest
import torch
from families import SMOLLM2_TEMPLATE
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from typer.testing import CliRunner

from legorl.engine import LocalEngine, ScriptedEngine
from legorl.engine.local import default_stop_ids
from legorl.models import IM_END, PAD, build_model, load_model, load_tokenizer, render_tool_call_text
from legorl.models.chat_format import LEGORL, TEMPLATE, ChatFormatError, chat_format
from legorl.proxy.bridge import TokenBridge
from legorl.proxy.server import Proxy, SamplingOverride
from legorl.proxy.wire import WireFormat
from legorl.records import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---- tokenizers and checkpoints built on the spot -------------------------------------------------------

# Llama 3.1 Instruct's template: Meta's documented prompt format (llama-models, "Llama 3.1" prompt format:
# JSON tool calling, custom tools in the first user message, tool results in `ipython` turns, <|eom_id|> in
# built-in-tool mode), in the form the Llama 3.1 Instruct checkpoints ship it.
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools_in_user_message and not tools is none %}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]

_CORPUS = ["You are a coding agent. List the files, then read README.md and run the tests.",
           '{"name": "bash", "parameters": {"command": "ls -la"}}', "Environment: ipython\nCutting Knowledge Date",
           "Given the following functions, please respond with a JSON for a function call",
           '<tool_call>\n{"name": "bash", "arguments": {"command": "cat README.md"}}\n</tool_call>'] * 10


def _bpe(special: list[str], vocab_size: int = 400) -> Tokenizer:
    """A small byte-level BPE (every string round-trips) with `special` as special added tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def _llama3_generation_config(path: Path, fast: PreTrainedTokenizerFast) -> None:
    """Llama 3.1 Instruct's generation config: a generation ends on <|end_of_text|>, <|eom_id|> or <|eot_id|>."""
    ids = fast.convert_tokens_to_ids
    GenerationConfig(bos_token_id=ids("<|begin_of_text|>"),
                     eos_token_id=[ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")]).save_pretrained(path)


def save_llama3_tokenizer(path: Path, template: str | None = LLAMA3_TEMPLATE) -> PreTrainedTokenizerFast:
    """A Llama 3.1 Instruct-style tokenizer (eos <|eot_id|>, no pad) and its generation_config.json."""
    fast = PreTrainedTokenizerFast(tokenizer_object=_bpe(LLAMA3_SPECIAL), bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", clean_up_tokenization_spaces=False, model_max_length=131072)
    fast.chat_template = template
    fast.save_pretrained(path)
    _llama3_generation_config(path, fast)
    return fast


def save_llama3_checkpoint(path: Path) -> None:
    """A tiny random LlamaForCausalLM (hidden 64, 2 layers) with the Llama 3 tokenizer."""
    fast = save_llama3_tokenizer(path)
    ids = fast.convert_tokens_to_ids
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      bos_token_id=ids("<|begin_of_text|>"),
                      eos_token_id=[ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")],
                      tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    _llama3_generation_config(path, fast)  # over the one save_pretrained derives from the config


def save_chatml_no_tools_tokenizer(path: Path) -> None:
    """A SmolLM2-135M-Instruct-style tokenizer: ChatML tokens, its template (which ignores tools)."""
    fast = PreTrainedTokenizerFast(tokenizer_object=_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]),
                                   bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   unk_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    fast.chat_template = SMOLLM2_TEMPLATE
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama3")
    save_llama3_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def llama_tok(llama_dir):
    return load_tokenizer(llama_dir)


@pytest.fixture(scope="module")
def smol_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("chatml-no-tools")
    save_chatml_no_tools_tokenizer(path)
    return load_tokenizer(path)


# ---- driving the proxy ------------------------------------------------------------------------------------

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def llama3_call(command: str) -> str:
    return json.dumps({"name": "bash", "parameters": {"command": command}})


async def ask(client: openai.AsyncOpenAI, messages: list[dict], stream: bool, **kw) -> tuple[dict, str]:
    """One Chat Completions call, streamed or not: the assistant message to echo back, and the finish reason."""
    if not stream:
        r = await client.chat.completions.create(model="m", messages=messages, **kw)
        return r.choices[0].message.model_dump(exclude_none=True), r.choices[0].finish_reason
    text, calls, finish = "", {}, None
    async for chunk in await client.chat.completions.create(model="m", messages=messages, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for tc in delta.tool_calls or []:
            c = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            c["id"] += tc.id or ""
            c["function"]["name"] += (tc.function.name or "") if tc.function else ""
            c["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    msg: dict = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = [calls[i] for i in sorted(calls)]
    return msg, finish


def check_fidelity(tok, calls) -> None:
    """0 violations: one logprob per id, decode(ids) == text, a continued call extends its parent's tokens."""
    by_index = {c.index: c for c in calls}
    for c in calls:
        assert len(c.completion_ids) == len(c.completion_logprobs) > 0
        assert tok.decode(c.completion_ids, skip_special_tokens=False) == c.completion_text
        if c.parent_index is not None:
            p = by_index[c.parent_index]
            assert c.prompt_ids[: len(p.prompt_ids) + len(p.completion_ids)] == p.prompt_ids + p.completion_ids


async def tool_session(proxy: Proxy, rollout_id: str, n_tool_turns: int, **kw) -> list[str]:
    """A coding session: a task, then tool results for every call the model makes, then 'go on' user turns;
    streaming every other call. Returns each call's finish reason."""
    s = proxy.open_session(rollout_id)
    client = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="unused", max_retries=0)
    msgs: list[dict] = [{"role": "system", "content": "You are a coding agent."},
                        {"role": "user", "content": "Run the tests and fix what fails."}]
    finishes = []
    for turn in range(n_tool_turns):
        msg, finish = await ask(client, msgs, stream=turn % 2 == 1, tools=[BASH], **kw)
        finishes.append(finish)
        msgs.append(msg)
        for tc in msg.get("tool_calls") or []:
            msgs.append({"role": "tool", "tool_call_id": tc["id"], "content": f"output of turn {turn}\nok"})
        if not msg.get("tool_calls"):
            msgs.append({"role": "user", "content": f"Go on ({turn})."})
    await client.close()
    return finishes


# ---- the built-in tokenizer: today's constants ---------------------------------------------------------------

def test_builtin_tokenizer_reads_todays_constants(tokenizer, tiny_spec):
    im_end, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    fmt = chat_format(tokenizer)
    assert (fmt.end_of_turn, fmt.end_of_turn_id, fmt.eos_id) == (IM_END, im_end, im_end)
    assert fmt.turn_end_ids == (im_end,) and fmt.stop_ids == (im_end, pad)  # the engine's old default list
    assert fmt.tools == TEMPLATE and fmt.missing == () and fmt.warning() is None
    bridge = TokenBridge(tokenizer)
    assert (bridge.eos_text, bridge.eos_id) == (IM_END, im_end)
    assert WireFormat(tokenizer).turn_end_ids == {im_end}
    assert ScriptedEngine(tokenizer).stop_ids == {im_end, pad}
    assert default_stop_ids(build_model(tiny_spec, tokenizer), tokenizer) == [im_end, pad]


def test_legorl_tool_rendering_is_the_builtin_templates(tokenizer):
    """legorl's own tool rendering (for templates without tools) writes exactly what the built-in template does."""
    own = TokenBridge(tokenizer, dataclasses.replace(chat_format(tokenizer), tools=LEGORL))
    builtin = TokenBridge(tokenizer)
    call = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    convo = [{"role": "system", "content": "sys"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "Let me look.", "tool_calls": [call, call]},
             {"role": "tool", "tool_call_id": "c1", "content": "a.py"}, {"role": "tool", "tool_call_id": "c1",
                                                                           "content": "b.py"},
             {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "more"}]
    for k in range(1, len(convo) + 1):
        for tools in ([BASH], None):
            for gp in (True, False):
                assert own.render(convo[:k], tools, gp) == builtin.render(convo[:k], tools, gp)
    assert own.render(convo[1:3], [BASH], True) == builtin.render(convo[1:3], [BASH], True)  # no system message


# ---- Llama 3 --------------------------------------------------------------------------------------------------

def test_llama3_format_from_the_checkpoint(llama_dir, llama_tok):
    ids = llama_tok.convert_tokens_to_ids
    fmt = chat_format(llama_tok)
    assert (fmt.end_of_turn, fmt.end_of_turn_id, fmt.eos_id) == ("<|eot_id|>", ids("<|eot_id|>"), ids("<|eot_id|>"))
    # generation_config.json adds <|end_of_text|> and <|eom_id|>; the tokenizer has no pad token
    assert fmt.turn_end_ids == fmt.stop_ids == (ids("<|eot_id|>"), ids("<|end_of_text|>"), ids("<|eom_id|>"))
    assert fmt.tools == TEMPLATE and fmt.missing == ()
    assert fmt.source == str(llama_dir / "chat_template.jinja")


def test_llama3_scripted_tool_session_through_the_proxy(llama_tok):
    """5 calls (4 tool calls in Llama 3's own JSON syntax, then an answer), streamed every other call: every
    continued call bridged, the template's re-render equal to the bridged tokens, 0 violations."""
    eot = llama_tok.convert_tokens_to_ids("<|eot_id|>")
    replies = [llama3_call("ls"), llama3_call("cat README.md"), llama3_call("pytest -q"),
               llama3_call("sed -i s/a/b/ x.py"), "Fixed: the tests pass."]

    async def main():
        engine = ScriptedEngine(llama_tok)
        engine.set_script("r", replies)
        calls: list = []
        proxy = Proxy(engine, llama_tok, on_call=calls.append)  # the checkpoint's tool format: llama3_json
        await proxy.start()
        try:
            finishes = await tool_session(proxy, "r", len(replies))
        finally:
            await proxy.stop()
        return calls, finishes

    calls, finishes = asyncio.run(main())
    assert finishes == ["tool_calls"] * 4 + ["stop"]
    assert [c.parent_index for c in calls] == [None, 0, 1, 2, 3]
    assert all(c.segment_break is None for c in calls[1:])
    assert not any(c.naive_prompt_differs for c in calls)  # the template renders the echoed calls as sampled
    assert all(c.completion_ids[-1] == eot for c in calls)
    check_fidelity(llama_tok, calls)
    first = llama_tok.decode(calls[0].prompt_ids, skip_special_tokens=False)
    assert first.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython")
    assert '"name": "bash"' in first and first.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    last = llama_tok.decode(calls[-1].prompt_ids, skip_special_tokens=False)
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"output of turn 3\\nok"<|eot_id|>' in last


def test_llama3_checkpoint_through_the_proxy_and_engine(llama_dir, llama_tok):
    """The tiny random Llama through LocalEngine + proxy (this crashed TokenBridge.__init__ before): a tool
    conversation over the openai SDK, streamed and not, continued calls bridged, 0 violations, and
    generation stops on the checkpoint's turn ends, <|eot_id|> among them."""
    model, tok = load_model(llama_dir)
    fmt = chat_format(tok)
    eot = tok.convert_tokens_to_ids("<|eot_id|>")

    async def main():
        engine = LocalEngine(model, tok, max_context=4096, max_batch=2)
        assert engine.stop_token_ids == list(fmt.stop_ids)
        calls: list = []
        proxy = Proxy(engine, tok, on_call=calls.append, sampling=SamplingOverride(max_tokens=400))
        await proxy.start()
        try:
            finishes = await tool_session(proxy, "r", 4)
            stats = proxy.stats()
            ends = []
            for seed in range(12):  # a random model: which turn end comes first depends on the sample
                r = await engine.generate(calls[0].prompt_ids, SamplingParams(max_tokens=1500, seed=seed))
                ends.append(r.completion_ids[-1] if r.finish_reason == "stop" else None)
                assert not set(r.completion_ids[:-1]) & set(fmt.stop_ids)
        finally:
            await proxy.stop()
            await engine.close()
        return calls, finishes, stats, ends

    calls, finishes, stats, ends = asyncio.run(main())
    assert len(calls) == 4 and [c.parent_index for c in calls] == [None, 0, 1, 2]
    check_fidelity(tok, calls)
    assert stats["chat_format"] == {"end_of_turn": "<|eot_id|>", "stop_ids": list(fmt.stop_ids), "tools": TEMPLATE,
                                    "missing": [], "tool_format": "llama3_json", "reasoning": None}
    for c, finish in zip(calls, finishes, strict=True):  # stopped on a turn end, or cut at max_tokens
        assert (c.completion_ids[-1] in fmt.turn_end_ids) == (c.finish_reason == "stop")
        assert finish == ("stop" if c.finish_reason == "stop" else "length")
    assert all(e in fmt.turn_end_ids for e in ends) and eot in ends


# ---- a template without tools (SmolLM2's) ---------------------------------------------------------------------

def test_template_without_tools_gets_legorls_tool_section(smol_tok, caplog):
    fmt = chat_format(smol_tok)
    im_end = smol_tok.convert_tokens_to_ids(IM_END)
    assert (fmt.end_of_turn, fmt.turn_end_ids, fmt.stop_ids) == (IM_END, (im_end,), (im_end,))
    assert fmt.tools == LEGORL and fmt.missing == ("a tool list", "tool calls")
    replies = [render_tool_call_text("bash", {"command": "ls"}),
               "Reading it.\n" + render_tool_call_text("bash", {"command": "cat README.md"}),
               render_tool_call_text("bash", {"command": "pytest -q"}), "All tests pass."]

    async def main():
        engine = ScriptedEngine(smol_tok)
        engine.set_script("r", replies)
        calls: list = []
        with caplog.at_level(logging.WARNING, logger="legorl.proxy"):
            proxy = Proxy(engine, smol_tok, on_call=calls.append)  # the default parser: tagged
        await proxy.start()
        try:
            finishes = await tool_session(proxy, "r", len(replies))
            stats = proxy.stats()
        finally:
            await proxy.stop()
        return calls, finishes, stats

    calls, finishes, stats = asyncio.run(main())
    assert "does not render a tool list and tool calls: legorl renders" in caplog.text and "<tools></tools>" in caplog.text
    assert stats["chat_format"]["tools"] == LEGORL
    assert finishes == ["tool_calls"] * 3 + ["stop"]
    assert [c.parent_index for c in calls] == [None, 0, 1, 2]
    assert not any(c.naive_prompt_differs for c in calls)
    check_fidelity(smol_tok, calls)
    first = smol_tok.decode(calls[0].prompt_ids, skip_special_tokens=False)
    assert first.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")  # Qwen2.5's order
    assert '"name": "bash"' in first and "<tool_call></tool_call> XML tags" in first
    last = smol_tok.decode(calls[-1].prompt_ids, skip_special_tokens=False)
    assert ("<|im_start|>assistant\nReading it.\n<tool_call>\n" in last
            and "<|im_start|>user\n<tool_response>\noutput of turn 2\nok\n</tool_response><|im_end|>\n" in last)


# ---- no template ----------------------------------------------------------------------------------------------

def test_checkpoint_without_template_is_a_clear_startup_error(tmp_path):
    save_llama3_tokenizer(tmp_path / "tok", template=None)
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.chat_template is None  # not silently ChatML: that is the built-in tokenizer's fallback only
    with pytest.raises(ChatFormatError) as e:
        chat_format(tok)
    msg = str(e.value)
    assert f"{tmp_path / 'tok'} has no chat template" in msg
    assert str(tmp_path / "tok" / "chat_template.jinja") in msg and "Fix:" in msg
    with pytest.raises(ChatFormatError):
        ScriptedEngine(tok)

    from legorl.cli import app

    r = CliRunner().invoke(app, ["proxy", "--engine", "scripted", "--model", str(tmp_path / "tok"),
                                 "--run-dir", str(tmp_path / "run"), "--port", "0"])
    out = r.output  # stdout and stderr
    assert r.exit_code == 2, out
    assert "has no chat template" in out and "chat_template.jinja" in out and "Traceback" not in out


def test_template_without_an_end_of_turn_token_is_an_error(tmp_path):
    save_llama3_tokenizer(tmp_path, template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}")
    with pytest.raises(ChatFormatError, match="closes an assistant turn with '\\\\n\\\\nuser: '"):
        chat_format(load_tokenizer(tmp_path))


def test_only_the_builtin_tokenizer_falls_back_to_the_builtin_template(tokenizer, tmp_path):
    from legorl.models.chat_template import CHAT_TEMPLATE

    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()  # a copy saved before tokenizers saved their template
    assert load_tokenizer(tmp_path).chat_template == CHAT_TEMPLATE
