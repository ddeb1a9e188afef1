"""Claude Code, unmodified, run INSIDE the rollout's sandbox in non-interactive (`-p`) mode.

It reaches its model through the sandbox's relay (`HarnessRun.relay_base`, the proxy session's
Anthropic base URL as seen inside). Every model alias (main, small/fast, haiku/sonnet/opus
defaults, sub-agents) points at the served model, so no call leaves the session. Permissions are
skipped (legorl's sandbox is the isolation); `IS_SANDBOX=1` lets that run as root; telemetry,
auto-update and non-essential traffic are off (the sandbox has no network anyway).

Its prompt is shortened through its own switches, never by patching it
(docs/harnesses/claude-code.md): `system_prompt` (--system-prompt), `append_system_prompt`
(--append-system-prompt), `tools` (--tools, the built-in tools it declares) and `extra_args`.

Exit status (see rollout/outcomes.py): "Submitted" when Claude Code reports success,
"LimitsExceeded" when it hit `--max-turns`, else its own error subtype with the error text.
"""

from __future__ import annotations

from dataclasses import dataclass

from legorl.harness.base import HarnessCrashed, HarnessResult, HarnessRun
from legorl.harness.in_sandbox import (  # noqa: F401 - NPM_BIN and the helpers were always importable from here
    DEFAULT_INSTANCE_TEMPLATE,
    NPM_BIN,
    SandboxedCLI,
    exec_cli,
    find_cli,
    last_json,
)


@dataclass(kw_only=True)
class ClaudeCodeHarness(SandboxedCLI):
    """Harness protocol adapter for Claude Code (`claude -p`). `system_prompt` is --system-prompt
    (it replaces Claude Code's own), `append_system_prompt` --append-system-prompt, `tools` --tools
    (the built-in tools it declares, e.g. Bash, Edit, Read)."""

    cli = "claude"
    max_turns: int = 30
    name: str = "claude-code"

    def env(self, run: HarnessRun) -> dict[str, str]:
        if not run.relay_base:
            raise HarnessCrashed("HarnessRun.relay_base is empty: Claude Code runs inside the sandbox and needs "
                                 "the relay URL (http://127.0.0.1:<sandbox.relay_port>/s/<session>)")
        model = run.model_name
        env = {
            "ANTHROPIC_BASE_URL": run.relay_base,
            "ANTHROPIC_API_KEY": run.api_key,
            "ANTHROPIC_MODEL": model,
            "ANTHROPIC_SMALL_FAST_MODEL": model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
            "CLAUDE_CODE_SUBAGENT_MODEL": model,
            "IS_SANDBOX": "1",  # root + skipped permissions is refused without it (no model call at all)
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_BUG_COMMAND": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
            "CLAUDE_CODE_DISABLE_TERMINAL_TITLE": "1",
            "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1",
            "API_TIMEOUT_MS": str(int(self.timeout * 1000)),
            "NO_COLOR": "1",
            "TERM": "dumb",
            "HOME": "/tmp",
        }
        return self.with_extra_env(env)

    def command(self, run: HarnessRun) -> str:
        argv = ["-p", self.prompt(run), "--output-format", "json", "--dangerously-skip-permissions",
                "--max-turns", str(self.max_turns), "--model", run.model_name]
        if self.system_prompt is not None:
            argv += ["--system-prompt", self.system_prompt]
        if self.append_system_prompt is not None:
            argv += ["--append-system-prompt", self.append_system_prompt]
        if self.tools is not None:
            argv += ["--tools", ",".join(self.tools)]
        return self.shell(*argv, *self.extra_args)

    async def run(self, run: HarnessRun) -> HarnessResult:
        output, rc = await exec_cli(run, self.command(run), self.env(run), self.timeout)
        res = last_json(output, lambda o: o.get("type") == "result")
        if res is None:  # it never got going (or died): the outcome depends on whether it called the model
            return HarnessResult(exit_status="exited", n_calls=0,
                                 error=f"claude exited with {rc} without a result line: {output[-2000:]}")
        turns = int(res.get("num_turns") or 0)
        subtype = str(res.get("subtype") or "")
        error = "" if not res.get("is_error") else str(res.get("result") or res.get("terminal_reason") or "")
        if subtype == "error_max_turns":
            status = "LimitsExceeded"
        elif subtype == "success" and not res.get("is_error"):
            status = "Submitted"
        else:
            status = str(res.get("terminal_reason") or subtype or "error")
        return HarnessResult(exit_status=status, n_calls=turns, error=error,
                             messages=[{"role": "assistant", "content": str(res.get("result") or "")}])
