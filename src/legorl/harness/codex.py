"""Codex CLI, unmodified, run INSIDE the rollout's sandbox with `codex exec` (non-interactive).

Recent Codex versions ignore `OPENAI_BASE_URL`: the provider comes from `config.toml` in
`CODEX_HOME`. The adapter writes one (in the sandbox's private /tmp) defining a `legorl`
provider whose base URL is the session's relay URL + `/v1`, speaking the Responses API, with
the session token as its API key. Codex's own sandbox and approvals are off
(`--dangerously-bypass-approvals-and-sandbox`): legorl's sandbox is the isolation.

Exit status (see rollout/outcomes.py): "Submitted" when the turn completed, else "turn_failed"
/ "exited" with the error Codex reported.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from dataclasses import dataclass, field

from legorl.harness.base import HarnessResult, HarnessRun
from legorl.harness.claude_code import DEFAULT_INSTANCE_TEMPLATE, exec_cli, find_cli
from legorl.sandbox.client import SandboxClient

CODEX_HOME = "/tmp/.codex-legorl"


def _toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def codex_config(run: HarnessRun, *, retries: int = 2) -> str:
    base = run.relay_base.rstrip("/") + "/v1"
    return "\n".join([
        f"model = {_toml_str(run.model_name)}",
        'model_provider = "legorl"',
        'approval_policy = "never"',
        'sandbox_mode = "danger-full-access"',
        "check_for_update_on_startup = false",
        "",
        "[model_providers.legorl]",
        'name = "legorl"',
        f"base_url = {_toml_str(base)}",
        'wire_api = "responses"',
        'env_key = "LEGORL_API_KEY"',
        f"request_max_retries = {retries}",
        f"stream_max_retries = {retries}",
        "stream_idle_timeout_ms = 3600000",
        "",
    ])


@dataclass
class CodexHarness:
    """Harness protocol adapter for the Codex CLI (`codex exec`)."""

    timeout: float = 3600.0  # the episode's agent_timeout usually ends it sooner
    instance_template: str = DEFAULT_INSTANCE_TEMPLATE
    binary: str | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str | None] = field(default_factory=dict)  # None removes a variable
    retries: int = 2
    name: str = "codex"

    async def start(self) -> None:
        self.binary = find_cli("codex", self.binary)

    def env(self, run: HarnessRun) -> dict[str, str]:
        env = {"CODEX_HOME": CODEX_HOME, "LEGORL_API_KEY": run.api_key, "HOME": "/tmp", "NO_COLOR": "1",
               "TERM": "dumb", "RUST_LOG": "error"}
        for k, v in self.extra_env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def command(self, run: HarnessRun) -> str:
        prompt = self.instance_template.replace("{task}", run.task_text)
        argv = [self.binary or "codex", "exec", "--json", "--skip-git-repo-check",
                "--dangerously-bypass-approvals-and-sandbox", "-C", "/workspace", *self.extra_args, prompt]
        return " ".join(shlex.quote(a) for a in argv)

    async def run(self, run: HarnessRun) -> HarnessResult:
        if not run.relay_base:
            return HarnessResult(exit_status="exited", n_calls=0,
                                 error="HarnessRun.relay_base is empty: Codex runs inside the sandbox and needs the "
                                       "relay URL (http://127.0.0.1:<sandbox.relay_port>/s/<session>)")
        client = SandboxClient(run.control_socket)
        config = codex_config(run, retries=self.retries)
        await asyncio.to_thread(client.write_file, f"{CODEX_HOME}/config.toml", config)
        output, rc = await exec_cli(run, self.command(run), self.env(run), self.timeout)
        events = [e for e in (_json_line(line) for line in output.splitlines()) if e is not None]
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

    async def close(self) -> None:
        return None


def _json_line(line: str) -> dict | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None
