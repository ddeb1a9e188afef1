"""A long-lived process that runs mini-swe-agent episodes through its own Python API.

Why a worker and not the `mini` CLI per rollout: importing mini-swe-agent pulls in
litellm, about 3.4 s of CPU per process. One worker pays it once and runs many
episodes (one thread each). The harness code is used as shipped: its
DefaultAgent and LitellmModel, with our sandbox environment plugged in through
the class mini-swe-agent expects.

Protocol: JSON lines. stdin gets {"op": "run", ...} requests; the real stdout
carries only replies (the harness's own printing goes to stderr).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from typing import Any

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "1")

_proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # anything the harness prints lands on stderr, not in our protocol
sys.stdout = sys.stderr
_write_lock = threading.Lock()


def _reply(obj: dict[str, Any]) -> None:
    with _write_lock:
        _proto.write(json.dumps(obj) + "\n")
        _proto.flush()


def run_episode(req: dict[str, Any]) -> dict[str, Any]:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models.litellm_model import LitellmModel
    from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel

    from legorl.harness.mini_env import SandboxEnvironment

    model_class = LitellmTextbasedModel if req.get("text") else LitellmModel  # mini's text mode: no tool
    model = model_class(
        model_name=f"openai/{req['model_name']}",
        model_kwargs={"api_base": req["api_base"], "api_key": req["api_key"], "drop_params": True,
                      "timeout": req.get("call_timeout", 600)},
        cost_tracking="ignore_errors",
        **req.get("model", {}),
    )
    env = SandboxEnvironment(control_socket=req["control_socket"], **req.get("env", {}))
    agent = DefaultAgent(model, env, **req["agent"])
    result: dict[str, Any] = {"rollout_id": req["rollout_id"], "n_calls": 0}
    try:
        info = agent.run(req["task"])
        result["exit_status"] = info.get("exit_status", "")
    except Exception as e:  # noqa: BLE001 - mini re-raises uncaught errors after recording them
        result["exit_status"] = type(e).__name__
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
    result["n_calls"] = agent.n_calls
    result["messages"] = [
        {k: v for k, v in m.items() if k in ("role", "content")} for m in agent.messages if isinstance(m, dict)
    ]
    return result


def _serve_one(req: dict[str, Any]) -> None:
    try:
        _reply(run_episode(req))
    except Exception as e:  # noqa: BLE001 - a broken request is answered, and the worker serves the next
        _reply({"rollout_id": req.get("rollout_id"), "exit_status": "WorkerError", "n_calls": 0,
                "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})


def _die_with_parent() -> None:
    """SIGKILL this worker when the driver dies, even by SIGKILL: no orphan keeps running episodes."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the stdin-EOF exit below still applies
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def main() -> None:
    _die_with_parent()
    # pay the imports once, before saying ready
    import minisweagent.agents.default
    import minisweagent.models.litellm_model
    import minisweagent.models.litellm_textbased_model  # noqa: F401

    _reply({"op": "ready", "pid": os.getpid()})
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "run":
            threading.Thread(target=_serve_one, args=(req,), daemon=True).start()
        elif req.get("op") == "exit":
            break
    # stdin closed: the driver is gone. Exit now, without waiting for episode threads or atexit hooks.
    os._exit(0)


if __name__ == "__main__":
    main()
