"""A coding agent of your own, as `harness.name: command` runs it (docs/harnesses/command.md).

It knows nothing of legorl: the official `openai` SDK reads the proxy session from OPENAI_BASE_URL and
OPENAI_API_KEY, the task comes from $LEGORL_PROMPT_FILE, the model's name from $LEGORL_MODEL. One `bash`
tool; the episode ends when a reply calls no tool (exit 0). AGENT_STREAM=1 streams the replies,
AGENT_TITLE=1 first asks for a title without tools (a side call, as many CLIs make).

    harness: {name: command, command: "python3 examples/bash_agent.py"}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from openai import OpenAI

SYSTEM = "You are a coding agent. Fix the bug in the repository with the bash tool, then reply Done."
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the repository and see its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def ask(client: OpenAI, model: str, messages: list[dict], stream: bool) -> dict:
    """One model call; the reply as a message dict (content and tool calls)."""
    if not stream:
        return client.chat.completions.create(model=model, messages=messages, tools=TOOLS).choices[0].message \
            .model_dump(exclude_none=True)
    content, calls = "", {}
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            call["id"] += tc.id or ""
            call["function"]["name"] += (tc.function.name or "") if tc.function else ""
            call["function"]["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return {"role": "assistant", "content": content, **({"tool_calls": list(calls.values())} if calls else {})}


def main() -> int:
    client, model = OpenAI(), os.environ["LEGORL_MODEL"]
    task = Path(os.environ["LEGORL_PROMPT_FILE"]).read_text()
    if os.environ.get("AGENT_TITLE"):
        client.chat.completions.create(model=model, messages=[
            {"role": "user", "content": f"Write a five-word title for this task:\n{task}"}])
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    for _ in range(int(os.environ.get("AGENT_MAX_STEPS", "30"))):
        reply = ask(client, model, messages, stream=bool(os.environ.get("AGENT_STREAM")))
        messages.append(reply)
        if not reply.get("tool_calls"):
            print(reply.get("content") or "")
            return 0
        for call in reply["tool_calls"]:
            try:
                command = json.loads(call["function"]["arguments"])["command"]
                done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=30, check=False,
                                      stdin=subprocess.DEVNULL)
                output = (done.stdout + done.stderr)[-4000:] or "(no output)"
            except (ValueError, KeyError, TypeError) as e:
                output = f"bad tool call: {e}"
            except subprocess.TimeoutExpired:
                output = "the command timed out after 30 s"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    print("step limit reached", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
