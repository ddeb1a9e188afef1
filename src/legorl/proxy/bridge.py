"""The token bridge: build each prompt from exact earlier tokens, never re-tokenized text.

When a request continues an earlier call of the same session (its messages are
that call's messages + the assistant reply the proxy returned + new turns), the
prompt is

    parent.prompt_ids + parent.completion_ids + encode(template text after that reply)

so the tokens the model sampled stay exactly as sampled. When the harness
rewrote, truncated or condensed its history, no earlier call matches: the prompt
is rendered afresh and the call starts a new segment, with the reason recorded.
`naive_differs` says whether plain re-rendering would have produced different
tokens than the bridge (the drift the bridge prevented).

Every wire format is first turned into canonical (OpenAI-chat shaped) messages
(see request.py), so matching works the same for Anthropic content blocks and
Responses items. Matching compares what the model sees of a message: role, text,
tool-call names and parsed arguments, tool-result ids; an assistant reply's text
is compared without surrounding whitespace (harnesses trim it; the sampled
tokens are what the next prompt continues from either way).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from legorl.models.chat_format import ChatFormat
from legorl.models.chat_format import chat_format as read_chat_format
from legorl.models.replies import args_value, call_function, content_text, template_messages
from legorl.proxy.reasoning import REASONING_DROPPED
from legorl.records import ToolCall


def normalize_message(msg: dict[str, Any]) -> tuple:
    """A comparable key for a message: what matters for the model's view of it."""
    calls = tuple(
        (call_function(c).get("name"), json.dumps(args_value(call_function(c).get("arguments")), sort_keys=True))
        for c in (msg.get("tool_calls") or [])
    )
    text = content_text(msg.get("content"))
    if msg.get("role") == "assistant":
        text = text.strip()
    return (msg.get("role"), text, calls, msg.get("tool_call_id") or None)


def reply_message(content: str | None, tool_calls: list[ToolCall], reasoning: str | None = None) -> dict[str, Any]:
    """The assistant message the proxy returns, in canonical (OpenAI) shape (also used for matching, which
    leaves its reasoning out: harnesses send reasoning back or not)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in tool_calls
        ]
    return msg


class CachedEncoder:
    """`encode(text)` that re-encodes only the pieces it has not seen.

    Fast tokenizers cut the text at added tokens (``<|im_start|>``, ``<|im_end|>``, ...) before
    anything else, so the ids of a rendered chat are the concatenation of the ids of the pieces
    between them. Long harness prompts (tens of kB of system prompt and tool schemas) are mostly
    the same pieces every call, so each call costs only its new text. The cache is switched off when
    the tokenizer's added tokens could interact with their neighbours (lstrip/rstrip/single_word,
    normalized), and the first calls are checked against a plain encode.
    """

    def __init__(self, tokenizer: Any, max_entries: int = 8192, verify_first: int = 3):
        self.tok = tokenizer
        self.max_entries = max_entries
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()
        self._verify_left = verify_first
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.enabled = self._backend is not None and bool(added) and all(
            not (t.lstrip or t.rstrip or t.single_word or t.normalized) for t in added.values())
        self._ids = {t.content: i for i, t in added.items()}
        names = sorted(self._ids, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")") if names else None
        self.hits = 0
        self.misses = 0

    def plain(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def encode(self, text: str) -> list[int]:
        if not self.enabled or self._split is None:
            return self.plain(text)
        parts = self._split.split(text)
        # Large prompts are encoded in worker threads (core.py) while the loop encodes others: the cache
        # is only touched under the lock, the tokenizer runs outside it (and releases the GIL).
        with self._lock:
            pieces = {}
            for p in dict.fromkeys(parts[0::2]):
                if p:
                    pieces[p] = self._cache.get(p)
                    if pieces[p] is not None:
                        self._cache.move_to_end(p)
        todo = [p for p, got in pieces.items() if got is None]
        if todo:
            for piece, enc in zip(todo, self._backend.encode_batch(todo, add_special_tokens=False)):
                pieces[piece] = enc.ids
            with self._lock:
                for piece in todo:
                    self._cache[piece] = pieces[piece]
                while len(self._cache) > self.max_entries:
                    self._cache.popitem(last=False)
        ids: list[int] = []
        for i, p in enumerate(parts):
            if i % 2:
                ids.append(self._ids[p])
            elif p:
                ids.extend(pieces[p])
        self.misses += len(todo)
        self.hits += len(parts) // 2 + 1 - len(todo)
        if self._verify_left > 0:
            self._verify_left -= 1
            if ids != self.plain(text):  # this tokenizer does not split the way we assume
                self.enabled = False
                with self._lock:
                    self._cache.clear()
                return self.plain(text)
        return ids


def schema_defaults(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """Per tool, the argument defaults its JSON schema declares (harnesses fill them into echoed calls)."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = call_function(t)
        props = (fn.get("parameters") or {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        if isinstance(props, dict):
            d = {k: v["default"] for k, v in props.items() if isinstance(v, dict) and "default" in v}
            if d:
                out[str(fn.get("name"))] = d
    return out


def same_reply(echoed: tuple, sampled: tuple, defaults: dict[str, dict[str, Any]]) -> bool:
    """The harness echoed the proxy's reply, only filling in schema defaults of tool arguments.

    (Claude Code adds ``"replace_all": false`` to every Edit call it sends back.) The sampled
    tokens remain what the model produced, so the bridge continues from them.
    """
    if echoed[0] != "assistant" or echoed[1:2] != sampled[1:2] or echoed[3] != sampled[3]:
        return False
    if len(echoed[2]) != len(sampled[2]):
        return False
    for (name, args), (s_name, s_args) in zip(echoed[2], sampled[2]):
        if name != s_name:
            return False
        if args == s_args:
            continue
        a, sa = json.loads(args), json.loads(s_args)
        if not isinstance(a, dict) or not isinstance(sa, dict) or any(k not in a or a[k] != v for k, v in sa.items()):
            return False
        d = defaults.get(name, {})
        if any(k not in d or d[k] != v for k, v in a.items() if k not in sa):
            return False
    return True


class TemplateRenderer:
    """`apply_chat_template(..., tokenize=False)` without its per-call deep copies.

    transformers copies every message and tool schema into plain data on each render, which costs
    more than the rendering itself for long harness prompts. Messages reaching the bridge are already
    plain (canonical) data, so the compiled template renders them directly, with the same variables
    (special tokens, tools, add_generation_prompt). The first renders are checked against
    `apply_chat_template`; any difference switches this back to it for good.
    """

    def __init__(self, tokenizer: Any, verify_first: int = 3):
        self.tok = tokenizer
        self._verify_left = verify_first
        self._compiled: Any = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._compiled = _compile_jinja_template(tokenizer.chat_template)
            self._vars = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
        except Exception:  # noqa: BLE001 - any problem: use the public API
            self._compiled = None

    def slow(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                            tokenize=False)

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        if self._compiled is None:
            return self.slow(messages, tools, generation_prompt)
        try:
            text = self._compiled.render(messages=messages, tools=tools or None, documents=None,
                                         add_generation_prompt=generation_prompt, **self._vars)
        except Exception:  # noqa: BLE001 - let the public API raise its own error, if any
            self._compiled = None
            return self.slow(messages, tools, generation_prompt)
        if self._verify_left > 0:
            self._verify_left -= 1
            slow = self.slow(messages, tools, generation_prompt)
            if slow != text:
                self._compiled = None
                return slow
        return text


@dataclass
class PastCall:
    """What a session remembers of one call, to bridge the next one."""

    index: int
    messages: list[tuple]  # normalised request messages
    tools_key: str
    reply: tuple  # normalised assistant reply
    prompt_ids: list[int]
    completion_ids: list[int]
    prompt_text: str = ""  # the rendered prompt (kept for recent calls only): lets a child skip a render
    reasoning: str | None = None  # the reasoning of its reply (proxy/reasoning.py)


@dataclass
class BridgeResult:
    prompt_ids: list[int]
    parent_index: int | None
    segment_break: str | None
    naive_differs: bool
    naive_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    norm: list[tuple] | None = None  # normalize_message of each request message, when the build made them


NOT_PREFIX_STABLE = "chat template is not prefix-stable for this history"
NEW_CONVERSATION = "history rewritten or a new conversation: the messages do not extend any earlier call of this session"


def reasoning_dropped(past: PastCall, full: str) -> bool:
    """The prompt `full` no longer holds the reasoning the parent sampled: the template leaves past reasoning
    out (Qwen3 before the last user message, DeepSeek-R1 always), or the harness did not send it back.

    The prompt then does not extend the parent's prompt + completion. The bridge does not splice the sampled
    tokens back in (the engine would see a context no deployment of this checkpoint renders, and the checks
    that a render is prefix-stable could not hold): the call starts a new segment, so every sampled token
    stays trainable in the segment it was sampled in, and the prompt is what the template renders. Checked
    before either way of finding the reply's end, so neither can bridge over it silently."""
    if not past.reasoning:
        return False
    after = len(past.prompt_text) if full.startswith(past.prompt_text) else 0  # where the reply's turn is
    return past.reasoning.strip() not in full[after:]


class TokenBridge:
    """Builds prompts (module docstring). The chat format (`legorl.models.chat_format`) says which token
    closes a turn in the template's text, which sampled ids already closed the parent's reply, and
    whether legorl writes the tool conversation around a template that cannot."""

    def __init__(self, tokenizer: Any, chat_format: ChatFormat | None = None):
        self.tok = tokenizer
        self.format = chat_format if chat_format is not None else read_chat_format(tokenizer)
        self.eos_text = self.format.end_of_turn  # the end-of-turn token as the template writes it
        self.eos_id = self.format.end_of_turn_id
        self.turn_end_ids = frozenset(self.format.turn_end_ids)
        self.encoder = CachedEncoder(tokenizer)
        self.renderer = TemplateRenderer(tokenizer)
        self._fast_ok = True
        self._fast_verify_left = 3

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        shaped, tools = self.format.prepare(template_messages(messages), tools)
        return self.renderer.render(shaped, tools, generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.encoder.encode(text)

    def count(self, messages: list[dict], tools: list[dict] | None) -> int:
        return len(self.encode(self.render(messages, tools, generation_prompt=True)))

    @staticmethod
    def tools_key(tools: list[dict] | None) -> str:
        return hashlib.sha1(json.dumps(tools or [], sort_keys=True).encode()).hexdigest()

    def build(self, messages: list[dict], tools: list[dict] | None, history: list[PastCall],
              tools_key: str | None = None) -> BridgeResult:
        full = self.render(messages, tools, generation_prompt=True)
        naive_ids = self.encode(full)
        if not history:
            return BridgeResult(naive_ids, None, None, False, naive_ids, full)
        norm = [normalize_message(m) for m in messages]
        tkey = tools_key if tools_key is not None else self.tools_key(tools)
        defaults = schema_defaults(tools)
        reason = NEW_CONVERSATION
        best_prefix = -1
        for past in reversed(history):
            k = len(past.messages)
            if len(norm) <= k or norm[:k] != past.messages:
                continue
            if norm[k] != past.reply and not same_reply(norm[k], past.reply, defaults):
                if k > best_prefix:
                    best_prefix = k
                    reason = (f"history rewritten: message {k} is not the reply of call {past.index} "
                              "(the harness edited, dropped or replaced it)")
                continue
            if len(norm) == k + 1:  # ends with the reply itself: nothing new to prompt from
                continue
            if past.tools_key != tkey:
                reason = "tool definitions changed"
                break
            if reasoning_dropped(past, full):
                reason = REASONING_DROPPED
                break
            ids = self._bridge(messages, tools, k + 1, past, full)
            if ids is None:
                reason = NOT_PREFIX_STABLE
                break
            return BridgeResult(ids, past.index, None, ids != naive_ids, naive_ids, full, norm)
        return BridgeResult(naive_ids, None, reason, False, naive_ids, full, norm)

    def _reply_end(self, messages: list[dict], tools: list[dict] | None, k: int, past: PastCall,
                   full: str, closer: str) -> tuple[int, str] | None:
        """Where, in `full`, the token closing message k-1 (the parent's reply) starts, and that token's text.

        The closer is the turn-end token the reply was sampled with when the template writes it there (gpt-oss
        ends a tool call on <|call|>, other turns on <|end|>), else the template's end-of-turn (Llama's sampled
        <|eom_id|> is rendered as <|eot_id|>). Exact way: render messages[:k] and find its last closer. Fast way
        (no second render): the first closer after the parent's own rendered prompt, valid when the reply's text
        holds no closer string; the fast way is checked against the exact one on the first bridges.
        """
        fast = None
        if self._fast_ok and past.prompt_text and full.startswith(past.prompt_text) and \
                closer not in json.dumps(messages[k - 1], ensure_ascii=False, default=str):
            at = full.find(closer, len(past.prompt_text))
            fast = at if at >= 0 else None
        if fast is not None and self._fast_verify_left <= 0:
            return fast, closer
        upto_reply = self.render(messages[:k], tools, generation_prompt=False)
        if not full.startswith(upto_reply):
            return None
        end = upto_reply.rfind(closer)
        if closer != self.eos_text and end <= upto_reply.rfind(self.eos_text):  # not what closes the reply
            closer, end = self.eos_text, upto_reply.rfind(self.eos_text)
        if fast is not None:
            self._fast_verify_left -= 1
            if fast != end:
                self._fast_ok = False
        return (end, closer) if end >= 0 else None

    def _bridge(self, messages: list[dict], tools: list[dict] | None, k: int, past: PastCall,
                full: str) -> list[int] | None:
        """Tokens of `full` with the first k messages replaced by the parent's exact tokens."""
        # A reply that ended on a turn-ending id (the end-of-turn token, or another the model may sample, e.g.
        # Llama's <|eom_id|>, gpt-oss's <|call|>) is closed already; one cut by max_tokens or a stop string is not.
        ended = bool(past.completion_ids) and past.completion_ids[-1] in self.turn_end_ids
        closer = self.tok.convert_ids_to_tokens(past.completion_ids[-1]) if ended else self.eos_text
        found = self._reply_end(messages, tools, k, past, full, closer)
        if found is None:
            return None
        end, closer = found
        # After the reply's closer: what the template puts there (e.g. "\n"), then the new turns.
        tail = ("" if ended else self.eos_text) + full[end + len(closer):]
        return past.prompt_ids + past.completion_ids + self.encode(tail)
