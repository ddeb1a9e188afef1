"""A mini-swe-agent Environment that runs each command inside a legorl sandbox.

mini-swe-agent takes its environment class by import path
(`environment_class: legorl.harness.mini_env.SandboxEnvironment`), so plugging in
here changes no line of the harness. It subclasses mini's own LocalEnvironment to
keep its submission rule (`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` on the first
output line) and template variables exactly as upstream defines them; only the
place where a command runs differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minisweagent.environments.local import LocalEnvironment, LocalEnvironmentConfig

from legorl.sandbox.client import SandboxClient


class SandboxEnvironmentConfig(LocalEnvironmentConfig):
    control_socket: str
    cwd: str = ""  # empty: the sandbox's workspace (the task's workdir)


class SandboxEnvironment(LocalEnvironment):
    def __init__(self, *, config_class: type = SandboxEnvironmentConfig, **kwargs: Any):
        super().__init__(config_class=config_class, **kwargs)
        self.client = SandboxClient(Path(self.config.control_socket))

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        command = action.get("command", "")
        limit = timeout or self.config.timeout
        try:
            r = self.client.exec(command, timeout=limit, cwd=cwd or self.config.cwd or None, env=self.config.env or None)
        except Exception as e:  # noqa: BLE001 - the sandbox is gone (killed, deadline): report it like mini does
            output = {"output": "", "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: {e}",
                      "extra": {"exception_type": type(e).__name__, "exception": str(e)}}
        else:
            info = f"Command timed out after {limit} seconds" if r.timed_out else ""
            output = {"output": r.output, "returncode": r.returncode, "exception_info": info}
        self._check_finished(output)
        return output
