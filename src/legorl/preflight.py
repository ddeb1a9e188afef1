"""Will legorl train this checkpoint? `preflight(model_dir)` answers with one `Check` per question.

`legorl doctor --model DIR` prints them. Nothing is generated and no weights are loaded: the config and the
tokenizer are read, the model is built on the meta device (for the fast-path checks), and the weights' dtypes and
sizes come from the safetensors headers. The central check simulates what a harness does: a 10-turn tool session
is rendered with the checkpoint's own template, each reply written in the family's tool-call syntax (the template
renders the call, the tokenizer encodes it as the engine would sample it, cut at the first stop id), parsed back
with the checkpoint's tool format, and echoed in the next request; every continued call goes through the token
bridge exactly as the proxy builds prompts, so a template that is not prefix-stable shows as the bridge's own
segment break.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from legorl.models.chat_format import LEGORL, ChatFormat, ChatFormatError, chat_format
from legorl.models.replies import reply_ids
from legorl.models.toolformats import AUTO, PARSERS, detect_tool_format, get_parser
from legorl.proxy.bridge import NOT_PREFIX_STABLE, PastCall, TokenBridge, normalize_message, reply_message

OK, WARN, FAIL = "ok", "warn", "fail"
SESSION_TURNS = 10

# The simulated session: one tool, a task, and commands whose arguments need escaping in JSON and XML alike.
_TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
_SYSTEM = "You are a coding agent. Use the bash tool to inspect and fix the repository."
_TASK = "The tests in tests/test_math.py fail. Fix the bug."
_COMMANDS = ["ls -la", "cat README.md", "pytest -q tests/test_math.py", 'grep -n "def add" src/*.py',
             "sed -n 1,20p src/math.py", "echo 'a < b && c > d'", "python -c \"print(1 + 1)\"",
             "git diff", "pytest -q", "git status --short"]
_THINK = "legorl probe reasoning"


@dataclass(frozen=True)
class Check:
    """One answer: what was checked, ok / warn / fail, what was found, and what to set when it is not ok."""

    name: str
    status: str
    found: str
    fix: str = ""


@dataclass
class Session:
    """What the simulated tool session showed."""

    calls: int = 0
    extended: int = 0  # continued calls whose prompt is the previous prompt + reply tokens + new turns
    round_trips: int = 0  # replies whose rendered call the parser read back, name and arguments
    violations: int = 0  # prompts whose tokens do not decode to the template's render of the request
    problems: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the session as one training sequence (while it extends)
    loss_mask: list[int] = field(default_factory=list)  # 1 on the sampled replies' tokens

    @property
    def continued(self) -> int:
        return max(self.calls - 1, 0)

    def note(self, problem: str) -> None:
        if len(self.problems) < 3:  # the first few say enough
            self.problems.append(problem)


# ---- the simulated tool session ----------------------------------------------------------------------------
def simulate_session(tokenizer: Any, fmt: ChatFormat, tool_format: str = AUTO,
                     turns: int = SESSION_TURNS) -> Session:
    """Render, sample (the template's own call text), parse and echo `turns` tool calls; count what held."""
    bridge = TokenBridge(tokenizer, fmt)
    parser = get_parser(fmt.tool_format if tool_format == AUTO else tool_format)
    messages: list[dict[str, Any]] = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _TASK}]
    history: list[PastCall] = []
    out = Session()
    for i in range(turns):
        built = bridge.build(messages, _TOOLS, history)
        out.calls += 1
        if history:
            _count_extension(out, i, built, history[-1])
        if tokenizer.decode(built.prompt_ids, skip_special_tokens=False) != built.prompt_text:
            out.violations += 1
            out.note(f"call {i + 1}: its prompt tokens do not decode to the template's render of the request")
        wanted = ("bash", {"command": _COMMANDS[i % len(_COMMANDS)]})
        completion = _sampled_call(bridge, messages, wanted, out, i)
        if completion is None:
            return out
        _extend_sequence(out, built.prompt_ids, completion)
        parsed = parser.parse(_body_text(tokenizer, completion), _TOOLS)
        if parsed.malformed is None and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [wanted]:
            out.round_trips += 1
        else:
            out.note(f"call {i + 1}: the {parser.__class__.__name__} parser read "
                     f"{parsed.malformed or [c.name for c in parsed.calls]} from {_body_text(tokenizer, completion)!r}")
        reply = reply_message(parsed.content, parsed.calls)
        history.append(PastCall(index=i, messages=built.norm or [normalize_message(m) for m in messages],
                                tools_key=bridge.tools_key(_TOOLS), reply=normalize_message(reply),
                                prompt_ids=built.prompt_ids, completion_ids=completion, prompt_text=built.prompt_text))
        messages = [*messages, reply, _next_turn(parsed.calls, i)]
    return out


def _count_extension(out: Session, i: int, built: Any, parent: PastCall) -> None:
    before = parent.prompt_ids + parent.completion_ids
    if built.parent_index == parent.index and built.segment_break is None and built.prompt_ids[:len(before)] == before:
        out.extended += 1
    else:
        out.note(f"call {i + 1} does not extend call {i}: {built.segment_break or 'another parent'}")


def _extend_sequence(out: Session, prompt: list[int], completion: list[int]) -> None:
    if prompt[:len(out.token_ids)] != out.token_ids:  # a new segment: the sequence starts again
        out.token_ids, out.loss_mask = [], []
    out.loss_mask += [0] * (len(prompt) - len(out.token_ids)) + [1] * len(completion)
    out.token_ids = prompt + completion


def _sampled_call(bridge: TokenBridge, messages: list[dict], wanted: tuple[str, dict], out: Session,
                  i: int) -> list[int] | None:
    """The ids a model of this family samples for `wanted`: the template's rendering of the call after the
    generation prompt, encoded, up to and including the first stop id (where the engine stops)."""
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": wanted[0], "arguments": json.dumps(wanted[1])}}]}
    try:
        return reply_ids(bridge.tok, bridge.format, messages, _TOOLS, call)
    except ChatFormatError as e:
        out.note(f"call {i + 1}: {e}")
        return None


def _body_text(tokenizer: Any, completion: list[int]) -> str:
    """What the proxy parses: the decode, special tokens kept, the closing stop token removed."""
    text = tokenizer.decode(completion, skip_special_tokens=False)
    return text.removesuffix(tokenizer.convert_ids_to_tokens(completion[-1]))


def _next_turn(calls: list, i: int) -> dict[str, Any]:
    if not calls:  # nothing read: a harness tells the model so
        return {"role": "user", "content": "No tool call was found in your reply."}
    return {"role": "tool", "tool_call_id": calls[0].id, "content": f"output of command {i + 1}\nexit code 0"}


# ---- the checks ----------------------------------------------------------------------------------------------
def preflight(model_dir: str | Path, tool_format: str = AUTO, max_context: int | None = None) -> list[Check]:
    """Every check of `model_dir`, in order; later checks are skipped when what they need did not load."""
    folder = Path(model_dir)
    config, checks = _config(folder)
    tokenizer, more = _tokenizer(folder, config)
    checks += more
    if tokenizer is not None:
        fmt, more = _chat_format(tokenizer, folder, tool_format)
        checks += more
        if fmt is not None:
            checks += _session_checks(tokenizer, fmt, tool_format)
            checks.append(_reasoning(tokenizer, fmt))
    if config is not None:
        checks += _fast_paths(config)
        checks.append(_context(config, tokenizer, max_context))
    checks.append(_weights(folder, config))
    return checks


def failed(checks: list[Check]) -> bool:
    return any(c.status == FAIL for c in checks)


def _config(folder: Path) -> tuple[Any, list[Check]]:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any reason: say it
        import transformers

        return None, [Check("config", FAIL, f"{type(e).__name__}: {e}",
                            f"{folder} needs a config.json as save_pretrained writes it, of an architecture "
                            f"transformers {transformers.__version__} knows (or upgrade transformers)")]
    text = getattr(config, "text_config", None) or config
    found = (f"{', '.join(getattr(config, 'architectures', None) or ['?'])} (model_type {config.model_type}): "
             f"{getattr(text, 'num_hidden_layers', '?')} layers, hidden {getattr(text, 'hidden_size', '?')}, "
             f"vocab {getattr(text, 'vocab_size', '?')}")
    return config, [Check("config", OK, found)]


def _tokenizer(folder: Path, config: Any) -> tuple[Any, list[Check]]:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001
        return None, [Check("tokenizer", FAIL, f"{type(e).__name__}: {e}",
                            f"put the tokenizer files (tokenizer.json, tokenizer_config.json) into {folder}")]
    found = f"{type(tok).__name__}, {len(tok)} tokens"
    vocab = getattr(getattr(config, "text_config", None) or config, "vocab_size", None)
    if isinstance(vocab, int) and len(tok) > vocab:
        return tok, [Check("tokenizer", FAIL, f"{found}, more than the model's vocab_size {vocab}",
                           "use the tokenizer the model was trained with (ids past the embedding cannot be trained)")]
    return tok, [Check("tokenizer", OK, found)]


def _chat_format(tokenizer: Any, folder: Path, tool_format: str) -> tuple[ChatFormat | None, list[Check]]:
    try:
        fmt = chat_format(tokenizer, folder)
    except ChatFormatError as e:
        return None, [Check("chat template", FAIL, str(e), "the message says what to add")]
    names = tokenizer.convert_ids_to_tokens(list(fmt.stop_ids))
    checks = [Check("chat template", OK, fmt.source),
              Check("end of turn, stops", OK, f"end of turn {fmt.end_of_turn} ({fmt.end_of_turn_id}); stop ids "
                    + ", ".join(f"{n} ({i})" for n, i in zip(names, fmt.stop_ids)))]
    if fmt.tools == LEGORL:
        checks.append(Check("tools", WARN, f"the template does not render {', '.join(fmt.missing)}: legorl renders "
                            "the tool list, calls and results itself (Hermes <tool_call> JSON)",
                            "none needed; to train in the model's own tool syntax, put a template that renders "
                            "tools into the model directory"))
    else:
        checks.append(Check("tools", OK, "the template renders the tool list, tool calls and tool results"))
    checks.append(_tool_format(tokenizer, fmt, tool_format))
    return fmt, checks


def _tool_format(tokenizer: Any, fmt: ChatFormat, tool_format: str) -> Check:
    if tool_format != AUTO:
        return Check("tool format", OK, f"{tool_format} (set; auto would choose {fmt.tool_format})")
    if fmt.tools == LEGORL:
        return Check("tool format", OK, "tagged (auto: legorl's rendering)")
    template = tokenizer.chat_template
    text = "\n".join(template.values()) if isinstance(template, dict) else template
    specials = [t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()]
    if detect_tool_format(text, specials) is None:
        return Check("tool format", WARN, "tagged (auto: no known tool-call marker in the template or the special "
                     "tokens)", "set model.tool_format (legorl proxy --parser) to the model's format")
    return Check("tool format", OK, f"{fmt.tool_format} (auto, from the template)")


def _session_checks(tokenizer: Any, fmt: ChatFormat, tool_format: str) -> list[Check]:
    s = simulate_session(tokenizer, fmt, tool_format)
    why = "; ".join(s.problems)
    stable = s.extended == s.continued and s.calls == SESSION_TURNS and s.violations == 0
    prefix = Check("prefix stability", OK if stable else FAIL,
                   f"{s.extended}/{SESSION_TURNS - 1} continued calls extend the previous call's tokens, "
                   f"{s.violations} prompts differ from the template's render" + (f": {why}" if not stable else ""),
                   "" if stable else "use a template whose render of a conversation starts with the render of every "
                   "earlier part of it: nothing that changes per call (a date, a turn counter, the last message "
                   "marked differently) before the last turn")
    trips_ok = s.round_trips == SESSION_TURNS
    fix = ""
    if not trips_ok:
        readers = _formats_that_read(tokenizer, fmt)
        fix = (f"set model.tool_format to {' or '.join(readers)} (it reads these calls)" if readers else
               "set model.tool_format to the model's tool-call format (none of legorl's parsers reads the "
               "template's calls)")
    trips = Check("tool-call round trips", OK if trips_ok else FAIL,
                  f"{s.round_trips}/{SESSION_TURNS} rendered calls read back" + (f": {why}" if not trips_ok else ""),
                  fix)
    return [prefix, trips]


def _formats_that_read(tokenizer: Any, fmt: ChatFormat) -> list[str]:
    return [name for name in PARSERS
            if simulate_session(tokenizer, fmt, name, turns=2).round_trips == 2]


def _reasoning(tokenizer: Any, fmt: ChatFormat) -> Check:
    """Whether a past assistant turn's <think> block survives into the next prompt."""
    bridge = TokenBridge(tokenizer, fmt)
    messages = [{"role": "user", "content": _TASK},
                {"role": "assistant", "content": f"<think>\n{_THINK}\n</think>\n\nDone."},
                {"role": "user", "content": "Thanks."}]
    try:
        kept = _THINK in bridge.render(messages, None, generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - a template that refuses such a turn
        return Check("reasoning", WARN, f"the template fails on a past <think> block: {e}")
    if kept:
        return Check("reasoning", OK, "past <think> blocks stay in later prompts")
    return Check("reasoning", WARN, "the template drops the <think> block of earlier assistant turns",
                 f"nothing to set: a call after such a turn starts a new segment (segment_break "
                 f"\"{NOT_PREFIX_STABLE}\"); every sampled token is still trained, in more, shorter sequences")


def _fast_paths(config: Any) -> list[Check]:
    """The engine's and the trainer's fast forwards, asked of the model built on the meta device (no weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from legorl.engine.fast import check_support
    from legorl.train.fast_forward import why_not

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001
        return [Check("model class", FAIL, f"AutoModelForCausalLM cannot build it: {type(e).__name__}: {e}",
                      "legorl trains causal LMs that AutoModelForCausalLM loads")]
    model = model.float()  # legorl loads and trains in fp32
    fallback = "nothing to set: the {} uses the model's own transformers forward (correct, slower)"
    checks = []
    for name, reason, part in (("engine fast path", check_support(model), "embedded engine"),
                               ("trainer fast forward", why_not(model), "trainer")):
        checks.append(Check(name, OK, "covered") if reason is None else
                      Check(name, WARN, f"HF fallback: {reason}", fallback.format(part)))
    return checks


def _context(config: Any, tokenizer: Any, max_context: int | None) -> Check:
    text = getattr(config, "text_config", None) or config
    positions = getattr(text, "max_position_embeddings", None)
    tok_max = getattr(tokenizer, "model_max_length", None)
    tok_max = tok_max if isinstance(tok_max, int) and tok_max < 10**9 else None  # HF's "no limit" is 1e30
    limits = [n for n in (positions, tok_max) if isinstance(n, int)]
    found = f"max_position_embeddings {positions}" + (f", tokenizer model_max_length {tok_max}" if tok_max else "")
    if not limits:
        return Check("context", WARN, "no max_position_embeddings in config.json",
                     "pass --max-context to legorl proxy / serve")
    if max_context is not None and min(limits) < max_context:
        return Check("context", WARN, f"{found}: below the {max_context} asked for",
                     f"harness prompts past {min(limits)} tokens end as context_overflow: use a longer-context "
                     "model, or lower the harness's context")
    return Check("context", OK, found)


def _weights(folder: Path, config: Any) -> Check:
    """The stored dtypes and parameter count, from the safetensors headers; legorl trains in fp32."""
    files = sorted(folder.glob("*.safetensors"))
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) if config is not None else None
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        return Check("weights", WARN if others else FAIL,
                     f"no *.safetensors in {folder}" + (f" ({', '.join(others)})" if others else ""),
                     "save the model with save_pretrained (safetensors)")
    dtypes: dict[str, int] = {}
    for f in files:
        for name, info in _safetensors_header(f).items():
            if name != "__metadata__":
                dtypes[info["dtype"]] = dtypes.get(info["dtype"], 0) + prod(info["shape"])
    n = sum(dtypes.values())
    found = (f"{n:,} parameters in {len(files)} file(s): " + ", ".join(f"{d} {c:,}" for d, c in dtypes.items())
             + (f" (config dtype {declared})" if declared else "")
             + f"; loaded and trained in float32: {4 * n / 1e9:.2f} GB of weights, about 4x that with gradients "
             "and Adam")
    return Check("weights", OK, found)


def _safetensors_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))
