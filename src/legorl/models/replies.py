"""Messages in the chat template's shape, and an assistant reply written as the policy would sample it.

A teacher that answers in messages (a hosted model behind `engine: upstream`, a scripted demonstration
written in legorl's `<tool_call>` syntax) has no sampled ids: its reply must become the ids a model of
the policy's family would sample for it, in that family's own tool-call syntax (`llama3_json`,
`mistral`, `harmony`...), or the demonstration teaches a syntax the proxy does not read. `reply_ids`
takes them from the chat template itself: the rendering of the reply after the generation prompt, up
to and including the first stop id (where an engine stops). The next call's prompt is then the
template's own rendering of the same conversation, so the token bridge continues it exactly.
"""

from __future__ import annotations

import json
from typing import Any

from legorl.models.chat_format import ChatFormat, ChatFormatError


def content_text(content: Any) -> str:
    """Message content as text: a string, None, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def args_value(arguments: Any) -> Any:
    """A call's arguments as templates take them: parsed JSON where the text is JSON."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def call_function(call: Any) -> dict[str, Any]:
    """The `function` part of a canonical tool call ({} when it has none)."""
    if not isinstance(call, dict):
        return {}
    fn = call.get("function")
    return fn if isinstance(fn, dict) else {}


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages in the shape the chat template expects (text content, parsed arguments)."""
    out = []
    for m in messages:
        t: dict[str, Any] = {"role": m.get("role"), "content": content_text(m.get("content"))}
        if m.get("tool_calls"):
            fns = [call_function(c) for c in m["tool_calls"]]
            t["tool_calls"] = [{"type": "function", "function": {"name": f.get("name"),
                                                                 "arguments": args_value(f.get("arguments"))}}
                               for f in fns]
        if m.get("reasoning_content"):  # reasoning the harness sent back: templates that keep it render it
            t["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_call_id"):
            t["tool_call_id"] = m["tool_call_id"]
        if m.get("name"):
            t["name"] = m["name"]
        out.append(t)
    return out


def reply_ids(tokenizer: Any, fmt: ChatFormat, messages: list[dict[str, Any]], tools: list[dict] | None,
              reply: dict[str, Any]) -> list[int]:
    """The ids a model of this chat format samples for `reply` (a canonical assistant message) after
    `messages`: the template's rendering of the reply after its generation prompt, up to and including the
    first stop id. Raises ChatFormatError where the template cannot write a reply the way a sampled one ends."""

    def render(msgs: list[dict[str, Any]], generation_prompt: bool) -> str:
        shaped, shaped_tools = fmt.prepare(template_messages(msgs), tools)
        return tokenizer.apply_chat_template(shaped, tools=shaped_tools, add_generation_prompt=generation_prompt,
                                             tokenize=False)

    prompt, full = render(messages, True), render([*messages, reply], False)
    if not full.startswith(prompt):
        raise ChatFormatError("the template writes an assistant turn that does not start with its generation "
                              "prompt, so no sampled reply can render as the template renders it")
    ids = tokenizer.encode(full[len(prompt):], add_special_tokens=False)
    stop = next((j for j, t in enumerate(ids) if t in fmt.stop_ids), None)
    if stop is not None:
        return ids[:stop + 1]
    end = next((j for j, t in enumerate(ids) if t in fmt.turn_end_ids), None)
    if end is not None and not reply.get("tool_calls"):
        # gpt-oss writes a final answer in the history closed by <|end|>; sampled, it ends on <|return|>
        return ids[:end] + [fmt.stop_ids[0]]
    raise ChatFormatError(f"the template ends an assistant {'tool call' if reply.get('tool_calls') else 'reply'} "
                          f"with no stop id ({full[len(prompt):][-40:]!r}): the engine would not stop there")
