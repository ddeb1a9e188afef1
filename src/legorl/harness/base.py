"""What the orchestrator asks of a harness, whatever the harness is."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class ToolStyle:
    """How a harness takes a shell command, and how its episode ends."""

    tool: str  # the shell tool the harness declares
    arg: str  # its command argument
    submit: str | None  # the command that submits; None: a reply without a tool call ends the episode
    # False where the shell tool refuses command substitution (Gemini CLI blocks `$(...)`): a file the
    # command finds is piped to it through xargs instead.
    substitution: bool = True
    # True: the command goes in a fenced bash block of the text (mini-swe-agent's text mode), not a tool call
    text: bool = False


@dataclass
class HarnessRun:
    rollout_id: str
    task_text: str  # the problem statement as the agent sees it
    api_base: str  # OpenAI-style base URL of this rollout's proxy session
    api_key: str  # the session token
    model_name: str
    control_socket: str  # the sandbox's command socket (host path)
    # The session's base URL as seen INSIDE the sandbox (http://127.0.0.1:<relay_port>/s/<token>, no /v1):
    # harnesses that run inside the sandbox (Claude Code, Codex) reach the proxy through the relay.
    relay_base: str = ""


@dataclass
class HarnessResult:
    exit_status: str  # the harness's own word: Submitted, LimitsExceeded, an exception name...
    n_calls: int
    error: str = ""
    traceback: str = ""
    messages: list[dict] = field(default_factory=list)


class HarnessCrashed(Exception):
    """The harness process died; the rollout is an agent_crash."""


class Harness(Protocol):
    name: str
    # The scripted teacher's turns for this harness: a key of rollout/teacher.py's TOOL_STYLES (its name,
    # or a variant such as mini-swe-agent's text mode), or its own ToolStyle (harness.name command).
    teacher_style: str | ToolStyle

    async def start(self) -> None: ...

    async def run(self, run: HarnessRun) -> HarnessResult: ...

    def call_kind(self, body: dict[str, Any]) -> str:
        """The session a model request belongs to, from its body: MAIN_SESSION for the agent's own turns, or
        the name of a side call (a title, a next-speaker check, a sub-agent), recorded in a session of its own."""
        ...

    async def close(self) -> None: ...
