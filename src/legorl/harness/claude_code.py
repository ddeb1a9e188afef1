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

import asyncio
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.harness.base import HarnessCrashed, HarnessResult, HarnessRun
from legorl.sandbox.client import SandboxClient, SandboxError

NPM_BIN = Path(__file__).resolve().parents[3] / ".venv" / "npm" / "node_modules" / ".bin"
DEFAULT_INSTANCE_TEMPLATE = "Fix this issue in the repository in the current directory.\n\n{task}"


def find_cli(name: str, explicit: str | None = None) -> str:
    """The CLI's absolute path (the host root is visible read-only inside the sandbox)."""
    import shutil

    for cand in (explicit, str(NPM_BIN / name), shutil.which(name)):
        if cand and Path(cand).exists():
            return str(Path(cand).absolute())
    raise HarnessCrashed(f"{name} CLI not found (looked in {NPM_BIN} and PATH): run `make setup-test` or "
                         f"`npm install --prefix .venv/npm` the pinned version")


def last_json(output: str, predicate: Any = None) -> dict[str, Any] | None:
    """The last line of `output` that is a JSON object (matching `predicate`)."""
    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and (predicate is None or predicate(obj)):
                return obj
    return None


async def exec_cli(run: HarnessRun, command: str, env: dict[str, str], timeout: float) -> tuple[str, int]:
    """Run `command` inside the rollout's sandbox; TimeoutError when it ran out of time."""
    client = SandboxClient(run.control_socket)
    try:
        r = await asyncio.to_thread(client.exec, command, timeout, "/workspace", env)
    except SandboxError as e:
        raise HarnessCrashed(f"the sandbox failed while the harness ran: {e}") from e
    if r.timed_out:
        raise TimeoutError(f"the harness did not finish within {timeout:.0f}s")
    return r.output, r.returncode


@dataclass
class ClaudeCodeHarness:
    """Harness protocol adapter for Claude Code (`claude -p`)."""

    max_turns: int = 30
    timeout: float = 3600.0  # the episode's agent_timeout usually ends it sooner
    instance_template: str = DEFAULT_INSTANCE_TEMPLATE
    binary: str | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str | None] = field(default_factory=dict)  # None removes a variable
    system_prompt: str | None = None  # --system-prompt: replaces Claude Code's own
    append_system_prompt: str | None = None  # --append-system-prompt
    tools: list[str] | None = None  # --tools: the built-in tools it declares (e.g. Bash, Edit, Read)
    name: str = "claude-code"

    async def start(self) -> None:
        self.binary = find_cli("claude", self.binary)

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
        for k, v in self.extra_env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def command(self, run: HarnessRun) -> str:
        prompt = self.instance_template.replace("{task}", run.task_text)
        argv = [self.binary or "claude", "-p", prompt, "--output-format", "json", "--dangerously-skip-permissions",
                "--max-turns", str(self.max_turns), "--model", run.model_name]
        if self.system_prompt is not None:
            argv += ["--system-prompt", self.system_prompt]
        if self.append_system_prompt is not None:
            argv += ["--append-system-prompt", self.append_system_prompt]
        if self.tools is not None:
            argv += ["--tools", ",".join(self.tools)]
        argv += self.extra_args
        return " ".join(shlex.quote(a) for a in argv)

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

    async def close(self) -> None:
        return None
