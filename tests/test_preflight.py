"""`legorl doctor --model DIR` (preflight.py) on checkpoints built on the spot, one per family, and broken ones.

Each family's directory holds its tokenizer (the family's special tokens), a template written from its documented
tool-call syntax and a tiny random model of its architecture (tests/families.py); the preflight must pass with the
family's tool format, every continued call of the 10-turn session extending the previous one and every call read
back. Broken directories fail naming the problem and the fix. No downloads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from families import DETECTED, FAMILIES, NO_TOOLS, build_tokenizer, save_checkpoint, scaffold
from typer.testing import CliRunner

from legorl.cli import app
from legorl.preflight import FAIL, OK, WARN, Check, failed, preflight
from legorl.proxy.bridge import NOT_PREFIX_STABLE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HERMES_CALL = ("{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' + (args | tojson) "
               "+ '}\\n</tool_call>' }}")
# (engine, trainer) fast paths: Qwen3 and Llama dense everywhere, Qwen3-MoE in the engine only
FAST_PATHS = {"hermes": (OK, OK), "llama3_json": (OK, OK), NO_TOOLS: (OK, OK), "qwen3_coder": (OK, WARN)}
HERMES_SPECIAL = ["<|im_end|>", "<tool_call>", "</tool_call>"]


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {f: save_checkpoint(root / f, f) for f in [*FAMILIES, NO_TOOLS]}


def broken_dir(tmp_path: Path, template: str | None, special: list[str] = HERMES_SPECIAL) -> Path:
    tok = build_tokenizer(template or "", special)
    tok.chat_template = template
    return save_checkpoint(tmp_path / "broken", "hermes", tokenizer=tok)


@pytest.mark.parametrize("family", [*FAMILIES, NO_TOOLS])
def test_every_family_passes_with_its_tool_format(family, family_dirs):
    checks = by_name(preflight(family_dirs[family]))
    assert not failed(list(checks.values())), [c for c in checks.values() if c.status == FAIL]
    expected = "tagged" if family == NO_TOOLS else DETECTED.get(family, family)
    assert checks["tool format"].status == OK and checks["tool format"].found.startswith(expected)
    assert checks["tools"].status == (WARN if family == NO_TOOLS else OK)
    assert checks["prefix stability"].found.startswith("9/9 continued calls extend")
    assert "0 prompts differ" in checks["prefix stability"].found
    assert checks["tool-call round trips"].found.startswith("10/10")
    assert checks["reasoning"].status == OK and checks["weights"].status == OK
    fast = (checks["engine fast path"].status, checks["trainer fast forward"].status)
    assert fast == FAST_PATHS.get(family, (WARN, WARN))  # an HF fallback is a warning, never a failure
    if family == "harmony":  # gpt-oss ends a tool call on <|call|>: its generation config makes it a stop id
        assert "<|call|>" in checks["end of turn, stops"].found


def test_no_template_fails_naming_the_file_to_add(tmp_path):
    checks = by_name(preflight(broken_dir(tmp_path, None)))
    bad = checks["chat template"]
    assert bad.status == FAIL and "has no chat template" in bad.found and "chat_template.jinja" in bad.found
    assert "prefix stability" not in checks  # nothing to simulate without a template


def test_template_without_an_end_of_turn_token_fails(tmp_path):
    template = ("{%- for m in messages %}{{- m.role + ': ' + m.content + '\\n\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}")
    bad = by_name(preflight(broken_dir(tmp_path, template)))["chat template"]
    assert bad.status == FAIL and "holds no added (special) token" in bad.found
    assert "Add the model's end-of-turn token to the tokenizer" in bad.found


def test_a_turn_counter_in_the_system_prompt_is_not_prefix_stable(tmp_path):
    counter = "(messages | selectattr('role', 'equalto', 'tool') | list | length | string)"
    template = scaffold(HERMES_CALL).replace(  # the system turn counts the tool results so far: changes each call
        "{%- for m in messages %}", "{{- '<|im_start|>system\\nTool results so far: ' + " + counter
        + " + '<|im_end|>\\n' }}{%- for m in messages %}", 1)
    checks = by_name(preflight(broken_dir(tmp_path, template)))
    bad = checks["prefix stability"]
    assert bad.status == FAIL and bad.found.startswith("0/9 continued calls extend") and NOT_PREFIX_STABLE in bad.found
    assert "turn counter" in bad.fix
    assert checks["tool-call round trips"].status == OK  # the calls themselves read back


def test_a_template_dropping_past_reasoning_is_a_warning(tmp_path):
    # Qwen3's rule: assistant turns before the last user message lose their <think> block
    template = scaffold(HERMES_CALL).replace(
        "{%- for m in messages %}", "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
        "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{%- for m in messages %}", 1).replace(
        "open('assistant') + (m.content or '')",
        "open('assistant') + ((m.content or '').split('</think>')[-1].lstrip() if loop.index0 < ns.last "
        "else (m.content or ''))", 1)
    checks = by_name(preflight(broken_dir(tmp_path, template)))
    assert checks["reasoning"].status == WARN and NOT_PREFIX_STABLE in checks["reasoning"].fix
    assert not failed(list(checks.values()))  # a tool session with one user message keeps its reasoning


def test_a_wrong_tool_format_fails_and_names_the_one_that_reads(family_dirs):
    bad = by_name(preflight(family_dirs["hermes"], tool_format="mistral"))["tool-call round trips"]
    assert bad.status == FAIL and bad.found.startswith("0/10") and "hermes" in bad.fix
    assert bad.fix.startswith("set model.tool_format to")


def test_context_below_what_is_asked_is_a_warning(family_dirs):
    ctx = by_name(preflight(family_dirs["llama3_json"], max_context=100_000))["context"]
    assert ctx.status == WARN and "below the 100000 asked for" in ctx.found and "context_overflow" in ctx.fix


def test_doctor_model_on_the_command_line(family_dirs, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(app, ["doctor", "--model", str(family_dirs["qwen3_coder"])], env={"COLUMNS": "200"})
    assert ok.exit_code == 0, ok.output
    assert "prefix stability" in ok.output and "qwen3_coder (auto" in ok.output
    bad = runner.invoke(app, ["doctor", "--model", str(broken_dir(tmp_path, None)), "--json"])
    assert bad.exit_code == 1
    report = json.loads(bad.stdout)
    assert report["ok"] is False and {"name": "chat template", "status": FAIL}.items() <= report["checks"][2].items()
    nope = runner.invoke(app, ["doctor", "--model", str(tmp_path / "nope")])
    assert nope.exit_code == 2 and "is not a directory" in " ".join(nope.output.split())  # rich wraps lines
