"""What the coding-agent CLIs that run INSIDE the rollout's sandbox share (Claude Code, Codex, OpenCode, OpenHands).

Each adapter is a `SandboxedCLI`: the CLI is found on the host (the host root is visible read-only
inside the sandbox), its prompt is the task through `instance_template`, its environment is the
adapter's plus `extra_env`, and its command line runs in /workspace through the sandbox's control
socket. The adapters differ only in the command line, the environment and how they read the
CLI's output.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from legorl.harness.base import HarnessCrashed, HarnessResult, HarnessRun
from legorl.records import MAIN_SESSION
from legorl.sandbox.client import SandboxClient, SandboxError

NPM_BIN = Path(__file__).resolve().parents[3] / ".venv" / "npm" / "node_modules" / ".bin"
DEFAULT_INSTANCE_TEMPLATE = "Fix this issue in the repository in the current directory.\n\n{task}"
SIDE_SESSION = "side"  # a side call an adapter does not name more precisely


def find_cli(name: str, explicit: str | None = None) -> str:
    """The CLI's real path (the sandbox sees the venv and /usr read-only, not links into them)."""
    import shutil

    for cand in (explicit, str(NPM_BIN / name), shutil.which(name)):
        if cand and Path(cand).exists():
            return str(Path(cand).resolve())  # through symlinks: the sandbox binds the real venv, not a link to it
    raise HarnessCrashed(f"{name} CLI not found (looked in {NPM_BIN} and PATH): run `make setup-test` or "
                         f"`npm install --prefix .venv/npm` the pinned version")


def json_line(line: str) -> dict[str, Any] | None:
    """`line` as a JSON object, or None when it is not one."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def last_json(output: str, predicate: Any = None) -> dict[str, Any] | None:
    """The last line of `output` that is a JSON object (matching `predicate`)."""
    for line in reversed(output.splitlines()):
        obj = json_line(line)
        if obj is not None and (predicate is None or predicate(obj)):
            return obj
    return None


async def write_files(run: HarnessRun, files: dict[str, str | None]) -> None:
    """Write a CLI's config files into the rollout's sandbox before it starts (a None content is skipped). A
    SandboxError goes up as it is: the episode records the rollout as a sandbox_error (retried), not the harness's."""
    client = SandboxClient(run.control_socket)
    for path, content in files.items():
        if content is not None:
            await asyncio.to_thread(client.write_file, path, content)


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


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in, objects key by key (extra wins): a CLI's config with the user's keys."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def check_tools(label: str, tools: list[str], known_tools: tuple[str, ...], shell: str) -> None:
    """ValueError naming a tool `label` (the CLI) does not have, or a list without its shell (how the agent acts)."""
    unknown = sorted(set(tools) - set(known_tools))
    if unknown:
        raise ValueError(f"harness.tools: {label} has no tool {', '.join(unknown)} (known: {', '.join(known_tools)})")
    if shell not in tools:
        raise ValueError(f"harness.tools must keep {shell}: {label}'s shell is how the agent acts")


def side_unless_tools(body: dict[str, Any]) -> str:
    """The agent's own turns declare its tools (every CLI acts through them): a request without tools is a
    side call (a title, a summary, a check), recorded in a side session. Adapters may name theirs."""
    return MAIN_SESSION if body.get("tools") else SIDE_SESSION


@dataclass(kw_only=True)
class SandboxedCLI:
    """The switches every in-sandbox CLI adapter takes; subclasses set `cli` and build argv and env."""

    cli: ClassVar[str]  # the executable's name, looked up by start()
    timeout: float = 3600.0  # the episode's agent_timeout usually ends it sooner
    instance_template: str = DEFAULT_INSTANCE_TEMPLATE
    binary: str | None = None
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str | None] = field(default_factory=dict)  # None removes a variable
    system_prompt: str | None = None
    append_system_prompt: str | None = None
    tools: list[str] | None = None

    @property
    def teacher_style(self) -> str:
        return self.name  # type: ignore[attr-defined]  # every adapter names itself

    async def start(self) -> None:
        self.binary = find_cli(self.cli, self.binary)

    async def close(self) -> None:
        return None

    def missing_relay(self, run: HarnessRun) -> HarnessResult | None:
        """The result of a run that cannot start: the CLI runs inside the sandbox and needs the relay URL."""
        if run.relay_base:
            return None
        return HarnessResult(exit_status="exited", n_calls=0,
                             error=f"HarnessRun.relay_base is empty: {getattr(self, 'name', self.cli)} runs inside the sandbox and needs the "
                                   "relay URL (http://127.0.0.1:<sandbox.relay_port>/s/<session>)")

    def call_kind(self, body: dict[str, Any]) -> str:
        return side_unless_tools(body)

    def refuse_switches(self, label: str, known_tools: tuple[str, ...], shell: str) -> None:
        """ValueError for a switch this CLI cannot honour: an unknown tool, a tool list without its shell (how
        the agent acts), an appended system prompt (only Claude Code and Codex have that switch)."""
        if self.tools is not None:
            check_tools(label, self.tools, known_tools, shell)
        if self.append_system_prompt is not None:
            raise ValueError(f"harness.append_system_prompt: {label} has no such switch; use harness.system_prompt")

    def prompt(self, run: HarnessRun) -> str:
        return self.instance_template.replace("{task}", run.task_text)

    def with_extra_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` with `extra_env` applied (a None value removes the variable)."""
        for k, v in self.extra_env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        return env

    def shell(self, *argv: str) -> str:
        """The command line: the CLI (found by start()) and `argv`, quoted for the sandbox's shell."""
        return " ".join(shlex.quote(a) for a in (self.binary or self.cli, *argv))
