"""The canonical request every wire format is parsed into, and the checks and helpers the parsers share.

Canonical messages are OpenAI-chat shaped: ``{"role": system|user|assistant|tool, "content": str | None,
"tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}], "tool_call_id"}``;
canonical tools are OpenAI function tools ``{"type": "function", "function": {"name", "description",
"parameters"}}``. The chat template and the token bridge only ever see this shape, so every format
bridges tokens the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from legorl.proxy.errors import ProxyError

MAX_N = 16
MAX_TOP_LOGPROBS = 20


@dataclass
class ChatRequest:
    """One request in canonical form; `body` is what the harness sent, recorded as is."""

    wire_format: str  # "openai_chat" | "openai_responses" | "anthropic_messages"
    body: dict[str, Any]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    model: str = ""
    max_tokens: int | None = None  # what the harness asked for (the run's cap still applies)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    parse_tools: bool = True  # False for tool_choice "none" or no tools: tool-call text stays text
    logprobs: bool = False
    top_logprobs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # format-specific details for the answer


@dataclass(frozen=True)
class Dialect:
    """How a wire format names a nested field and words what is wrong with it."""

    top: str  # a top-level field
    index: str  # a list element of a field
    must: str  # "<field> must be <what>"
    part: str  # what a content list holds
    part_object: str  # one element of a content list, as a noun


OPENAI = Dialect(top="'{}'", index="{}[{}]", must="{} must be {}", part="content part", part_object="an object")
ANTHROPIC = Dialect(top="{}", index="{}.{}", must="{}: must be {}", part="content block",
                    part_object="a content block object")


class Problems:
    """Collects every problem of a request body, so one 400 names them all."""

    def __init__(self, dialect: Dialect = OPENAI) -> None:
        self.items: list[tuple[str, str]] = []  # (param, message)
        self.dialect = dialect

    def add(self, param: str, message: str) -> None:
        self.items.append((param, message))

    def at(self, where: str, j: int) -> str:
        """The name of element `j` of the list at `where`."""
        return self.dialect.index.format(where, j)

    def must(self, where: str, what: str, top: bool = False) -> None:
        """`where` must be `what` (`top`: `where` is a top-level field of the body)."""
        self.add(where, self.dialect.must.format(self.dialect.top.format(where) if top else where, what))

    def raise_if_any(self) -> None:
        if self.items:
            msg = "; ".join(m for _, m in self.items)
            raise ProxyError(f"invalid request: {msg}", param=self.items[0][0])

    # -- typed field checks (absent or None is fine unless required) --------------------------------
    def typed(self, body: dict, key: str, types: type | tuple[type, ...], what: str, required: bool = False,
              prefix: str = "") -> Any:
        name = f"{prefix}{key}"
        if key not in body or body[key] is None:
            if required:
                self.add(name, f"'{name}' is required")
            return None
        v = body[key]
        if not isinstance(v, types) or (isinstance(v, bool) and bool not in _as_tuple(types)):
            self.add(name, f"'{name}' must be {what}, got {type(v).__name__}")
            return None
        return v

    def number(self, body: dict, key: str, lo: float | None = None, hi: float | None = None) -> float | None:
        v = self.typed(body, key, (int, float), "a number")
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            self.add(key, f"'{key}' must be between {lo} and {hi}, got {v}")
            return None
        return v

    def integer(self, body: dict, key: str, lo: int | None = None, hi: int | None = None,
                required: bool = False) -> int | None:
        v = self.typed(body, key, int, "an integer", required=required)
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            self.add(key, f"'{key}' must be {bound}, got {v}")
            return None
        return v

    def boolean(self, body: dict, key: str) -> bool:
        return bool(self.typed(body, key, bool, "a boolean"))

    def stop_list(self, body: dict, key: str, limit: int | None = None) -> list[str]:
        v = body.get(key)
        if v is None:
            return []
        if isinstance(v, str):
            return [v] if v else []
        if isinstance(v, list) and all(isinstance(s, str) for s in v):
            if limit is not None and len(v) > limit:
                self.add(key, f"'{key}' allows at most {limit} sequences, got {len(v)}")
            return [s for s in v if s]
        self.add(key, f"'{key}' must be a string or an array of strings")
        return []

    def content_text(self, content: Any, where: str, text_types: tuple[str, ...], *, refusals: bool = True,
                     join: Callable[[list[str]], str] = "".join) -> str | None:
        """The text of a content value: a string, None (""), or a list of typed parts whose text parts
        (and refusals) are joined; other parts (images...) are not rendered. None when it is malformed."""
        if content is None:
            return ""
        if isinstance(content, str):
            return content
        if not isinstance(content, list):
            self.must(where, f"a string or an array of {self.dialect.part}s")
            return None
        texts = []
        for j, part in enumerate(content):
            at = self.at(where, j)
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                self.must(at, f"{self.dialect.part_object} with a 'type'")
                return None
            if part["type"] in text_types:
                if not isinstance(part.get("text"), str):
                    self.must(f"{at}.text", "a string")
                    return None
                texts.append(part["text"])
            elif refusals and part["type"] == "refusal" and isinstance(part.get("refusal"), str):
                texts.append(part["refusal"])
        return join(texts)

    def tool_array(self, tools: Any) -> list[Any] | None:
        """The `tools` array of a body (None when absent or malformed)."""
        if tools is not None and not isinstance(tools, list):
            self.must("tools", "an array", top=True)
            return None
        return tools

    def openai_tool_choice(self, body: dict[str, Any]) -> Any:
        choice = body.get("tool_choice")
        if choice is not None and not (choice in ("none", "auto", "required") or isinstance(choice, dict)):
            self.add("tool_choice", "'tool_choice' must be 'none', 'auto', 'required' or an object")
        return choice

    def unknown(self, body: dict, known: frozenset[str]) -> None:
        extra = sorted(k for k in body if k not in known)
        if extra:
            self.add(extra[0], f"unrecognized request argument(s): {', '.join(map(repr, extra))}")


def _as_tuple(t: type | tuple[type, ...]) -> tuple[type, ...]:
    return t if isinstance(t, tuple) else (t,)


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ProxyError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def join_texts(texts: list[str]) -> str:
    """Concatenate text blocks; a newline goes between two blocks unless one already sits there."""
    out = ""
    for t in texts:
        if out and t and not out[-1].isspace() and not t[0].isspace():
            out += "\n"
        out += t
    return out


def function_tool(name: str, description: str | None, parameters: Any) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    if description:
        fn["description"] = description
    fn["parameters"] = parameters if isinstance(parameters, dict) else {"type": "object", "properties": {}}
    return {"type": "function", "function": fn}
