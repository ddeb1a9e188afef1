"""Built-in tokenizer (determinism, byte round-trip, chat template contract) and tiny model recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from legorl.models import (
    IM_END,
    IM_START,
    PAD,
    TOOL_TOKENS,
    ModelSpec,
    build_model,
    build_tokenizer,
    load_model,
    load_or_build,
    render_tool_call_text,
    save_model,
)
from legorl.models.chat_template import CHAT_TEMPLATE, chat_template
from legorl.models.corpus import generate_corpus

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def tok(cache: Path):
    return build_tokenizer(cache)


def render(tok, messages, tools=None, gen=False) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)


def test_corpus_is_seeded() -> None:
    assert generate_corpus(20, seed=3) == generate_corpus(20, seed=3)
    assert generate_corpus(20, seed=3) != generate_corpus(20, seed=4)


def test_tokenizer_is_deterministic_and_cached(tmp_path: Path, tok) -> None:
    a = build_tokenizer(tmp_path / "a")
    b = build_tokenizer(tmp_path / "b")
    ja = json.loads((next((tmp_path / "a").glob("tokenizer-*")) / "tokenizer.json").read_text())
    jb = json.loads((next((tmp_path / "b").glob("tokenizer-*")) / "tokenizer.json").read_text())
    assert ja["model"]["vocab"] == jb["model"]["vocab"]
    assert ja["model"]["merges"] == jb["model"]["merges"]
    assert a.get_vocab() == b.get_vocab() == tok.get_vocab()
    assert len(a) > 1000  # actually learned merges, not just bytes
    # Second build loads the cached files instead of retraining (same directory, same object content).
    again = build_tokenizer(tmp_path / "a")
    assert len(list((tmp_path / "a").iterdir())) == 1
    assert again.get_vocab() == a.get_vocab() and again.chat_template == a.chat_template


def test_special_and_tool_tokens_are_single_ids(tok) -> None:
    ids = {}
    for t in [PAD, IM_START, IM_END, *TOOL_TOKENS]:
        enc = tok.encode(t, add_special_tokens=False)
        assert len(enc) == 1, t
        ids[t] = enc[0]
    assert len(set(ids.values())) == len(ids)
    assert tok.pad_token_id == ids[PAD] and tok.eos_token_id == ids[IM_END]
    assert set(tok.all_special_tokens) >= {PAD, IM_START, IM_END}
    assert not set(TOOL_TOKENS) & set(tok.all_special_tokens)
    # Tool tokens are not special: skipping special tokens keeps them and drops <|im_end|>.
    text = "<tool_call>\nx\n</tool_call><|im_end|>"
    assert (
        tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True)
        == "<tool_call>\nx\n</tool_call>"
    )
    # Compression sanity: agent-ish text costs well under one token per byte.
    code = "def compute_total(items: list[int]) -> int:\n    return sum(items)\n"
    assert len(tok.encode(code, add_special_tokens=False)) < len(code.encode()) / 2


NASTY = [
    "",
    " ",
    "\n\n\n",
    "\t  \t",
    "héllo wörld",
    "日本語のテキスト",
    "🤖🔥👨‍👩‍👧",
    "\x00\x01\x7f",
    "\u200b\ufeff",
    "a<|im_end|>b",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<tool_call>{}</tool_call>",
    "  leading",
    "trailing  ",
    "\r\n",
    "Ω≈ç√∫",
    "\U0010ffff",
    "def f():\n\treturn '\\n'",
]


@pytest.mark.parametrize("s", NASTY)
def test_round_trip_nasty(tok, s: str) -> None:
    assert tok.decode(tok.encode(s, add_special_tokens=False), skip_special_tokens=False) == s


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=200))
def test_round_trip_any_unicode(tok, s: str) -> None:
    assert tok.decode(tok.encode(s, add_special_tokens=False), skip_special_tokens=False) == s


def test_render_example(tok) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Fix "}, {"type": "text", "text": "it"}]},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ]
    out = render(tok, msgs, TOOLS, gen=True)
    assert out.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")  # the system message first, as Qwen2.5
    assert "</tool_call><|im_end|>\n<|im_start|>user\nFix it" in out
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in out
    assert out.endswith(
        "<|im_start|>user\nFix it<|im_end|>\n"
        '<|im_start|>assistant\nLet me look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_tools = render(tok, msgs[1:2], gen=False)
    assert no_tools == "<|im_start|>user\nFix it<|im_end|>\n"


def test_tools_first_tasks_with_different_system_messages_share_the_whole_tool_section(cache: Path) -> None:
    # A harness's system message may hold per-task text (Qwen Code's git snapshot, a commit hash), its
    # tools never do: with the tools first, every task's prompt shares them (trainer.shared_prefix).
    tok = build_tokenizer(cache, tools_first=True)
    assert Path(tok.name_or_path) != Path(build_tokenizer(cache).name_or_path)  # a cache directory per layout

    def ids(system: str) -> list[int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Fix it"}]
        return tok.encode(render(tok, msgs, TOOLS, gen=True), add_special_tokens=False)
    a, b = ids("Be brief.\nHEAD is 3f2a9c1"), ids("Be brief.\nHEAD is 8d04e7b")
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    tool_section = tok.decode(a[:shared], skip_special_tokens=False)
    assert json.dumps(TOOLS[-1], ensure_ascii=False) + "\n</tools>" in tool_section
    assert tool_section.startswith("<|im_start|>system\n# Tools") and "Be brief.\nHEAD is" in tool_section


def test_render_tool_call_text_matches_template(tok) -> None:
    for args in [{"command": "grep -rn 'é' .", "n": [1, 2]}, '{"command":  "ls"}', {}]:
        msg = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "bash", "arguments": args}}],
        }
        assert render(tok, [msg]) == f"{IM_START}assistant\n{render_tool_call_text('bash', args)}{IM_END}\n"
    # A string is verbatim (not re-serialised).
    assert '"arguments": {"command":  "ls"}}' in render_tool_call_text("bash", '{"command":  "ls"}')


# Random conversations for the token-bridge property.
_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
_args = st.one_of(
    st.dictionaries(st.sampled_from(["command", "path", "n"]), _text, max_size=2),
    _text.map(lambda s: json.dumps({"command": s})),
)
_call = st.builds(
    lambda n, a: {"type": "function", "function": {"name": n, "arguments": a}},
    st.sampled_from(["bash", "read_file"]),
    _args,
)
_content = st.one_of(
    st.none(), _text, st.lists(st.builds(lambda t: {"type": "text", "text": t}, _text), max_size=2)
)
_assistant = st.builds(
    lambda c, calls: {"role": "assistant", "content": c, "tool_calls": calls},
    st.one_of(st.none(), _text),
    st.lists(_call, max_size=2),
)
_other = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, _content),
    st.builds(lambda c: {"role": "tool", "content": c}, _content),
)
_conversation = st.tuples(
    st.one_of(st.none(), _text),
    st.lists(st.one_of(_assistant, _other), min_size=1, max_size=7),
    st.booleans(),
)


def _assistant_text(msg: dict) -> str:
    """What the model samples for this turn (before <|im_end|>), built from the tool-call helper."""
    content = msg["content"] or ""
    blocks = [
        render_tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]
    ]
    return "\n".join([content, *blocks]) if content else "\n".join(blocks)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_conversation)
def test_token_bridge_prefix_property(tok, conv) -> None:
    system, body, with_tools = conv
    msgs = ([{"role": "system", "content": system}] if system is not None else []) + body
    tools = TOOLS if with_tools else None
    full = render(tok, msgs, tools, gen=True)
    full_ids = tok.encode(full, add_special_tokens=False)
    for k in range(1, len(msgs) + 1):
        if msgs[k - 1]["role"] != "assistant":
            continue
        prefix = render(tok, msgs[:k], tools)
        assert full.startswith(prefix)
        # The sampled turn is exactly generation prompt + text + <|im_end|>, and the template adds "\n".
        turn = _assistant_text(msgs[k - 1]) + IM_END + "\n"
        if k > 1:  # transformers refuses to render an empty conversation
            assert prefix == render(tok, msgs[: k - 1], tools, gen=True) + turn
        assert prefix.endswith(f"{IM_START}assistant\n" + turn)
        # Turn boundaries sit next to special tokens, so the token ids are a prefix as well.
        pids = tok.encode(prefix, add_special_tokens=False)
        assert full_ids[: len(pids)] == pids


def test_model_build_is_deterministic_and_roundtrips(tmp_path: Path, tok) -> None:
    spec = ModelSpec(num_layers=2, seed=7)
    m1, m2 = build_model(spec, tok), build_model(spec, tok)
    m3 = build_model(ModelSpec(num_layers=2, seed=8), tok)
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert not torch.equal(sd1["model.embed_tokens.weight"], m3.state_dict()["model.embed_tokens.weight"])
    assert m1.config.vocab_size == len(tok) and not m1.training
    save_model(m1, tok, tmp_path / "ckpt")
    m4, tok4 = load_model(tmp_path / "ckpt")
    ids = torch.tensor([tok.encode("def f(x):\n    return x + 1<|im_end|>")])
    with torch.no_grad():
        assert torch.equal(m1(ids).logits, m4(ids).logits)
    assert tok4.get_vocab() == tok.get_vocab() and tok4.chat_template == tok.chat_template


def test_load_or_build_caches(cache: Path, tok) -> None:
    spec = ModelSpec(num_layers=1, hidden_size=64, intermediate_size=128)
    m1, t1 = load_or_build(None, spec, cache)
    m2, _ = load_or_build(None, spec, cache)
    sd1, sd2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert t1.get_vocab() == tok.get_vocab()
    path = next(cache.glob("model-*"))
    m3, _ = load_or_build(str(path), ModelSpec(), cache)  # an explicit local dir wins over the spec
    assert torch.equal(m3.state_dict()["model.embed_tokens.weight"], sd1["model.embed_tokens.weight"])
    with pytest.raises(FileNotFoundError):
        load_or_build("Qwen/Qwen3-0.6B", spec, cache)
    # model.tools_first: the same weights, the tools-first template, a model directory of its own that keeps it
    built = set(cache.glob("model-*"))
    m5, t5 = load_or_build(None, spec.model_copy(update={"tools_first": True}), cache)
    assert torch.equal(m5.state_dict()["model.embed_tokens.weight"], sd1["model.embed_tokens.weight"])
    assert t5.chat_template == chat_template(tools_first=True) != t1.chat_template == CHAT_TEMPLATE
    assert len(set(cache.glob("model-*")) - built) == 1  # its own model directory
    _, t6 = load_or_build(None, spec.model_copy(update={"tools_first": True}), cache)  # from that directory
    assert t6.chat_template == t5.chat_template and len(set(cache.glob("model-*")) - built) == 1


def test_moe_model_builds(tok) -> None:
    m = build_model(ModelSpec(num_layers=1, moe=True, num_experts=4, num_experts_per_tok=2), tok)
    assert type(m).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, len(tok))


def test_spec_from_dict_rejects_unknown() -> None:
    assert ModelSpec.from_dict({"num_layers": 2}).num_layers == 2
    with pytest.raises(ValueError, match="hidden"):
        ModelSpec.from_dict({"hiden_size": 2})
