"""Gemini request bodies as canonical messages, tools and sampling fields (gemini.py is the wire format).

Google's REST API reads each field under both spellings (proto JSON: `systemInstruction` and
`system_instruction`; its own curl examples use snake_case), so every structural field is read
under either name. User data (function args and responses, schema property names) is left as sent.

`contents` become canonical messages: the text parts of a content are joined, `functionCall` parts
(role `model`) become the assistant's tool calls, each `functionResponse` part a tool message (before
the text of the same turn), a model turn's thought parts its `reasoning_content`. Inline data, files and
code-execution parts are not rendered: the served model has no use for them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from legorl.proxy.request import MAX_N, MAX_TOP_LOGPROBS, Dialect, Problems, function_tool, join_texts

GEMINI = Dialect(top="{}", index="{}[{}]", must="{} must be {}", part="part", part_object="a part object")
MAX_STOP_SEQUENCES = 5  # Google's limit
MODES = ("AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED")
RESULT_KEYS = ("output", "result", "content")  # a response holding just one of these is shown as that text


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def get(d: dict[str, Any], name: str) -> Any:
    """A field under its camelCase name or its snake_case name."""
    return d[name] if name in d else d.get(snake(name))


def spellings(names: set[str]) -> frozenset[str]:
    return frozenset(names) | {snake(n) for n in names}


def unknown_fields(body: dict[str, Any], known: frozenset[str], p: Problems, where: str = "") -> None:
    """Google's wording for a field the API does not have."""
    for k in sorted(k for k in body if k not in known):
        at = f" at '{where}'" if where else ""
        p.add(f"{where}.{k}" if where else k, f'Invalid JSON payload received. Unknown name "{k}"{at}: '
                                              "Cannot find field.")


# ---- contents ------------------------------------------------------------------------------------

def content_text(content: Any, where: str, p: Problems) -> str | None:
    """The text of a `systemInstruction`: a Content object (or, leniently, a string or a list of parts)."""
    if isinstance(content, str):
        return content
    parts = get(content, "parts") if isinstance(content, dict) else content
    if not isinstance(parts, list):
        p.must(where, "a Content object {parts: [{text}]}")
        return None
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text", ""), str):
            p.must(f"{where}.parts[{j}]", "a part object with a string 'text'")
            return None
        if isinstance(part.get("text"), str) and not part.get("thought"):
            texts.append(part["text"])
    return join_texts(texts)


def contents_messages(items: list[Any], p: Problems, failed: set[str] | None = None) -> list[dict[str, Any]]:
    """Canonical messages of `contents` (and of the system item `conversation` puts first); `failed`
    collects the ids of function responses that report an error (`{"error": ...}`)."""
    out: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []  # the last model turn's tool calls not yet answered
    for i, c in enumerate(items):
        where = f"contents[{i}]"
        if not isinstance(c, dict):
            p.must(where, "a Content object {role, parts}")
            continue
        role = c.get("role") or "user"
        parts = get(c, "parts")
        if role not in ("user", "model", "function", "system"):
            p.add(f"{where}.role", f"{where}.role must be 'user' or 'model', got {role!r}")
            continue
        if not isinstance(parts, list):
            p.must(f"{where}.parts", "an array of parts ({text}, {functionCall} or {functionResponse})")
            continue
        if role == "system":
            out.append({"role": "system", "content": content_text(c, where, p) or ""})
            continue
        msgs = _turn(role, parts, where, i, pending, p, failed if failed is not None else set())
        if role == "model":
            pending = [dict(t) for m in msgs for t in m.get("tool_calls", [])]
        out += msgs
    return out


def _turn(role: str, parts: list[Any], where: str, i: int, pending: list[dict[str, Any]],
          p: Problems, failed: set[str]) -> list[dict[str, Any]]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        pw = f"{where}.parts[{j}]"
        if not isinstance(part, dict):
            p.must(pw, "a part object")
            return []
        call, response = get(part, "functionCall"), get(part, "functionResponse")
        if "text" in part:
            if not isinstance(part["text"], str):
                p.must(f"{pw}.text", "a string")
                return []
            (thoughts if part.get("thought") else texts).append(part["text"])  # a thought: the model's reasoning
        elif call is not None:
            if role != "model" or not isinstance(call, dict) or not isinstance(call.get("name"), str) \
                    or not isinstance(call.get("args") or {}, dict):
                p.add(f"{pw}.functionCall", f"{pw}.functionCall must be {{name: string, args: object}} "
                                            "on a content with role 'model'")
                return []
            # A call without an id gets one from its place: the same history always gets the same id.
            cid = call.get("id") or f"{call['name']}-{i}-{j}"
            calls.append({"id": cid, "type": "function",
                          "function": {"name": call["name"], "arguments": call.get("args") or {}}})
        elif response is not None:
            if role == "model" or not isinstance(response, dict) or not isinstance(response.get("name"), str) \
                    or not isinstance(response.get("response") or {}, dict):
                p.add(f"{pw}.functionResponse", f"{pw}.functionResponse must be {{name: string, response: "
                                                "object}} on a content with role 'user'")
                return []
            result = response.get("response") or {}
            results.append({"role": "tool", "tool_call_id": _answered(response, pending),
                            "content": response_text(result)})
            if "error" in result:
                failed.add(results[-1]["tool_call_id"])
        # inlineData, fileData, executableCode, codeExecutionResult...: accepted, not rendered
    if role == "model":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}  # streamed pieces
        if "".join(thoughts):
            msg["reasoning_content"] = "".join(thoughts)
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    out = list(results)
    if texts or not results:
        out.append({"role": "user", "content": join_texts(texts)})
    return out


def _answered(response: dict[str, Any], pending: list[dict[str, Any]]) -> str:
    """The id of the call a response answers: its own, else the first unanswered call of that name."""
    rid = response.get("id")
    for k, t in enumerate(pending):
        if (t["id"] == rid) if rid else (t["function"]["name"] == response["name"]):
            return pending.pop(k)["id"]
    return rid or response["name"]


def response_text(response: dict[str, Any]) -> str:
    """What the model is shown of a function response: the text of `{"output": "..."}` and the like
    (Gemini CLI's shape), else the response as JSON."""
    if len(response) == 1:
        (k, v), = response.items()
        if k in RESULT_KEYS and isinstance(v, str):
            return v
    return json.dumps(response, ensure_ascii=False)


# ---- tools ---------------------------------------------------------------------------------------

def tools(raw: Any, p: Problems) -> list[dict[str, Any]] | None:
    """Function declarations as canonical tools; hosted tools (googleSearch, codeExecution...) are not
    offered to the model."""
    raw = p.tool_array(raw)
    if raw is None:
        return None
    out = []
    for i, t in enumerate(raw):
        decls = get(t, "functionDeclarations") if isinstance(t, dict) else None
        if not isinstance(t, dict) or not isinstance(decls or [], list):
            p.must(f"tools[{i}]", "a Tool object {functionDeclarations: [...]}")
            continue
        for k, d in enumerate(decls or []):
            if not isinstance(d, dict) or not isinstance(d.get("name"), str):
                p.must(f"tools[{i}].functionDeclarations[{k}]", "an object with a string 'name'")
                continue
            params = get(d, "parametersJsonSchema")
            if params is None and get(d, "parameters") is not None:
                params = json_schema(get(d, "parameters"))
            out.append(function_tool(d["name"], d.get("description"), params))
    return out or None


def json_schema(s: Any) -> Any:
    """Google's OpenAPI-style Schema as JSON Schema: types lower-cased (`OBJECT` -> `object`), keywords
    camelCased; property names are kept as sent."""
    if isinstance(s, list):
        return [json_schema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out: dict[str, Any] = {}
    for k, v in s.items():
        key = camel(k)
        if key == "type":
            out[key] = v.lower() if isinstance(v, str) else [t.lower() if isinstance(t, str) else t for t in v] \
                if isinstance(v, list) else v
        elif key in ("properties", "defs", "$defs") and isinstance(v, dict):
            out[key] = {name: json_schema(sub) for name, sub in v.items()}
        elif key in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "additionalProperties", "not"):
            out[key] = json_schema(v)
        else:
            out[key] = v
    return out


def calling_mode(body: dict[str, Any], p: Problems) -> str:
    """`toolConfig.functionCallingConfig.mode` (AUTO when absent)."""
    config = get(body, "toolConfig")
    if config is None:
        return "AUTO"
    fcc = get(config, "functionCallingConfig") if isinstance(config, dict) else None
    mode = (get(fcc, "mode") if isinstance(fcc, dict) else None) or "AUTO"
    names = get(fcc, "allowedFunctionNames") if isinstance(fcc, dict) else None
    if not isinstance(config, dict) or not isinstance(fcc or {}, dict) or mode not in MODES:
        p.add("toolConfig", "toolConfig must be {functionCallingConfig: {mode: AUTO | ANY | NONE | VALIDATED, "
                            "allowedFunctionNames: [...]}}")
    elif names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        p.must("toolConfig.functionCallingConfig.allowedFunctionNames", "an array of strings")
    return mode


# ---- generationConfig -------------------------------------------------------------------------------

@dataclass
class Generation:
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0


def generation(body: dict[str, Any], p: Problems) -> Generation:
    """The sampling fields of `generationConfig`, checked. The run's sampling section decides temperature,
    topP and topK (core.py); maxOutputTokens is capped by it; the rest is recorded with the request."""
    g = get(body, "generationConfig")
    out = Generation()
    if g is None:
        return out
    if not isinstance(g, dict):
        p.must("generationConfig", "an object")
        return out

    def num(name: str, lo: float, hi: float | None, integer: bool = False) -> Any:
        v = get(g, name)
        types = (int,) if integer else (int, float)
        if v is None:
            return None
        if not isinstance(v, types) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
            kind = "an integer" if integer else "a number"
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            p.add(f"generationConfig.{name}", f"generationConfig.{name} must be {kind} {bound}, got {v!r}")
            return None
        return v

    num("temperature", 0, 2)
    num("topP", 0, 1)
    num("topK", 0, None)
    num("presencePenalty", -2, 2)
    num("frequencyPenalty", -2, 2)
    out.max_tokens = num("maxOutputTokens", 1, None, integer=True)
    out.n = num("candidateCount", 1, None, integer=True) or 1
    if out.n > MAX_N:
        p.add("generationConfig.candidateCount",
              f"generationConfig.candidateCount must be at most {MAX_N} (each candidate is a separate sample of "
              f"the same prompt), got {out.n}")
    seed = get(g, "seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        p.add("generationConfig.seed", f"generationConfig.seed must be an integer, got {seed!r}")
    out.seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else None
    stop = get(g, "stopSequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            p.must("generationConfig.stopSequences", "an array of strings")
        elif len(stop) > MAX_STOP_SEQUENCES:
            p.add("generationConfig.stopSequences", f"generationConfig.stopSequences allows at most "
                                                    f"{MAX_STOP_SEQUENCES} sequences, got {len(stop)}")
        else:
            out.stop = [s for s in stop if s]
    want = get(g, "responseLogprobs")
    if want is not None and not isinstance(want, bool):
        p.must("generationConfig.responseLogprobs", "a boolean")
    out.logprobs = want is True
    out.top_logprobs = num("logprobs", 0, MAX_TOP_LOGPROBS, integer=True) or 0
    if out.top_logprobs and not out.logprobs:
        p.add("generationConfig.logprobs", "generationConfig.logprobs requires generationConfig.responseLogprobs: "
                                           "true")
    for name in ("thinkingConfig", "responseSchema", "responseJsonSchema"):
        v = get(g, name)
        if v is not None and not isinstance(v, (dict, bool)):
            p.must(f"generationConfig.{name}", "an object")
    mime = get(g, "responseMimeType")
    if mime is not None and not isinstance(mime, str):
        p.must("generationConfig.responseMimeType", "a string")
    return out
