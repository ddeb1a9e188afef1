"""The chat format of a checkpoint: its end-of-turn token, its stop ids, and who renders tools.

Everything that has to know how the policy's turns are written reads it from a `ChatFormat`, never
from a literal: the token bridge (where the parent's reply ends in a rendered prompt), the wire
formats (which closing token to leave out of logprob entries), the engines (when to stop; what to
append to a scripted or teacher answer). It is built once per tokenizer (`chat_format(tokenizer)`)
from what the checkpoint ships:

- the **chat template** (``chat_template.jinja`` or ``tokenizer_config.json``): a probe conversation is
  rendered, and the first added token after an assistant reply is the end-of-turn token
  (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``</s>`` for Mistral...);
- the tokenizer's **special tokens**: its eos token ends a turn too; its pad token (when it is a
  special token other than bos) is a stop id, as in Qwen's generation config;
- the model directory's **generation_config.json**, when present: its ``eos_token_id`` (one id or a
  list, e.g. Llama 3.1's ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``) are turn ends.

gpt-oss (the ``harmony`` tool format) is the exception: its template closes every message with ``<|end|>``
(the end of turn read from it), but a reply is several messages (``analysis``, then ``final`` or a
``commentary`` call), so ``<|end|>`` is no stop id; the turn ends on ``<|return|>`` or ``<|call|>`` (harmony's
stop tokens for assistant actions), which are turn ends and stop ids whenever the tokenizer has them.

Tools. A probe tool conversation (a tool list, an assistant tool call, a tool result) shows whether
the template renders each part. When it renders all three, tools are the template's (``tools ==
"template"``). When any part is missing (SmolLM2's ChatML template ignores ``tools`` and tool calls),
legorl renders the tool conversation itself (``tools == "legorl"``): the tool list in the system
message in the built-in template's ``<tools>`` section, each assistant tool call as a ``<tool_call>``
JSON block after its text, each tool result as a user turn in ``<tool_response>`` tags. The template
then only renders plain system / user / assistant text, so no tool definition is ever dropped, and the
model answers in the syntax the ``tagged`` parser reads. `legorl proxy` and the pipeline log it as a
warning at start-up; ``proxy.stats()["chat_format"]`` says it.

The tool-call syntax the model writes (``tool_format``: ``hermes``, ``llama3_json``, ``mistral``, ...) is read
from the template's text, else from the special tokens (`legorl.models.toolformats.detect_tool_format`);
``tagged`` when legorl renders tools.

Reasoning. ``reasoning`` is the pair of markers a reasoning model writes its reasoning between
(``<think>``/``</think>`` for Qwen3, DeepSeek-R1, GLM-4.5, MiniMax-M2; ``[THINK]``/``[/THINK]`` for Magistral),
read from the template's text (it writes those markers, or reads ``enable_thinking`` / ``reasoning_content``);
None for a model that does not reason that way (gpt-oss's harmony channels are read by its tool-call parser).

A tokenizer without a chat template, or a template that closes a turn with no added token, is a
`ChatFormatError` naming the file and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.models.chat_template import DEFAULT_SYSTEM, SECTION_BREAK, TOOLS_POSTAMBLE, TOOLS_PREAMBLE

log = logging.getLogger(__name__)

TEMPLATE = "template"  # the chat template renders tool lists, tool calls and tool results
LEGORL = "legorl"  # legorl renders them (the built-in template's syntax) around the template's plain turns

# The probe: names no real conversation holds, so finding them in a render means the template put them there.
_TOOL = "legorl_probe_tool"
_ARG, _VALUE = "legorl_probe_arg", "legorl-probe-value"
_RESULT = "legorl probe tool result"
_USER, _USER2, _REPLY = "legorl probe user", "legorl probe next user", "legorl probe reply"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _TOOL, "description": "A probe tool.",
    "parameters": {"type": "object", "properties": {_ARG: {"type": "string"}}, "required": [_ARG]}}}]


HARMONY_STOPS = ("<|return|>", "<|call|>")  # where a gpt-oss turn ends (its <|end|> only closes a message)

# Reasoning styles by name (model.reasoning, legorl proxy --reasoning): the markers the model writes around it.
AUTO_REASONING = "auto"  # the checkpoint's, read from its template
REASONING_STYLES: dict[str, tuple[str, str] | None] = {
    "none": None,
    "think": ("<think>", "</think>"),  # Qwen3, DeepSeek-R1, GLM-4.5, MiniMax-M2
    "mistral": ("[THINK]", "[/THINK]"),  # Magistral
}


def reasoning_styles() -> list[str]:
    """The names `ChatFormat.with_reasoning` takes."""
    return [AUTO_REASONING, *REASONING_STYLES]


class ChatFormatError(ValueError):
    """The checkpoint's chat format cannot be read (no template, no end-of-turn token): says what and the fix."""


@dataclass(frozen=True)
class ChatFormat:
    """How a checkpoint writes its turns (see the module docstring for where each field comes from)."""

    end_of_turn: str  # the added token the template closes each turn with, e.g. "<|im_end|>", "<|eot_id|>"
    end_of_turn_id: int
    turn_end_ids: tuple[int, ...]  # sampled ids that end an assistant turn: end_of_turn_id first, then eos ids
    stop_ids: tuple[int, ...]  # what engines stop on: turn_end_ids (but harmony's <|end|>), then the pad token's id
    eos_id: int | None  # the tokenizer's eos token
    tools: str  # TEMPLATE or LEGORL: who renders tool lists, calls and results
    missing: tuple[str, ...] = ()  # what of a tool conversation the template does not render
    source: str = ""  # the template's file, for messages
    tool_format: str = "tagged"  # the tool-call syntax the model writes (a name of models.toolformats.PARSERS)
    reasoning: tuple[str, str] | None = None  # (open, close) markers of the model's reasoning; None: it has none

    def summary(self) -> dict[str, Any]:
        """What `proxy.stats()` shows of it."""
        return {"end_of_turn": self.end_of_turn, "stop_ids": list(self.stop_ids), "tools": self.tools,
                "missing": list(self.missing), "tool_format": self.tool_format,
                "reasoning": list(self.reasoning) if self.reasoning else None}

    def with_reasoning(self, style: str) -> ChatFormat:
        """This format with the reasoning `style` (a name of REASONING_STYLES; `auto` keeps the checkpoint's)."""
        if style == AUTO_REASONING:
            return self
        if style not in REASONING_STYLES:
            raise ValueError(f"unknown reasoning style '{style}'; choose one of {', '.join(reasoning_styles())}")
        return dataclasses.replace(self, reasoning=REASONING_STYLES[style])

    def warning(self) -> str | None:
        """What to tell the user at start-up, or None when the template renders everything itself."""
        if self.tools != LEGORL:
            return None
        parts = list(self.missing)
        what = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
        return (f"the chat template ({self.source}) does not render {what}: legorl renders the "
                "tool conversation itself (the tool list in the system message in <tools></tools>, tool calls as "
                "<tool_call> JSON blocks, tool results as user turns in <tool_response> tags; parse tool calls "
                "with the `tagged` tool format). Put a template that renders tools into the model directory to use "
                "the model's own tool format")

    def prepare(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                ) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """Template-shaped messages and tools as the template is given them (see the module docstring)."""
        if self.tools != LEGORL:
            return messages, tools
        return legorl_tool_messages(messages, tools), None

    # ---- building -------------------------------------------------------------------------------
    @classmethod
    def from_tokenizer(cls, tokenizer: Any, model_dir: str | Path | None = None) -> ChatFormat:
        """Read the chat format from `tokenizer` and `model_dir` (default: the directory it was loaded from)."""
        folder = _folder(tokenizer, model_dir)
        where = str(folder) if folder is not None else "the tokenizer"
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one renders the conversations
            template = template.get("default")
        if not template:
            raise ChatFormatError(_no_template_message(folder))
        source = _template_file(folder) or "tokenizer.chat_template"

        def render(messages: list[dict], tools: list[dict] | None = None, gp: bool = False) -> str:
            return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=gp, tokenize=False)

        # End of turn: the first added token after an assistant reply (a next user turn follows, so the
        # reply is not the template's "last message", which some templates render differently).
        try:
            text = render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _REPLY},
                           {"role": "user", "content": _USER2}])
        except Exception as e:  # noqa: BLE001 - any template error: say so with the file
            raise ChatFormatError(f"the chat template ({source}) cannot render a user / assistant / user "
                                  f"conversation: {type(e).__name__}: {e}") from None
        at, end = text.find(_REPLY), text.find(_USER2)
        if at < 0 or end < at:
            raise ChatFormatError(f"the chat template ({source}) does not render an assistant reply's text "
                                  "(a probe reply is missing from its render)")
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        between = text[at + len(_REPLY):end]
        # (where, longest first): the earliest added token, the longest of those starting at the same place
        found = [(between.find(t.content), -len(t.content), t.content, i) for i, t in added.items()
                 if t.content and t.content in between]
        if not found:
            raise ChatFormatError(
                f"the chat template ({source}) closes an assistant turn with {between!r}, which holds no "
                f"added (special) token of the tokenizer in {where}: legorl needs a token that ends a turn, "
                "to stop generation on and to find where a reply ends. Add the model's end-of-turn token to the "
                "tokenizer as a special token, or use the template the model was trained with")
        _, _, eot, eot_id = min(found)
        eos_id = getattr(tokenizer, "eos_token_id", None)
        turn_end = [int(eot_id)]
        for i in [eos_id, *_generation_eos(folder)]:
            if isinstance(i, int) and i not in turn_end:
                turn_end.append(i)
        missing = _missing_tool_parts(render)
        tool_format = "tagged" if missing else _tool_format(tokenizer, source)
        stops = list(turn_end)
        enders = [i for i in _added_ids(tokenizer, HARMONY_STOPS) if i != eot_id] if tool_format == "harmony" else []
        if enders:  # gpt-oss: <|end|> closes a message and the turn goes on (an analysis message, then the final
            # answer or a call); the turn ends on <|return|> or <|call|> (harmony's stop tokens for assistant
            # actions, gpt-oss's generation_config.json), so <|end|> is no stop id
            turn_end += [i for i in enders if i not in turn_end]
            stops = [i for i in turn_end if i != eot_id]
        pad, bos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "bos_token_id", None)
        if isinstance(pad, int) and pad != bos and pad not in stops and pad in (getattr(tokenizer, "all_special_ids",
                                                                                        None) or []):
            stops.append(pad)
        return cls(end_of_turn=eot, end_of_turn_id=int(eot_id), turn_end_ids=tuple(turn_end), stop_ids=tuple(stops),
                   eos_id=eos_id if isinstance(eos_id, int) else None, tools=LEGORL if missing else TEMPLATE,
                   missing=tuple(missing), source=source,
                   tool_format=tool_format,
                   reasoning=_reasoning_markers(template))


def chat_format(tokenizer: Any, model_dir: str | Path | None = None) -> ChatFormat:
    """`ChatFormat.from_tokenizer`, once per tokenizer (kept on it, and read again if its template changes)."""
    key = (getattr(tokenizer, "chat_template", None), str(model_dir) if model_dir is not None else None)
    cached = getattr(tokenizer, "_legorl_chat_format", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    fmt = ChatFormat.from_tokenizer(tokenizer, model_dir)
    try:
        tokenizer._legorl_chat_format = (key, fmt)
    except AttributeError:  # a tokenizer that takes no attributes: built again next time
        pass
    return fmt


def legorl_assistant_text(content: str | None, tool_calls: list[dict[str, Any]]) -> str:
    """An assistant turn in legorl's syntax, as the built-in template writes it: its text, then one
    ``<tool_call>`` block per (template-shaped) call, each after a newline unless it is the first block
    of a turn without text; string arguments verbatim, others as JSON."""
    from legorl.models.tokenizer import render_tool_call_text

    text = content or ""
    for i, c in enumerate(tool_calls):
        fn = c.get("function", c) if isinstance(c, dict) else {}
        text += ("\n" if text or i else "") + render_tool_call_text(fn.get("name"), fn.get("arguments"))
    return text


def tools_section(tools: list[dict], system: str | None) -> str:
    """The system message (its default text without one), then the built-in template's tool section."""
    return ((system if system is not None else DEFAULT_SYSTEM) + SECTION_BREAK + TOOLS_PREAMBLE
            + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_POSTAMBLE)


def legorl_tool_messages(messages: list[dict[str, Any]], tools: list[dict] | None) -> list[dict[str, Any]]:
    """Template-shaped messages with the tool conversation written as the built-in template writes it:
    the tool list in the (first) system message, tool calls in the assistant text, tool results as
    user turns. What a template without tool support renders then holds every tool definition, call and
    result; each message's text depends on it alone (and the system message on the tools), so the
    render of a prefix of the messages stays a prefix of the render."""
    out: list[dict[str, Any]] = []
    rest = messages
    if tools:
        first_system = bool(messages) and messages[0].get("role") == "system"
        out.append({"role": "system", "content": tools_section(tools, messages[0].get("content") or ""
                                                                if first_system else None)})
        rest = messages[1:] if first_system else messages
    for m in rest:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": legorl_assistant_text(m.get("content"), m["tool_calls"])})
        elif role == "tool":
            out.append({"role": "user", "content": "<tool_response>\n" + (m.get("content") or "")
                        + "\n</tool_response>"})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    return out


# ---- helpers ----------------------------------------------------------------------------------------
def _folder(tokenizer: Any, model_dir: str | Path | None) -> Path | None:
    if model_dir is not None:
        return Path(model_dir)
    name = getattr(tokenizer, "name_or_path", None)
    if name and Path(str(name)).is_dir():
        return Path(str(name))
    return None


def _template_file(folder: Path | None) -> str | None:
    if folder is None:
        return None
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        if (folder / name).exists():
            return str(folder / name)
    return None


def _no_template_message(folder: Path | None) -> str:
    if folder is None:
        return ("the tokenizer has no chat template (tokenizer.chat_template is None): legorl renders every prompt "
                "with the policy's own template and reads its end-of-turn token from it. Set tokenizer.chat_template "
                "to the template the model was trained with")
    return (f"{folder} has no chat template: neither {folder / 'chat_template.jinja'} nor a \"chat_template\" key in "
            f"{folder / 'tokenizer_config.json'}. legorl renders every prompt with the model's own template and reads "
            "its end-of-turn token from it. Fix: put the template the model was trained with (e.g. the one of the "
            f"instruct checkpoint it comes from) into {folder / 'chat_template.jinja'}")


def _generation_eos(folder: Path | None) -> list[int]:
    """The eos ids of ``generation_config.json`` (one id or a list), when the folder has one."""
    if folder is None or not (folder / "generation_config.json").exists():
        return []
    try:
        value = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        log.warning("could not read %s: %s", folder / "generation_config.json", e)
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _added_ids(tokenizer: Any, contents: tuple[str, ...]) -> list[int]:
    """The ids of those of `contents` that are added tokens of the tokenizer, in that order."""
    added = {t.content: int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items()}
    return [added[c] for c in contents if c in added]


def _tool_format(tokenizer: Any, source: str) -> str:
    """The tool-call syntax of a template that renders tools: from its text (every named template) and the
    tokenizer's special tokens; `tagged` (JSON in <tool_call>) with a warning when neither tells."""
    from legorl.models.toolformats import detect_tool_format

    template = tokenizer.chat_template
    text = "\n".join(template.values()) if isinstance(template, dict) else template
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    found = detect_tool_format(text, (t.content for t in added.values()))
    if found is None:
        log.warning("the chat template (%s) renders tools in a syntax legorl does not recognise: tool calls are "
                    "parsed as `tagged` (JSON in <tool_call>); set model.tool_format (legorl proxy --parser) "
                    "to the model's format", source)
    return found or "tagged"


def _reasoning_markers(template: Any) -> tuple[str, str] | None:
    """The reasoning markers a template names: Magistral's [THINK], else <think> when the template writes it or
    reads the reasoning switches of such models (enable_thinking, reasoning_content); None otherwise."""
    text = "\n".join(template.values()) if isinstance(template, dict) else str(template)
    if "[THINK]" in text:
        return REASONING_STYLES["mistral"]
    if any(m in text for m in ("<think>", "enable_thinking", "reasoning_content")):
        return REASONING_STYLES["think"]
    return None


def _missing_tool_parts(render: Any) -> list[str]:
    """Which parts of a tool conversation the template leaves out of its render (or fails on)."""
    user = {"role": "user", "content": _USER}  # no system message: some templates refuse one
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": _TOOL, "arguments": {_ARG: _VALUE}}}]}
    result = {"role": "tool", "content": _RESULT, "tool_call_id": "call0probe"}
    missing = []
    listed = 0  # the tool's name as often as the tool list alone shows it: a rendered call adds one more
    checks = [("a tool list", [user], True, lambda t: _TOOL in t),
              ("tool calls", [user, call], False, lambda t: _VALUE in t and t.count(_TOOL) > listed),
              ("tool results", [user, call, result], False, lambda t: _RESULT in t)]
    for what, messages, gp, found in checks:
        try:
            text = render(messages, _PROBE_TOOLS, gp)
            ok = found(text)
        except Exception as e:  # noqa: BLE001 - a template that raises on it does not render it
            log.debug("the chat template fails on a probe with %s: %s", what, e)
            text, ok = "", False
        if what == "a tool list":
            listed = text.count(_TOOL)
        if not ok:
            missing.append(what)
    return missing
