"""Gemini CLI, unmodified, run INSIDE the rollout's sandbox in non-interactive (`-p`) mode.

It speaks the Gemini API (`models/<model>:streamGenerateContent?alt=sse`), which the proxy serves
natively: `GOOGLE_GEMINI_BASE_URL` is the session's relay URL and `GEMINI_API_KEY` the session
token. Everything else comes from its own settings file (`~/.gemini/settings.json`, written into
the sandbox's HOME before it starts) and its own switches, never from a patch
(docs/harnesses/gemini-cli.md):

- API-key auth, folder trust off (else it exits 41 or downgrades `--approval-mode yolo`), no
  auto-update, no usage statistics or telemetry; `GEMINI_CLI_NO_RELAUNCH` keeps it to one Node process.
- `max_calls` is its own `model.maxSessionTurns` (a model call each), which the proxy enforces too.
- `system_prompt` replaces its system prompt through `GEMINI_SYSTEM_MD` (a file); `tools` is its
  `tools.core` allowlist (run_shell_command must stay); `settings` merges more keys in.

Side calls: its next-speaker check (off by default: `model.skipNextSpeakerCheck`) and its LLM loop
check (after 30 turns) ask for a JSON answer and declare no tools; they are recorded in side sessions
named `next_speaker` and `loop_check` (`call_kind`).

Exit status (rollout/outcomes.py): "Submitted" when it printed its response, "LimitsExceeded" when
its session turn limit ended it (FatalTurnLimitedError, exit 53), else the error type it reported,
or "exited" when it printed no result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from legorl.harness.base import HarnessResult, HarnessRun
from legorl.harness.in_sandbox import (
    SIDE_SESSION,
    SandboxedCLI,
    exec_cli,
    merge,
    side_unless_tools,
    write_files,
)
from legorl.records import MAIN_SESSION

HOME = "/tmp"  # the CLI's HOME inside the sandbox: its settings and the system prompt file go under it
SETTINGS_PATH = f"{HOME}/.gemini/settings.json"
SYSTEM_MD_PATH = f"{HOME}/.gemini/legorl-system.md"
# The tools Gemini CLI 0.61 can declare (15 by default; save_memory and write_todos when enabled).
TOOLS = ("run_shell_command", "read_file", "write_file", "replace", "list_directory", "glob", "grep_search",
         "web_fetch", "google_web_search", "list_background_processes", "read_background_output", "update_topic",
         "enter_plan_mode", "invoke_agent", "activate_skill", "save_memory", "write_todos")
TURN_LIMIT_ERROR = "FatalTurnLimitedError"


def gemini_settings(*, max_calls: int | None, tools: list[str] | None, extra: dict[str, Any] | None = None,
                    ) -> dict[str, Any]:
    """settings.json: API-key auth, no trust prompt, nothing phoned home, the turn limit and tool allowlist."""
    settings: dict[str, Any] = {
        "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
        "general": {"enableAutoUpdate": False, "enableAutoUpdateNotification": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "ide": {"enabled": False},
    }
    if max_calls is not None:
        settings["model"] = {"maxSessionTurns": max_calls}
    if tools is not None:
        settings["tools"] = {"core": list(tools)}
    return merge(settings, extra or {})


def result_object(output: str) -> dict[str, Any] | None:
    """The last JSON object of `output` that carries a `session_id`: the CLI's result or error (pretty-printed,
    on stdout or stderr, and an error's may come after an `[ERROR] ` prefix)."""
    decoder = json.JSONDecoder()
    at = len(output)
    while (at := output.rfind('{\n  "session_id"', 0, at)) >= 0:
        try:
            obj, _ = decoder.raw_decode(output, at)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


@dataclass(kw_only=True)
class GeminiCliHarness(SandboxedCLI):
    """Harness protocol adapter for Gemini CLI (`gemini -p ... --output-format json`). `system_prompt`
    replaces its system prompt (GEMINI_SYSTEM_MD), `tools` is its tools.core allowlist, `settings`
    merges more keys into its settings.json."""

    cli = "gemini"
    max_calls: int | None = None  # its model.maxSessionTurns, and the proxy session's turn limit
    settings: dict[str, Any] = field(default_factory=dict)
    name: str = "gemini-cli"

    def __post_init__(self) -> None:
        self.refuse_switches("Gemini CLI", TOOLS, "run_shell_command")

    def call_kind(self, body: dict[str, Any]) -> str:
        """Its checks ask for a JSON answer with no tools: named by the schema they ask for."""
        if (kind := side_unless_tools(body)) == MAIN_SESSION:
            return kind
        config = body.get("generationConfig") or {}
        schema = json.dumps(config.get("responseJsonSchema") or config.get("responseSchema") or {})
        if "next_speaker" in schema:
            return "next_speaker"
        if "unproductive_state" in schema:
            return "loop_check"
        return SIDE_SESSION

    def env(self, run: HarnessRun) -> dict[str, str]:
        env = {"GOOGLE_GEMINI_BASE_URL": run.relay_base, "GEMINI_API_KEY": run.api_key, "HOME": HOME,
               "GEMINI_CLI_NO_RELAUNCH": "true",  # no second Node process with a larger heap: a quarter of its CPU
               "NO_COLOR": "1", "TERM": "dumb"}
        if self.system_prompt is not None:
            env["GEMINI_SYSTEM_MD"] = SYSTEM_MD_PATH
        return self.with_extra_env(env)

    def command(self, run: HarnessRun) -> str:
        return self.shell("-m", run.model_name, "--approval-mode", "yolo", "--output-format", "json",
                          *self.extra_args, "-p", self.prompt(run))

    async def run(self, run: HarnessRun) -> HarnessResult:
        if (unstarted := self.missing_relay(run)) is not None:
            return unstarted
        settings = gemini_settings(max_calls=self.max_calls, tools=self.tools, extra=self.settings)
        # its settings file (and system prompt file) in the sandbox's HOME, where it reads them
        await write_files(run, {SETTINGS_PATH: json.dumps(settings, indent=1), SYSTEM_MD_PATH: self.system_prompt})
        output, rc = await exec_cli(run, self.command(run), self.env(run), self.timeout)
        res = result_object(output)
        if res is None:
            return HarnessResult(exit_status="exited", n_calls=0,
                                 error=f"gemini exited with {rc} without a result: {output[-2000:]}")
        models = (res.get("stats") or {}).get("models") or {}
        n_calls = sum(int((m.get("api") or {}).get("totalRequests") or 0) for m in models.values())
        err = res.get("error")
        if isinstance(err, dict):
            kind = str(err.get("type") or "error")
            status = "LimitsExceeded" if kind == TURN_LIMIT_ERROR else kind
            return HarnessResult(exit_status=status, n_calls=n_calls, error=str(err.get("message") or err))
        return HarnessResult(exit_status="Submitted", n_calls=n_calls,
                             messages=[{"role": "assistant", "content": str(res.get("response") or "")}])
