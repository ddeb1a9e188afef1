"""Qwen Code, unmodified, run INSIDE the rollout's sandbox in headless mode (`qwen --output-format stream-json`).

It speaks Chat Completions (`--auth-type openai`, streamed) to the session's relay URL + `/v1`
(`OPENAI_BASE_URL`, the session token as `OPENAI_API_KEY`). Its switches go in a settings.json the
adapter writes into the sandbox's private /tmp and names as Qwen's *system* settings
(`QWEN_CODE_SYSTEM_SETTINGS_PATH`): the top of its merge order, so a `.qwen/settings.json` in the
task repo (or one the agent writes) cannot override them. Tool approvals are off
(`--approval-mode yolo`): legorl's sandbox is the isolation. The task reaches it on stdin, from a
file, so no prompt text is ever read as a flag.

Its side calls are switched off in the same settings (docs/harnesses/qwen-code.md): the background
memory agents (extraction and "dream"), the next-speaker check, tool-use summaries, follow-up
suggestions; chat recording (which carries the session-title call), its opt-in loop heuristics,
usage statistics, telemetry, auto-update and cross-session messaging are off too. Compression has no
switch: when the proxy refuses a prompt as too long, Qwen asks for a summary (recorded as the
`compression` side session) and goes on; the rollout is context_overflow. Its prompt is
shortened through its own switches, never by patching it: `system_prompt` (--system-prompt),
`append_system_prompt` (--append-system-prompt), `tools` (only these are registered: `tools.core`
and `tools.disabled`) and `settings` (any other settings.json key, merged in last).

`max_calls` is its own session turn limit (`model.maxSessionTurns`, one turn per model call), and the
proxy session enforces it too. Exit status (rollout/outcomes.py): "Submitted" when its result is a
success, "LimitsExceeded" when its turn limit (exit code 53) or its always-on loop guard ended it,
"turn_failed" with the error it reported, "exited" when it printed no result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from legorl.harness.base import HarnessResult, HarnessRun
from legorl.harness.in_sandbox import (
    SandboxedCLI,
    check_tools,
    exec_cli,
    last_json,
    merge,
    side_unless_tools,
    write_files,
)
from legorl.records import MAIN_SESSION

QWEN_DIR = "/tmp/.qwen-legorl"  # beside HOME=/tmp's .qwen, which Qwen fills with its own state
SETTINGS_FILE = f"{QWEN_DIR}/settings.json"
PROMPT_FILE = f"{QWEN_DIR}/prompt.md"
TURN_LIMIT_EXIT = 53  # FatalTurnLimitedError: "Reached max session turns for this session"
LOOP_HALT = "Loop detection halted the run"
COMPRESSION_PROMPT = "You are the component that summarizes a conversation"

# The tools Qwen Code 0.24.4 registers; the first 14 are declared in its first request, the rest are
# deferred behind tool_search / tool_call. The shell (run_shell_command) always stays.
TOOLS = ("agent", "edit", "get_goal", "glob", "grep_search", "list_agents", "notebook_edit", "read_file",
         "run_shell_command", "skill", "tool_call", "tool_search", "update_goal", "write_file",
         "cron_create", "cron_delete", "cron_list", "enter_worktree", "exit_worktree", "loop_wakeup", "monitor",
         "read_mcp_resource", "record_artifact", "report_findings", "send_message", "task_stop", "web_fetch",
         "zoom_image")
SKILL_LEVELS = ["bundled", "user", "project", "extension"]

# Every model call outside the agent's own turns, and every reach outside the sandbox, off.
QUIET: dict[str, Any] = {
    "memory": {"enableManagedAutoMemory": False, "enableManagedAutoDream": False, "enableAutoSkill": False},
    "model": {"skipNextSpeakerCheck": True, "skipLoopDetection": True},
    "experimental": {"emitToolUseSummaries": False},
    "ui": {"enableFollowupSuggestions": False},
    "general": {"enableAutoUpdate": False, "chatRecording": False},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
    "ide": {"enabled": False},
    "agents": {"crossSessionMessaging": False},
}


def qwen_tool_settings(tools: list[str]) -> dict[str, Any]:
    """Settings that register only `tools`; ValueError naming an unknown tool."""
    check_tools("Qwen Code", tools, TOOLS, "run_shell_command")
    # tools.core is the allowlist; its control tools (agent, skill, tool_search, ...) ignore it, so
    # every other known tool is also unregistered by name.
    settings: dict[str, Any] = {"tools": {"core": list(tools), "disabled": [t for t in TOOLS if t not in tools]}}
    if "skill" not in tools:  # else a list of its bundled skills is still sent, for a tool it lacks
        settings["skills"] = {"disabledLevels": SKILL_LEVELS}
    return settings


def qwen_settings(*, max_calls: int | None = None, tools: list[str] | None = None,
                  extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings.json the adapter writes: side calls off, the switches, `extra` merged in last."""
    settings = merge(QUIET, qwen_tool_settings(tools) if tools is not None else {})
    if max_calls is not None:
        settings = merge(settings, {"model": {"maxSessionTurns": max_calls}})
    return merge(settings, extra or {})


@dataclass(kw_only=True)
class QwenCodeHarness(SandboxedCLI):
    """Harness protocol adapter for Qwen Code (`qwen`, headless). `system_prompt` is --system-prompt
    (it replaces Qwen's own), `append_system_prompt` --append-system-prompt, `tools` the only tools
    registered (run_shell_command must stay), `settings` more settings.json keys, merged in."""

    cli = "qwen"
    settings: dict[str, Any] = field(default_factory=dict)
    max_calls: int | None = None  # its session turn limit (one per model call); the proxy enforces it too
    name: str = "qwen-code"

    def __post_init__(self) -> None:
        if self.tools is not None:
            qwen_tool_settings(self.tools)  # an unknown tool fails at construction

    def call_kind(self, body: dict[str, Any]) -> str:
        """Its compression request (no switch turns it off) declares no tools and opens with its summarizer's prompt."""
        if (kind := side_unless_tools(body)) == MAIN_SESSION:
            return kind
        return "compression" if COMPRESSION_PROMPT in json.dumps(body)[:4000] else kind

    def settings_json(self) -> str:
        return json.dumps(qwen_settings(max_calls=self.max_calls, tools=self.tools, extra=self.settings), indent=1)

    def env(self, run: HarnessRun) -> dict[str, str]:
        env = {"OPENAI_BASE_URL": run.relay_base.rstrip("/") + "/v1", "OPENAI_API_KEY": run.api_key,
               "OPENAI_MODEL": run.model_name, "QWEN_CODE_SYSTEM_SETTINGS_PATH": SETTINGS_FILE, "HOME": "/tmp",
               # its own output budget (32000), named: a reply cut at max_tokens is then kept, not re-sent
               # with the budget doubled and "continue" turns appended (calls that drop the cut reply)
               "QWEN_CODE_MAX_OUTPUT_TOKENS": "32000",
               "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1", "NO_COLOR": "1", "TERM": "dumb"}
        return self.with_extra_env(env)

    def command(self, run: HarnessRun) -> str:
        argv = ["--auth-type", "openai", "--model", run.model_name, "--approval-mode", "yolo",
                "--output-format", "stream-json"]
        if self.system_prompt is not None:
            argv += ["--system-prompt", self.system_prompt]
        if self.append_system_prompt is not None:
            argv += ["--append-system-prompt", self.append_system_prompt]
        return self.shell(*argv, *self.extra_args) + f" < {PROMPT_FILE}"

    async def run(self, run: HarnessRun) -> HarnessResult:
        if (unstarted := self.missing_relay(run)) is not None:
            return unstarted
        await write_files(run, {SETTINGS_FILE: self.settings_json(), PROMPT_FILE: self.prompt(run)})
        output, rc = await exec_cli(run, self.command(run), self.env(run), self.timeout)
        res = last_json(output, lambda o: o.get("type") == "result")
        if rc == TURN_LIMIT_EXIT:  # it stops before the call past its limit, printing no result
            return HarnessResult(exit_status="LimitsExceeded", n_calls=self.max_calls or 0,
                                 error="Qwen Code reached its session turn limit")
        if res is None:
            return HarnessResult(exit_status="exited", n_calls=0,
                                 error=f"qwen exited with {rc} without a result line: {output[-2000:]}")
        text = str(res.get("result") or "")
        if res.get("subtype") == "success" and not res.get("is_error"):
            status, error = "Submitted", ""
        else:
            err = res.get("error")
            error = str((err.get("message") if isinstance(err, dict) else err) or res.get("subtype") or "error")
            # Its always-on loop guard (e.g. the same tool call 5 times running) stopped the policy: a
            # limit of the harness, graded and trained like the turn limit, not masked as a crash.
            status = "LimitsExceeded" if error.startswith(LOOP_HALT) else "turn_failed"
        return HarnessResult(exit_status=status, n_calls=int(res.get("num_turns") or 0), error=error[-2000:],
                             messages=[{"role": "assistant", "content": text}])
