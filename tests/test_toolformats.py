"""Tool-call formats of the major families (models/toolformats): parsing, round trips, auto-detection, malformed calls.

Each family's completions are written as its chat template and its model write them (single call, two calls,
text before the call, reasoning where the family has it), and a malformed call must come back as text *and*
say it is malformed. The round trips render an assistant tool-call message with a template written here from
the family's documented tool-call syntax (the role markup is ChatML's for all but gpt-oss: only the calls
matter), on a tokenizer built on the spot, and parse the rendered assistant text back. No downloads.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import typing

import openai
import pytest
from families import DETECTED, FAMILIES, build_tokenizer
from transformers import PreTrainedTokenizerFast

from legorl.config import ToolFormat
from legorl.engine import ScriptedEngine
from legorl.models.chat_format import TEMPLATE, chat_format
from legorl.models.toolformats import PARSERS, detect_tool_format, get_parser, parser_names
from legorl.proxy.server import Proxy
from legorl.store import _SCHEMA, Store

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "string"}},
    "required": ["command"]}}}
WRITE = {"type": "function", "function": {"name": "write", "description": "Write a file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "mode": {"type": "integer"}}}}}
TOOLS = [BASH, WRITE]
LS = ("bash", {"command": "ls -la"})
READ = ("bash", {"command": "cat README.md"})


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


# ---- parsing realistic completions --------------------------------------------------------------------------
# (format, completion text, content, calls); calls None: malformed (the whole text is the content)
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds_v3(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"


def kimi(name: str, i: int, args: str) -> str:
    return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"


CASES = [
    # Hermes / Qwen
    ("hermes", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>', None, [LS]),
    ("hermes", ('<think>\nList first.\n</think>\n\nI will look.\n<tool_call>\n{"name": "bash", "arguments": '
               '{"command": "ls -la"}}\n</tool_call>\n<tool_call>\n{"name": "bash", "arguments": {"command": '
               '"cat README.md"}}\n</tool_call>'), "<think>\nList first.\n</think>\n\nI will look.", [LS, READ]),
    ("hermes", '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}\n</tool_call>', None, None),
    ("hermes", 'Let me see.\n<tool_call>\n{"name": "bash", "arguments": {"comm', None, None),  # cut short
    ("hermes", "All tests pass.", "All tests pass.", []),
    # Qwen3-Coder
    ("qwen3_coder", ("<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n"
                    "</tool_call>"), None, [LS]),
    ("qwen3_coder", ("I will look.\n<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=bash>\n<parameter=command>\ncat README.md\n"
                    "</parameter>\n</function>\n</tool_call>"), "I will look.", [LS, READ]),
    ("qwen3_coder", "<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</tool_call>",
     None, None),
    # Llama 3
    ("llama3_json", '{"name": "bash", "parameters": {"command": "ls -la"}}', None, [LS]),
    ("llama3_json", ('I will look.<|python_tag|>{"name": "bash", "parameters": {"command": "ls -la"}}; '
                    '{"name": "bash", "arguments": {"command": "cat README.md"}}'), "I will look.", [LS, READ]),
    ("llama3_json", '{"name": "bash", "parameters": {"command": "ls -la"}', None, None),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', None, None),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # a JSON answer, not a call
    # Mistral, both forms
    ("mistral", '[TOOL_CALLS]bash[ARGS]{"command": "ls -la"}', None, [LS]),
    ("mistral", ('[THINK]List first.[/THINK]I will look.[TOOL_CALLS]bash[ARGS]{"command": "ls -la"}'
                '[TOOL_CALLS]bash[ARGS]{"command": "cat README.md"}'), "[THINK]List first.[/THINK]I will look.",
     [LS, READ]),
    ("mistral", '[TOOL_CALLS]bash[CALL_ID]a1b2c3d4e[ARGS]{"command": "ls -la"}', None, [LS]),
    ("mistral", ('[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls -la"}}, {"name": "bash", '
                '"arguments": {"command": "cat README.md"}}]'), None, [LS, READ]),
    ("mistral", '[TOOL_CALLS]bash[ARGS]{"command": "ls -la"', None, None),
    ("mistral", '[TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls -la"}}', None, None),
    # DeepSeek V3 / R1 and V3.1
    ("deepseek", DS_BEGIN + ds_v3("bash", '{"command": "ls -la"}') + DS_END, None, [LS]),
    ("deepseek", "<think>\nList first.\n</think>\n\nI will look." + DS_BEGIN + ds_v3("bash", '{"command": "ls -la"}')
     + "\n" + ds_v3("bash", '{"command": "cat README.md"}') + DS_END,
     "<think>\nList first.\n</think>\n\nI will look.", [LS, READ]),
    ("deepseek", DS_BEGIN + '<｜tool▁call▁begin｜>bash<｜tool▁sep｜>{"command": "ls -la"}<｜tool▁call▁end｜>' + DS_END,
     None, [LS]),
    ("deepseek", DS_BEGIN + ds_v3("bash", '{"command": "ls -la"}') + '<｜tool▁call▁begin｜>function<｜tool▁sep｜>bash'
     '\n```json\n{"comm', None, None),
    # GLM-4.5
    ("glm45", "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls -la</arg_value>\n</tool_call>", None,
     [LS]),
    ("glm45", ("<think>List first.</think>\nI will look.\n<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>"
              "ls -la</arg_value>\n</tool_call>\n<tool_call>bash<arg_key>command</arg_key><arg_value>cat README.md"
              "</arg_value></tool_call>"), "<think>List first.</think>\nI will look.", [LS, READ]),
    ("glm45", "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls -la\n</tool_call>", None, None),
    # Kimi-K2
    ("kimi_k2", "<|tool_calls_section_begin|>" + kimi("bash", 0, '{"command": "ls -la"}')
     + "<|tool_calls_section_end|>", None, [LS]),
    ("kimi_k2", "<think>List first.</think>I will look.<|tool_calls_section_begin|>" + kimi("bash", 0, '{"command": '
     '"ls -la"}') + kimi("bash", 1, '{"command": "cat README.md"}') + "<|tool_calls_section_end|>",
     "<think>List first.</think>I will look.", [LS, READ]),
    ("kimi_k2", ('<|tool_calls_section_begin|><|tool_call_begin|>functions.bash:0<|tool_call_argument_begin|>'
                '{"command": "ls -la"}'), None, None),
    # gpt-oss harmony (the closing <|call|> / <|return|> is a stop token: usually not in the text)
    ("harmony", ("<|channel|>analysis<|message|>List first.<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.bash <|constrain|>json<|message|>{"command": "ls -la"}'), None, [LS]),
    ("harmony", ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>All tests "
                "pass."), "All tests pass.", []),
    ("harmony", ("<|channel|>commentary<|message|>I will look.<|end|><|start|>assistant to=functions.bash"
                '<|channel|>commentary json<|message|>{"command": "ls -la"}<|call|>'), "I will look.", [LS]),
    ("harmony", "<|channel|>commentary to=functions.bash <|constrain|>json<|message|>{\"command\": ", None, None),
    ("harmony", ("<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>analysis "
                'to=browser.search<|message|>{"query": "x"}'), None, None),  # a built-in tool nobody offered
    ("harmony", ("<|channel|>analysis<|message|>List first.<|end|><|start|>assistant<|channel|>commentary "
                "to=functions.bash <|constrain|>json"), None, None),  # header cut short
    # MiniMax-M2
    ("minimax_m2", ('<minimax:tool_call>\n<invoke name="bash">\n<parameter name="command">ls -la</parameter>\n'
                   '</invoke>\n</minimax:tool_call>'), None, [LS]),
    ("minimax_m2", ('<think>\nList first.\n</think>\n\nI will look.\n<minimax:tool_call>\n<invoke name="bash">\n'
                   '<parameter name="command">ls -la</parameter>\n</invoke>\n<invoke name="bash">\n<parameter '
                   'name="command">cat README.md</parameter>\n</invoke>\n</minimax:tool_call>'),
     "<think>\nList first.\n</think>\n\nI will look.", [LS, READ]),
    ("minimax_m2", ('<minimax:tool_call>\n<invoke name="bash">\n<parameter name="command">ls -la</parameter>\n'
                   '</minimax:tool_call>'), None, None),
]


@pytest.mark.parametrize("fmt,text,content,calls", CASES)
def test_parse_realistic_completions(fmt, text, content, calls):
    parsed = get_parser(fmt).parse(text, TOOLS)
    if calls is None:  # malformed: answered as the whole text, and said so
        assert parsed.calls == [] and parsed.content == text and parsed.malformed
    else:
        assert calls_of(parsed) == calls and parsed.content == content and parsed.malformed is None
        assert len({c.id for c in parsed.calls}) == len(calls)


def test_tag_parameters_are_typed_by_the_tool_schema():
    """A string parameter stays text even when it reads as JSON (a JSON file's content, a number as text);
    without a schema, values that are JSON are read as JSON."""
    text = ("<tool_call>\n<function=write>\n<parameter=path>\na.json\n</parameter>\n<parameter=content>\n"
            '{"a": 1}\n</parameter>\n<parameter=mode>\n420\n</parameter>\n</function>\n</tool_call>')
    assert calls_of(get_parser("qwen3_coder").parse(text, TOOLS)) == [
        ("write", {"path": "a.json", "content": '{"a": 1}', "mode": 420})]
    assert calls_of(get_parser("qwen3_coder").parse(text)) == [
        ("write", {"path": "a.json", "content": {"a": 1}, "mode": 420})]


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tool-call format 'nope'; choose one of auto, tagged, .*minimax_m2"):
        get_parser("nope")


def test_the_config_offers_exactly_the_formats_there_are():
    """config.py (the ground floor) lists the names itself: every name it offers has a parser, and back."""
    assert list(typing.get_args(ToolFormat)) == parser_names()


# ---- round trips: a template written from the family's documented format ------------------------------------

@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerFast]:
    return {name: build_tokenizer(template, special) for name, (template, special, _, _) in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_the_familys_template(family, tokenizers):
    tok = tokenizers[family]
    _, _, closer, several = FAMILIES[family]
    calls = [("bash", {"command": "ls -la", "timeout": "30"}),  # a string parameter that reads as a number
             ("write", {"path": "a.json", "content": '{"a": [1, 2]}\n', "mode": 420})][: 2 if several else 1]
    content = "I will look." if several else None
    user = {"role": "user", "content": "Fix the tests."}
    reply = {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
        for i, (n, a) in enumerate(calls)]}
    prompt = tok.apply_chat_template([user], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template([user, reply], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt)
    sampled = full[len(prompt):].rstrip("\n").removesuffix(closer)  # the closing stop token is not parsed
    parsed = get_parser(DETECTED.get(family, family)).parse(sampled, TOOLS)
    assert parsed.malformed is None, parsed.malformed
    assert calls_of(parsed) == calls
    assert parsed.content == content


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_format_is_read_from_the_checkpoint(family, tokenizers):
    fmt = chat_format(tokenizers[family])
    assert fmt.tools == TEMPLATE and fmt.tool_format == DETECTED.get(family, family)
    assert fmt.summary()["tool_format"] == fmt.tool_format


def test_detection_order_and_fallbacks(tokenizer):
    # GLM-4.5 and Qwen3-Coder write <tool_call> too: their own markers win
    assert detect_tool_format("<tool_call>{{ name }}<arg_key>") == "glm45"
    assert detect_tool_format("<tool_call>\n<function=") == "qwen3_coder"
    assert detect_tool_format("<|python_tag|>") == "llama3_json"
    assert detect_tool_format("no markers", ["[TOOL_CALLS]", "</s>"]) == "mistral"  # a special token tells
    assert detect_tool_format("no markers", ["<|im_end|>"]) is None
    assert chat_format(tokenizer).tool_format == "hermes"  # the built-in template writes Hermes <tool_call> JSON
    assert set(DETECTED.values()) | set(FAMILIES) - set(DETECTED) <= set(PARSERS)


# ---- malformed calls through the proxy, recorded and counted -----------------------------------------------

def test_malformed_call_is_answered_as_text_recorded_and_counted(tokenizers, tmp_path):
    tok = tokenizers["deepseek"]
    broken = "Let me look." + DS_BEGIN + ds_v3("bash", '{"command": "ls -la"') + DS_END  # a brace short
    good = DS_BEGIN + ds_v3("bash", '{"command": "ls -la"}') + DS_END

    async def main():
        engine = ScriptedEngine(tok)
        engine.set_script("r", [broken, good])
        calls: list = []
        proxy = Proxy(engine, tok, on_call=calls.append)  # the tool format: auto, the checkpoint's (deepseek)
        await proxy.start()
        try:
            s = proxy.open_session("r")
            client = openai.AsyncOpenAI(base_url=proxy.openai_base_url(s.token), api_key="unused", max_retries=0)
            msgs = [{"role": "user", "content": "Fix it."}]
            first = await client.chat.completions.create(model="m", messages=msgs, tools=[BASH])
            msgs += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
            second = await client.chat.completions.create(model="m", messages=msgs, tools=[BASH])
            await client.close()
            return first, second, calls, proxy.stats()
        finally:
            await proxy.stop()

    first, second, calls, stats = asyncio.run(main())
    assert first.choices[0].finish_reason == "stop" and not first.choices[0].message.tool_calls
    assert first.choices[0].message.content == broken  # the harness gets the text
    assert second.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in second.choices[0].message.tool_calls] == [LS]
    assert calls[0].malformed_tool_call and "does not parse" in calls[0].malformed_tool_call
    assert calls[1].malformed_tool_call is None and calls[0].tool_calls == []
    assert stats["malformed_tool_calls"] == 1 and stats["tool_format"] == "deepseek"
    assert tok.decode(calls[0].completion_ids, skip_special_tokens=False) == calls[0].completion_text  # as sampled
    with Store(tmp_path / "store.sqlite") as store:
        for c in calls:
            store.add_call(c)
        assert [c.malformed_tool_call for c in store.calls_for("r")] == [calls[0].malformed_tool_call, None]


def test_a_store_from_before_gets_the_malformed_column(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(_SCHEMA.replace(",\n    malformed_tool_call TEXT", ""))
    conn.execute("INSERT INTO llm_calls (rollout_id, idx, finish_reason, weight_version) VALUES ('r', 0, 'stop', 0)")
    conn.commit()
    assert "malformed_tool_call" not in {r[1] for r in conn.execute("PRAGMA table_info(llm_calls)")}
    conn.close()
    with Store(path) as store:
        (old,) = store.calls_for("r")
        assert old.malformed_tool_call is None


def test_proxy_and_config_refuse_an_unknown_format(tokenizer, tmp_path):
    from typer.testing import CliRunner

    from legorl.cli import app
    from legorl.config import ModelConfig

    with pytest.raises(ValueError, match="unknown tool-call format 'nope'"):
        Proxy(ScriptedEngine(tokenizer), tokenizer, parser="nope")
    with pytest.raises(ValueError, match="Input should be 'auto', 'tagged', "):
        ModelConfig(tool_format="nope")
    assert ModelConfig().tool_format == "auto" and "auto" in parser_names()
    r = CliRunner().invoke(app, ["proxy", "--run-dir", str(tmp_path), "--parser", "nope"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "unknown tool-call format 'nope'" in r.output
