"""Any agent with a command line, unmodified, run INSIDE the rollout's sandbox (`harness.name: command`).

For an agent legorl has no adapter for (an in-house agent, a CLI not in docs/harnesses/): `harness.command`
is a shell command line run in /workspace inside the sandbox, as the agent's user would type it. The task is
in a file (`$LEGORL_PROMPT_FILE`; legorl never writes task text into the command line itself) and
the proxy session is in the variables the official SDKs and most CLIs read, one per wire format:

- Chat Completions and Responses: `OPENAI_BASE_URL` (and `OPENAI_API_BASE`, read by LiteLLM-era tools),
  `OPENAI_API_KEY`: the session's relay URL + `/v1`;
- Anthropic Messages: `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`: the relay URL;
- Gemini: `GOOGLE_GEMINI_BASE_URL`, `GEMINI_API_KEY` (and `GOOGLE_API_KEY`): the relay URL;
- `LEGORL_BASE_URL` (the relay URL), `LEGORL_API_KEY` and `LEGORL_MODEL` (the served model's name), for
  a command line or a config file that names them itself; `LEGORL_LAUNCH_DIR`, the directory legorl was started
  in, for a command naming files beside the config (relative `visible_paths` are resolved against it too).

The sandbox shows the host's system dirs and runtimes (Python's, the virtualenv's, node's) read-only;
`harness.visible_paths` adds the agent's own files (a script, a checkout, a config). `HOME` is the sandbox's
private /tmp, so the agent's own state files stay in the episode. Exit status 0 is
"Submitted" (the agent finished its task), one of `limit_exit_codes` "LimitsExceeded" (its own turn limit: the
rollout is max_turns), any other an exit whose output tail is the error (the rollout is an agent_crash, masked); the proxy session enforces `harness.step_limit` as for every CLI. A request declaring no
tools is a side call (titles, summaries, checks) unless `side_calls: none`. The scripted teacher plays its
demonstrations through `shell_tool`, the agent's own shell tool (name and command argument), which the
agent must declare in its requests, and ends them with `shell_submit` (an agent's submit command, e.g.
mini-swe-agent's) or, without one, with a reply that calls no tool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

from legorl.harness.base import HarnessResult, HarnessRun, ToolStyle
from legorl.harness.in_sandbox import DEFAULT_INSTANCE_TEMPLATE, exec_cli, side_unless_tools, write_files
from legorl.records import MAIN_SESSION

PROMPT_FILE = "/tmp/.legorl/prompt.md"


@dataclass(kw_only=True)
class CommandHarness:
    """Harness protocol adapter for any agent's command line (module docstring)."""

    command: str
    shell_tool: str = "bash"  # the agent's shell tool, played by the scripted teacher
    shell_arg: str = "command"  # that tool's command argument
    shell_submit: str | None = None  # the command that ends the agent's episode; None: a reply calling no tool
    side_calls: Literal["without_tools", "none"] = "without_tools"
    limit_exit_codes: tuple[int, ...] = ()  # the agent's exit statuses for "my own turn limit ended me"
    instance_template: str = DEFAULT_INSTANCE_TEMPLATE
    env: dict[str, str] = field(default_factory=dict)  # more variables for the command (a value replaces legorl's)
    # host paths the sandbox shows read-only at the same place (the agent's program, its config): the sandbox
    # shows only the system dirs and the runtimes (docs/sandbox.md)
    visible_paths: tuple[str, ...] = ()
    launch_dir: str = field(default="", init=False)  # the directory legorl was started in ($LEGORL_LAUNCH_DIR)
    timeout: float = 3600.0  # the episode's agent_timeout usually ends it sooner
    max_calls: int | None = None  # the proxy session's turn limit
    name: str = "command"

    def __post_init__(self) -> None:
        if not self.command.strip():
            raise ValueError("harness.command is empty: give the agent's command line, run in /workspace inside "
                             "the sandbox (docs/harnesses/command.md)")
        for path in self.visible_paths:
            if not os.path.exists(path):
                raise ValueError(f"harness.visible_paths: {path} does not exist on this host")
        self.visible_paths = tuple(os.path.realpath(p) for p in self.visible_paths)
        self.launch_dir = os.getcwd()

    @property
    def teacher_style(self) -> ToolStyle:
        return ToolStyle(self.shell_tool, self.shell_arg, self.shell_submit)

    async def start(self) -> None:
        return None  # the command runs inside the sandbox; a missing program is the first episode's error

    async def close(self) -> None:
        return None

    def call_kind(self, body: dict[str, Any]) -> str:
        return MAIN_SESSION if self.side_calls == "none" else side_unless_tools(body)

    def environment(self, run: HarnessRun) -> dict[str, str]:
        base = run.relay_base.rstrip("/")
        env = {"OPENAI_BASE_URL": base + "/v1", "OPENAI_API_BASE": base + "/v1", "OPENAI_API_KEY": run.api_key,
               "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": run.api_key,
               "GOOGLE_GEMINI_BASE_URL": base, "GEMINI_API_KEY": run.api_key, "GOOGLE_API_KEY": run.api_key,
               "LEGORL_BASE_URL": base, "LEGORL_API_KEY": run.api_key, "LEGORL_MODEL": run.model_name,
               "LEGORL_PROMPT_FILE": PROMPT_FILE, "LEGORL_LAUNCH_DIR": self.launch_dir,
               "HOME": "/tmp", "NO_COLOR": "1", "TERM": "dumb"}
        return {**env, **self.env}

    async def run(self, run: HarnessRun) -> HarnessResult:
        if not run.relay_base:
            return HarnessResult(exit_status="exited", n_calls=0,
                                 error="HarnessRun.relay_base is empty: harness.command runs inside the sandbox and "
                                       "needs the relay URL (http://127.0.0.1:<sandbox.relay_port>/s/<session>)")
        await write_files(run, {PROMPT_FILE: self.instance_template.replace("{task}", run.task_text)})
        output, rc = await exec_cli(run, self.command, self.environment(run), self.timeout)
        tail = output[-2000:]
        if rc == 0:
            return HarnessResult(exit_status="Submitted", n_calls=0, messages=[{"role": "assistant", "content": tail}])
        if rc in self.limit_exit_codes:  # graded and trained like the proxy's turn limit (max_turns)
            return HarnessResult(exit_status="LimitsExceeded", n_calls=0, error=f"its turn limit (exit {rc}): {tail}")
        return HarnessResult(exit_status="exited", n_calls=0,
                             error=f"harness.command exited with {rc}: {tail}")
