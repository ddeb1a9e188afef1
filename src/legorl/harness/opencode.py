"""OpenCode, unmodified, run INSIDE the rollout's sandbox with `opencode run` (non-interactive).

OpenCode takes its whole configuration as JSON in `OPENCODE_CONFIG_CONTENT`: the adapter defines a
`legorl` provider whose base URL is the session's relay URL + `/v1` through one of the AI SDK
packages OpenCode bundles, which sets the wire format (`@ai-sdk/openai-compatible`: Chat
Completions, `@ai-sdk/openai`: Responses, `@ai-sdk/anthropic`: Messages), with the session token
as its API key. Its prompt is shortened through the same config, never by patching it
(docs/harnesses/opencode.md): `system_prompt` is the `build` agent's prompt, `tools` switches every
other tool off. Its title generator (a side call before the first turn, no tools) is disabled (when
enabled through `config`, it is recorded in the rollout's `title` side session), and so are its
workspace snapshots (a git store of every step, of no use to a rollout).

OpenCode has no turn limit switch of its own: `max_calls` is enforced by the proxy session, which
refuses the call past it and the episode ends as max_turns. Exit status (rollout/outcomes.py):
"Submitted" when its last step finished with `stop`, the step's finish reason otherwise (`length`:
a reply cut at max_tokens), "turn_failed" with the error it reported, "exited" when no step finished.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from legorl.harness.base import HarnessResult, HarnessRun
from legorl.harness.in_sandbox import SandboxedCLI, check_tools, exec_cli, json_line, merge, side_unless_tools
from legorl.records import MAIN_SESSION

# The wire format a provider package speaks, as the proxy names it.
WireFormat = Literal["openai_chat", "openai_responses", "anthropic_messages"]
PROVIDER_PACKAGES: dict[str, str] = {"openai_chat": "@ai-sdk/openai-compatible",
                                     "openai_responses": "@ai-sdk/openai",
                                     "anthropic_messages": "@ai-sdk/anthropic"}

# The tools OpenCode 1.18 declares to the model, in the groups its `tools` config switches off
# together (edit and write share one permission: either key removes both). The shell (`bash`)
# always stays: it is how it acts.
TOOL_GROUPS = (("bash",), ("edit", "write"), ("glob",), ("grep",), ("read",), ("skill",), ("task",),
               ("todowrite",), ("webfetch",))
TOOLS = tuple(t for group in TOOL_GROUPS for t in group)
TITLE_AGENT = "You are a title generator"  # how its title agent's prompt begins


def opencode_tool_switches(tools: list[str]) -> dict[str, bool]:
    """The config's `tools` map that leaves `tools` declared (with their group); ValueError naming an unknown tool."""
    check_tools("OpenCode", tools, TOOLS, "bash")
    return {t: False for group in TOOL_GROUPS if not set(group) & set(tools) for t in group}


def opencode_config(run: HarnessRun, *, wire_format: str = "openai_chat", system_prompt: str | None = None,
                    tools: list[str] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """OPENCODE_CONFIG_CONTENT: the legorl provider at the session's relay URL, the switches, `extra` merged in."""
    config: dict[str, Any] = {
        "provider": {"legorl": {
            "npm": PROVIDER_PACKAGES[wire_format],
            "name": "legorl",
            "options": {"baseURL": run.relay_base.rstrip("/") + "/v1", "apiKey": run.api_key},
            "models": {run.model_name: {"name": run.model_name}},
        }},
        "model": f"legorl/{run.model_name}",
        "autoupdate": False,
        "share": "disabled",
        "snapshot": False,
        "agent": {"title": {"disable": True}},
    }
    if system_prompt is not None:
        config["agent"]["build"] = {"prompt": system_prompt}
    if tools is not None:
        config["tools"] = opencode_tool_switches(tools)
    return merge(config, extra or {})


@dataclass(kw_only=True)
class OpenCodeHarness(SandboxedCLI):
    """Harness protocol adapter for OpenCode (`opencode run --format json`). `system_prompt` is the
    build agent's prompt, `tools` keeps only these tools (and bash), `wire_format` picks the provider
    package (Chat Completions by default), `config` merges more keys into its JSON config."""

    cli = "opencode"
    wire_format: WireFormat = "openai_chat"
    config: dict[str, Any] = field(default_factory=dict)
    max_calls: int | None = None  # enforced by the proxy session (OpenCode has no turn limit switch)
    name: str = "opencode"

    def __post_init__(self) -> None:
        if self.wire_format not in PROVIDER_PACKAGES:
            raise ValueError(f"harness.wire_format: OpenCode speaks {', '.join(PROVIDER_PACKAGES)}, "
                             f"not {self.wire_format!r}")
        if self.tools is not None:
            opencode_tool_switches(self.tools)  # an unknown tool fails at construction
        if self.append_system_prompt is not None:
            raise ValueError("harness.append_system_prompt: OpenCode has no such switch; use harness.system_prompt")

    def call_kind(self, body: dict[str, Any]) -> str:
        """Its title request (when `agent.title` is enabled) declares no tools and opens with its title agent's prompt."""
        if (kind := side_unless_tools(body)) == MAIN_SESSION:
            return kind
        return "title" if TITLE_AGENT in json.dumps(body)[:4000] else kind

    def env(self, run: HarnessRun) -> dict[str, str]:
        config = opencode_config(run, wire_format=self.wire_format, system_prompt=self.system_prompt,
                                 tools=self.tools, extra=self.config)
        env = {"OPENCODE_CONFIG_CONTENT": json.dumps(config), "HOME": "/tmp", "NO_COLOR": "1", "TERM": "dumb",
               # offline and self-contained: no models.dev fetch, no LSP download, no share link, no
               # config, rules or skills read from the workspace or ~/.claude, no compaction side call
               **dict.fromkeys(("OPENCODE_DISABLE_MODELS_FETCH", "OPENCODE_DISABLE_LSP_DOWNLOAD",
                                "OPENCODE_DISABLE_AUTOUPDATE", "OPENCODE_DISABLE_SHARE",
                                "OPENCODE_DISABLE_PROJECT_CONFIG", "OPENCODE_DISABLE_CLAUDE_CODE",
                                "OPENCODE_DISABLE_EXTERNAL_SKILLS", "OPENCODE_DISABLE_AUTOCOMPACT"), "1")}
        return self.with_extra_env(env)

    def command(self, run: HarnessRun) -> str:
        return self.shell("run", "--format", "json", *self.extra_args, self.prompt(run))

    async def run(self, run: HarnessRun) -> HarnessResult:
        if (unstarted := self.missing_relay(run)) is not None:
            return unstarted
        output, rc = await exec_cli(run, self.command(run), self.env(run), self.timeout)
        events = [e for e in (json_line(line) for line in output.splitlines()) if e is not None]
        finished = [e["part"].get("reason", "") for e in events
                    if e.get("type") == "step_finish" and isinstance(e.get("part"), dict)]
        errors = [_error_text(e) for e in events if e.get("type") == "error"]
        texts = [e["part"].get("text", "") for e in events
                 if e.get("type") == "text" and isinstance(e.get("part"), dict)]
        if errors:
            status, error = "turn_failed", "; ".join(errors)[-2000:]
        elif finished and finished[-1] == "stop":
            status, error = "Submitted", ""
        elif finished:
            status, error = str(finished[-1]), f"opencode's last step finished with {finished[-1]!r}"
        else:
            status, error = "exited", f"opencode exited with {rc} before finishing a step: {output[-2000:]}"
        return HarnessResult(exit_status=status, n_calls=len(finished), error=error,
                             messages=[{"role": "assistant", "content": texts[-1] if texts else ""}])


def _error_text(event: dict[str, Any]) -> str:
    err = event.get("error")
    if isinstance(err, dict):
        data = err.get("data")
        message = data.get("message") if isinstance(data, dict) else None
        return str(message or err.get("message") or err.get("name") or err)
    return str(err or event)
