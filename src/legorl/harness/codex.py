"""Codex CLI, unmodified, run INSIDE the rollout's sandbox with `codex exec` (non-interactive).

Recent Codex versions ignore `OPENAI_BASE_URL`: the provider comes from `config.toml` in
`CODEX_HOME`. The adapter writes one (in the sandbox's private /tmp) defining a `legorl`
provider whose base URL is the session's relay URL + `/v1`, speaking the Responses API, with
the session token as its API key. Codex's own sandbox and approvals are off
(`--dangerously-bypass-approvals-and-sandbox`): legorl's sandbox is the isolation.

Its prompt is shortened through its own switches, never by patching it (docs/harnesses/codex.md):
`system_prompt` becomes its model instructions file, `append_system_prompt` its developer
instructions, `tools` switches off in config.toml every tool group not listed, and `codex_config`
adds any other config.toml key. Codex has no turn limit of its own: `max_calls` is enforced by the
proxy session, which refuses the call past it and the episode ends as max_turns.

Exit status (see rollout/outcomes.py): "Submitted" when the turn completed, else "turn_failed"
/ "exited" with the error Codex reported.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.harness.base import HarnessResult, HarnessRun
from legorl.harness.in_sandbox import SandboxedCLI, exec_cli, json_line, write_files

CODEX_HOME = "/tmp/.codex-legorl"
INSTRUCTIONS_FILE = f"{CODEX_HOME}/instructions.md"

# The tools Codex 0.171 declares and the config.toml keys that switch each group off. The shell
# (exec_command with its write_stdin) always stays: it is how Codex acts.
SHELL_TOOLS = ("exec_command", "write_stdin")
TOOL_SWITCHES: dict[tuple[str, ...], dict[str, Any]] = {
    ("spawn_agent", "send_input", "wait_agent", "close_agent", "resume_agent"): {"features.multi_agent": False},
    ("create_goal", "get_goal", "update_goal"): {"features.goals": False},
    ("view_image",): {"features.view_image": False},
    ("request_user_input",): {"tools.experimental_request_user_input.enabled": False},
    ("update_plan",): {"tools.update_plan.enabled": False},
    ("image_generation",): {"features.image_generation": False},
    ("web_search",): {"web_search": "disabled"},
}


# The npm package's `codex` is a Node script that only picks this platform's native binary and
# execs it with two variables set; running the binary directly saves a Node start per episode
# (measured standalone: ~0.2 CPU-s and up to a second before Codex's first request).
NATIVE_TARGETS = {"x86_64": ("codex-linux-x64", "x86_64-unknown-linux-musl"),
                  "aarch64": ("codex-linux-arm64", "aarch64-unknown-linux-musl")}


def native_codex(launcher: str) -> tuple[str, dict[str, str]] | None:
    """The native binary the npm launcher `launcher` (.../@openai/codex/bin/codex.js) would exec, and the
    environment it would add; None when it is not that launcher or the platform package is missing."""
    script = Path(launcher)
    package = script.parent.parent
    if script.suffix != ".js" or package.name != "codex" or platform.system() != "Linux":
        return None
    target = NATIVE_TARGETS.get(platform.machine())
    if target is None:
        return None
    for modules in (package / "node_modules", package.parent.parent):  # nested, or hoisted beside it
        binary = modules / "@openai" / target[0] / "vendor" / target[1] / "bin" / "codex"
        if binary.is_file():
            return str(binary.resolve()), {"CODEX_MANAGED_PACKAGE_ROOT": str(package.resolve()),
                                           "CODEX_MANAGED_BY_NPM": "1"}
    return None


def codex_tool_switches(tools: list[str]) -> dict[str, Any]:
    """config.toml keys that leave only `tools` (plus the shell) declared; ValueError naming an unknown tool."""
    known = {t for group in TOOL_SWITCHES for t in group} | set(SHELL_TOOLS)
    unknown = sorted(set(tools) - known)
    if unknown:
        raise ValueError(f"harness.tools: Codex has no tool {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    if "exec_command" not in tools:
        raise ValueError("harness.tools must keep exec_command: Codex's shell cannot be switched off")
    switches: dict[str, Any] = {}
    for group, keys in TOOL_SWITCHES.items():
        if not set(group) & set(tools):
            switches.update(keys)
    return switches


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ValueError(f"harness.codex_config: {v!r} is not a TOML value (use strings, numbers, booleans, lists)")


def codex_config(run: HarnessRun, *, retries: int = 2, extra: dict[str, Any] | None = None) -> str:
    """config.toml: the legorl provider (the session's relay URL, Responses API) and `extra` top-level keys."""
    base = run.relay_base.rstrip("/") + "/v1"
    return "\n".join([
        f"model = {_toml_value(run.model_name)}",
        'model_provider = "legorl"',
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "check_for_update_on_startup = false",
        *(f"{key} = {_toml_value(value)}" for key, value in (extra or {}).items()),  # dotted keys: before any table
        "",
        "[model_providers.legorl]",
        'name = "legorl"',
        f"base_url = {_toml_value(base)}",
        'wire_api = "responses"',
        'env_key = "LEGORL_API_KEY"',
        f"request_max_retries = {retries}",
        f"stream_max_retries = {retries}",
        "stream_idle_timeout_ms = 3600000",
        "",
    ])


@dataclass(kw_only=True)
class CodexHarness(SandboxedCLI):
    """Harness protocol adapter for the Codex CLI (`codex exec`). `system_prompt` replaces Codex's
    instructions (its model instructions file), `append_system_prompt` is its developer_instructions,
    `tools` keeps only these tools (and the shell)."""

    cli = "codex"
    retries: int = 2
    config: dict[str, Any] = field(default_factory=dict)  # more config.toml keys
    max_calls: int | None = None  # enforced by the proxy session (Codex has no turn limit)
    name: str = "codex"
    launcher_env: dict[str, str] = field(default_factory=dict, init=False)  # set by start(): what the npm launcher would set

    def __post_init__(self) -> None:
        self.config_keys()  # an unknown tool or a value TOML cannot hold fails at construction

    async def start(self) -> None:
        await super().start()
        native = native_codex(self.binary or "")
        if native is not None:
            self.binary, self.launcher_env = native

    def config_keys(self) -> dict[str, Any]:
        """The top-level config.toml keys the switches above set (the config's own keys win)."""
        keys: dict[str, Any] = codex_tool_switches(self.tools) if self.tools is not None else {}
        if self.system_prompt is not None:
            keys["model_instructions_file"] = INSTRUCTIONS_FILE
        if self.append_system_prompt is not None:
            keys["developer_instructions"] = self.append_system_prompt
        keys.update(self.config)
        for value in keys.values():
            _toml_value(value)
        return keys

    def env(self, run: HarnessRun) -> dict[str, str]:
        env = {**self.launcher_env, "CODEX_HOME": CODEX_HOME, "LEGORL_API_KEY": run.api_key, "HOME": "/tmp",
               "NO_COLOR": "1", "TERM": "dumb", "RUST_LOG": "error"}
        return self.with_extra_env(env)

    def command(self, run: HarnessRun) -> str:
        return self.shell("exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                          "-C", "/workspace", *self.extra_args, self.prompt(run))

    async def run(self, run: HarnessRun) -> HarnessResult:
        if (unstarted := self.missing_relay(run)) is not None:
            return unstarted
        await write_files(run, {f"{CODEX_HOME}/config.toml": codex_config(run, retries=self.retries,
                                                                           extra=self.config_keys()),
                                INSTRUCTIONS_FILE: self.system_prompt})
        output, rc = await exec_cli(run, self.command(run), self.env(run), self.timeout)
        events = [e for e in (json_line(line) for line in output.splitlines()) if e is not None]
        kinds = [e.get("type") for e in events]
        errors = [str(e.get("message") or e.get("error") or e) for e in events
                  if e.get("type") in ("error", "turn.failed")]
        n_items = sum(1 for e in events if e.get("type") == "item.completed")
        final = [e["item"].get("text", "") for e in events if e.get("type") == "item.completed"
                 and isinstance(e.get("item"), dict) and e["item"].get("type") == "agent_message"]
        if "turn.completed" in kinds and not errors:
            status, error = "Submitted", ""
        elif "turn.failed" in kinds or errors:
            status, error = "turn_failed", "; ".join(errors)[-2000:]
        else:
            status, error = "exited", f"codex exited with {rc} before completing a turn: {output[-2000:]}"
        return HarnessResult(exit_status=status, n_calls=n_items, error=error,
                             messages=[{"role": "assistant", "content": final[-1] if final else ""}])
