"""mini-swe-agent, unmodified, driven through long-lived worker processes.

See mini_worker.py for why a worker, and mini_env.py for how commands reach the
sandbox. Prompts and step limits are the user's harness configuration
(`harness.system_template`, `harness.instance_template`, `harness.step_limit`);
the defaults below are short because the embedded model is small.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

from legorl.config import HarnessConfig
from legorl.harness.base import HarnessCrashed, HarnessResult, HarnessRun
from legorl.records import MAIN_SESSION

DEFAULT_SYSTEM_TEMPLATE = "You are a coding agent. Use the bash tool, one command per turn."
DEFAULT_INSTANCE_TEMPLATE = (
    "Fix this issue in the repository in the current directory.\n\n{{task}}\n\n"
    "When the fix is done, run exactly: echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
)
# Text mode (`harness.action_format: text`): mini's text-based model finds the command in a fenced bash
# block of the answer, the way instruct models write shell commands unprompted; no tool is declared.
TEXT_SYSTEM_TEMPLATE = (
    "You are a coding agent. Each reply: one short thought, then exactly one bash command in a block:\n"
    "```bash\ncat file.py\n```"
)
TEXT_ACTION_REGEX = r"```bash\s*\n(.*?)\n```"
TEXT_FORMAT_ERROR = (
    "Format error: reply with exactly one bash command in a ```bash block; found {{actions|length}}."
)
# mini's default observation format, with the output capped so a long listing cannot
# overflow a small model's context.
OBSERVATION_TEMPLATE = (
    "{% if output.exception_info %}<exception>{{output.exception_info}}</exception>\n{% endif %}"
    "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output[:1500]}}</output>"
)


class _Worker:
    def __init__(self, log_path: Path, label: str):
        self.log_path = log_path
        self.label = label
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[str, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("MSWEA_GLOBAL_CONFIG_DIR", str(self.log_path.parent / "mini-swe-agent-config"))
        with open(self.log_path, "ab") as log:  # noqa: ASYNC230 - a local append: instant
            self.proc = await asyncio.create_subprocess_exec(
                # The label names the run in the process list, so a killed run's leftovers can be found.
                sys.executable, "-m", "legorl.harness.mini_worker", "--label", self.label,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log, env=env,
                start_new_session=True, limit=64 * 1024 * 1024,
            )
        line = await self.proc.stdout.readline()
        if not line or json.loads(line).get("op") != "ready":
            raise HarnessCrashed(f"mini-swe-agent worker failed to start; see {self.log_path}")
        self._reader = asyncio.create_task(self._read())

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def _read(self) -> None:
        assert self.proc and self.proc.stdout
        while True:
            line = await self.proc.stdout.readline()
            if not line:
                break
            msg = json.loads(line)
            fut = self.pending.pop(msg.get("rollout_id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        for fut in self.pending.values():  # the worker died: every episode in it crashed
            if not fut.done():
                fut.set_exception(HarnessCrashed(f"mini-swe-agent worker exited; see {self.log_path}"))
        self.pending.clear()

    async def submit(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc and self.proc.stdin
        fut = asyncio.get_running_loop().create_future()
        self.pending[req["rollout_id"]] = fut
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        await self.proc.stdin.drain()
        try:
            return await fut
        finally:
            self.pending.pop(req["rollout_id"], None)

    async def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await self._reader


class MiniSweAgentHarness:
    name = "mini-swe-agent"

    def __init__(self, cfg: HarnessConfig, *, command_timeout: float, log_dir: Path):
        self.cfg = cfg
        self.text = cfg.action_format == "text"
        self.teacher_style = "mini-swe-agent/text" if self.text else self.name
        self.command_timeout = command_timeout
        self.log_dir = log_dir
        self.workers: list[_Worker] = []
        self._next = itertools.count()

    async def start(self) -> None:
        self.workers = [_Worker(self.log_dir / f"mini-worker-{i}.log", str(self.log_dir))
                        for i in range(self.cfg.workers)]
        await asyncio.gather(*(w.start() for w in self.workers))

    def _request(self, run: HarnessRun) -> dict[str, Any]:
        return {
            "op": "run", "rollout_id": run.rollout_id, "task": run.task_text, "model_name": run.model_name,
            "api_base": run.api_base, "api_key": run.api_key, "control_socket": run.control_socket,
            "agent": {
                "system_template": self.cfg.system_template or
                (TEXT_SYSTEM_TEMPLATE if self.text else DEFAULT_SYSTEM_TEMPLATE),
                "instance_template": self.cfg.instance_template or DEFAULT_INSTANCE_TEMPLATE,
                "step_limit": self.cfg.step_limit, "cost_limit": 0.0,
                "max_consecutive_format_errors": self.cfg.max_consecutive_format_errors,
            },
            "env": {"timeout": int(self.command_timeout), "env": {"PAGER": "cat", "TQDM_DISABLE": "1"}},
            "model": {"observation_template": OBSERVATION_TEMPLATE,
                      **({"action_regex": TEXT_ACTION_REGEX, "format_error_template": TEXT_FORMAT_ERROR}
                         if self.text else {})},
            "text": self.text,
        }

    def call_kind(self, body: dict[str, Any]) -> str:
        return MAIN_SESSION  # it makes no side calls: every request is a turn of its agent

    async def run(self, run: HarnessRun) -> HarnessResult:
        i = next(self._next) % len(self.workers)
        worker = self.workers[i]
        if not worker.alive:  # replace a dead worker before giving it work
            await worker.close()
            worker = self.workers[i] = _Worker(worker.log_path, worker.label)
            await worker.start()
        msg = await worker.submit(self._request(run))
        return HarnessResult(exit_status=msg.get("exit_status", ""), n_calls=int(msg.get("n_calls", 0)),
                             error=msg.get("error", ""), traceback=msg.get("traceback", ""),
                             messages=msg.get("messages", []))

    async def close(self) -> None:
        await asyncio.gather(*(w.close() for w in self.workers))
