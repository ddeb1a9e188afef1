"""Tool-call formats: sampled completion text -> what the harness is answered (text and tool calls).

One parser per model family's syntax (`PARSERS`), chosen from the checkpoint (`detect_tool_format`,
kept as `ChatFormat.tool_format`) unless a name overrides it (`model.tool_format`, `legorl proxy
--parser`). Each parser returns a `ParsedReply`; a completion that attempted a tool call that does not
parse is answered as text and recorded as malformed (`LLMCall.malformed_tool_call`). The text parsed is
always the decode of the sampled ids, and what is trained is always those ids.
"""

from __future__ import annotations

from collections.abc import Iterable

from legorl.models.toolformats.base import ParsedReply, ToolCallParser, new_call_id
from legorl.models.toolformats.harmony import HarmonyParser
from legorl.models.toolformats.json_calls import Llama3JsonParser, MistralParser
from legorl.models.toolformats.sectioned import DeepSeekParser, KimiK2Parser
from legorl.models.toolformats.tagged import Glm45Parser, MiniMaxM2Parser, TaggedJsonParser, XmlFunctionParser

__all__ = ["AUTO", "PARSERS", "ParsedReply", "ToolCallParser", "detect_tool_format", "get_parser", "new_call_id",
           "parser_names"]

AUTO = "auto"  # the checkpoint's own format (ChatFormat.tool_format)

PARSERS: dict[str, type] = {
    "tagged": TaggedJsonParser,  # legorl's own rendering (a template without tool support)
    "hermes": TaggedJsonParser,  # Hermes / Qwen2.5 / Qwen3: JSON inside <tool_call>
    "qwen": TaggedJsonParser,
    "qwen3_coder": XmlFunctionParser,  # <function=...><parameter=...> inside <tool_call>
    "llama3_json": Llama3JsonParser,  # {"name": ..., "parameters": ...}, maybe after <|python_tag|>
    "mistral": MistralParser,  # [TOOL_CALLS][{...}] and [TOOL_CALLS]name[ARGS]{...}
    "deepseek": DeepSeekParser,  # <｜tool▁calls▁begin｜>: V3 / R1 and V3.1
    "glm45": Glm45Parser,  # <tool_call>name <arg_key>..</arg_key><arg_value>..</arg_value>
    "kimi_k2": KimiK2Parser,  # <|tool_calls_section_begin|>
    "harmony": HarmonyParser,  # gpt-oss: <|channel|>commentary to=functions.name
    "gpt_oss": HarmonyParser,
    "minimax_m2": MiniMaxM2Parser,  # <minimax:tool_call><invoke name=..>
}

# What tells a checkpoint's format, most specific first: a marker its chat template writes (or, when the
# template names none, one of its special tokens). <tool_call> comes late: GLM-4.5 and Qwen3-Coder use it too.
_MARKERS = [
    ("harmony", ("<|channel|>",)),
    ("minimax_m2", ("<minimax:tool_call>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>",)),
    ("deepseek", ("<｜tool▁calls▁begin｜>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("glm45", ("<arg_key>",)),
    ("qwen3_coder", ("<function=",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>", "<|eot_id|>")),
]


def parser_names() -> list[str]:
    """The names `get_parser` takes."""
    return [AUTO, *PARSERS]


def detect_tool_format(template: str, special_tokens: Iterable[str] = ()) -> str | None:
    """The tool-call format a chat template writes, from its text, else from the tokenizer's special
    tokens; None when neither names one."""
    tokens = " ".join(special_tokens)
    for haystack in (template, tokens):
        for name, markers in _MARKERS:
            if any(m in haystack for m in markers):
                return name
    return None


def get_parser(name: str) -> ToolCallParser:
    """The parser called `name` (`auto` is resolved by the caller: `ChatFormat.tool_format`)."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call format '{name}'; choose one of {', '.join(parser_names())}") from None
