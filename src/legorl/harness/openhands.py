"""OpenHands, unmodified, run INSIDE the rollout's sandbox through the OpenHands SDK's documented
entry point: an `Agent` with the SDK's own tools (terminal, file_editor, task_tracker, ...) and a
`Conversation` on /workspace, in the OpenHands environment's Python (3.12+; `make setup-test`
builds it in .venv/openhands).

Why the SDK and not the `openhands --headless` CLI: the CLI fixes its tools (terminal, file_editor,
task_tracker, task), loads the public skills (a git clone from GitHub at every start) and offers
no switch for the system prompt, so its first prompt (~59k tokens with the built-in tokenizer)
cannot be shortened for a small model. The SDK builds the same agent, tools and prompt templates;
`harness.tools` picks the tools, `harness.system_prompt` replaces the prompt (the SDK's own
`Agent.system_prompt`). legorl's runner (harness/openhands_runner.py, written into the sandbox's
/tmp) is the few lines of the SDK's quick-start; nothing of OpenHands is patched.

Where the sandbox allows it (bwrap under a root driver), each episode's runner is forked into its
sandbox from a prefork server that imported the SDK once (harness/prefork.py): the imports were ~85 %
of an episode's CPU.

It speaks Chat Completions, not streamed, through LiteLLM (`openai/<model>` at the session's relay
URL). OpenHands has no turn limit of its own besides `max_iteration_per_run`: that is set to
`max_calls`, which the proxy session enforces too. Exit status (rollout/outcomes.py): "Submitted"
when the conversation finished, "LimitsExceeded" when its iteration budget ran out, else the
status or error it reported.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.harness.base import HarnessCrashed, HarnessResult, HarnessRun
from legorl.harness.in_sandbox import SandboxedCLI, exec_cli, last_json, write_files
from legorl.harness.prefork import PreforkServer, forks_can_enter_sandboxes, sandbox_target

OPENHANDS_PYTHON = Path(__file__).resolve().parents[3] / ".venv" / "openhands" / "bin" / "python"
RUNNER = Path(__file__).with_name("openhands_runner.py")
RUNNER_IN_SANDBOX = "/tmp/.legorl-openhands/runner.py"
# The server's imports take ~6 CPU-s; waited on by whichever episodes need it, not bounded by their timeouts.
SERVER_START_TIMEOUT = 600.0
# The SDK's tools an agent can be given (`finish` and `think` come with every agent).
TOOLS = ("terminal", "file_editor", "task_tracker", "task")
DEFAULT_TOOLS = ["terminal", "file_editor", "task_tracker"]  # the SDK's default CLI agent, without sub-agents


@dataclass(kw_only=True)
class OpenHandsHarness(SandboxedCLI):
    """Harness protocol adapter for the OpenHands SDK's agent. `binary` is the OpenHands environment's
    Python; `system_prompt` replaces the SDK's prompt; `tools` picks the SDK's tools."""

    cli = "python"
    max_calls: int = 30  # max_iteration_per_run, and the proxy session's turn limit
    # Fork each episode's runner, the SDK imported once, into its sandbox (harness/prefork.py), where the
    # sandbox allows it (bwrap under a root driver); else each episode's Python imports the SDK (~7 CPU-s).
    prefork: bool = True
    # The SDK's own per-tool parameters (`Tool(name, params=...)`, the arguments of the tool's `create`), e.g.
    # {"terminal": {"no_change_timeout_seconds": 10}}: how long a command may print nothing before the agent
    # gets control back (30 s by default; a half-quoted command waits for more input that long).
    tool_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    name: str = "openhands"
    visible_paths: tuple[str, ...] = field(default=(), init=False)  # set by start(): what the sandbox must show
    runner: str = field(default="", init=False)  # set by start(): the runner's source, written into each sandbox
    server: PreforkServer | None = field(default=None, init=False)  # started by start() or the first episode
    _starting: asyncio.Future[PreforkServer] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.refuse_switches("OpenHands", TOOLS, "terminal")
        given = set(self.tools or DEFAULT_TOOLS)
        if unknown := sorted(set(self.tool_params) - given):
            raise ValueError(f"harness.tool_params: {', '.join(unknown)} is not among the agent's tools "
                             f"({', '.join(sorted(given))})")

    async def start(self) -> None:
        python = Path(self.binary or OPENHANDS_PYTHON)
        if not python.exists():
            raise HarnessCrashed(f"the OpenHands environment's Python was not found at {python}: run `make "
                                 "setup-test` (it builds .venv/openhands with Python 3.12), or set it as the binary")
        # Found, not imported (~6 CPU-s): the prefork server or the first runner reports an SDK that cannot load.
        probe = ("import importlib.util, sys; assert importlib.util.find_spec('openhands.sdk'), 'no openhands.sdk'; "
                 "print(sys.prefix); print(sys.base_prefix)")
        r = await asyncio.to_thread(subprocess.run, [str(python), "-c", probe], capture_output=True, text=True,
                                    timeout=120)
        if r.returncode != 0:
            raise HarnessCrashed(f"{python} has no OpenHands SDK: {r.stderr[-1000:]}")
        self.binary = str(python)  # not resolved: a venv's python finds its packages through its own path
        self.visible_paths = tuple(os.path.realpath(p) for p in r.stdout.split())
        self.runner = RUNNER.read_text()
        if self.prefork and forks_can_enter_sandboxes():  # the server will be used: it imports now, on a machine
            # not yet busy with episodes (beside 50 CLI episodes on 2 cores, the imports took minutes)
            self._starting = asyncio.ensure_future(self._start_server())

    async def prefork_server(self) -> PreforkServer:
        """The prefork server, started once (again if it died): with the environment an episode's imports see,
        nothing of the driver's. Its start is one task shared by the episodes waiting on it and shielded from
        their cancellation: an episode that runs out of time while the SDK imports (slow on a busy machine)
        leaves the start going for the next, and never a server that nobody owns."""
        if self.server is not None and not self.server.alive:  # it died: a new one for the episodes to come
            dead, self.server, self._starting = self.server, None, None
            await dead.close()
        if self._starting is None or (self._starting.done() and (self._starting.cancelled()
                                                                 or self._starting.exception() is not None)):
            self._starting = asyncio.ensure_future(self._start_server())
        self.server = await asyncio.shield(self._starting)
        return self.server

    async def _start_server(self) -> PreforkServer:
        server = PreforkServer(str(self.binary), RUNNER, {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                                          **self.env(None)})
        await server.start(timeout=SERVER_START_TIMEOUT)
        return server

    async def close(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()  # PreforkServer.start ends its process when cancelled
            await asyncio.gather(self._starting, return_exceptions=True)
        if self.server is not None:
            await self.server.close()
            self.server = None

    def spec(self, run: HarnessRun) -> dict[str, object]:
        return {"model": run.model_name, "base_url": run.relay_base.rstrip("/") + "/v1", "api_key": run.api_key,
                "task": self.prompt(run), "tools": list(self.tools or DEFAULT_TOOLS),
                "system_prompt": self.system_prompt, "max_iterations": self.max_calls, "timeout": self.timeout,
                "tool_params": self.tool_params}

    def env(self, run: HarnessRun | None) -> dict[str, str]:
        """The runner's environment (`run` None: without the episode's spec, as the prefork server starts)."""
        spec = {} if run is None else {"LEGORL_OPENHANDS_SPEC": json.dumps(self.spec(run))}
        env = {**spec, "HOME": "/tmp", "NO_COLOR": "1", "TERM": "dumb",
               "OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no fetch of prices
               "PYTHONWARNINGS": "ignore"}
        return self.with_extra_env(env)

    def command(self, run: HarnessRun) -> str:
        return self.shell(RUNNER_IN_SANDBOX, *self.extra_args)

    async def run(self, run: HarnessRun) -> HarnessResult:
        if (unstarted := self.missing_relay(run)) is not None:
            return unstarted
        target = await asyncio.to_thread(sandbox_target, run.control_socket) if self.prefork else None
        if target is not None:
            server = await self.prefork_server()
            output, rc = await asyncio.to_thread(server.run, target, self.env(run), self.timeout, self.extra_args)
            if rc is None:
                raise TimeoutError(f"the harness did not finish within {self.timeout:.0f}s")
        else:
            await write_files(run, {RUNNER_IN_SANDBOX: self.runner})
            output, rc = await exec_cli(run, self.command(run), self.env(run), self.timeout)
        res = last_json(output, lambda o: "legorl_openhands" in o)
        if res is None:
            return HarnessResult(exit_status="exited", n_calls=0,
                                 error=f"openhands exited with {rc} without a result line: {output[-2000:]}")
        status, error = str(res["legorl_openhands"]), str(res.get("error") or "")
        if status == "finished" and not error:
            return HarnessResult(exit_status="Submitted", n_calls=0)
        if status == "max_iterations":
            return HarnessResult(exit_status="LimitsExceeded", n_calls=0, error=error)
        return HarnessResult(exit_status=status or "error", n_calls=0, error=error or f"conversation {status}")
