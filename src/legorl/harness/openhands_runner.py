"""Runs one OpenHands episode through the OpenHands SDK's documented entry point (an `Agent` with the
SDK's own tools, a `Conversation` on the workspace), unmodified, INSIDE the rollout's sandbox.

Executed by the OpenHands environment's Python (3.12+), not legorl's: it imports nothing of legorl.
Its input is the JSON in LEGORL_OPENHANDS_SPEC (model, base_url, api_key, task, tools, tool_params,
system_prompt, max_iterations); its last stdout line is a JSON object {"legorl_openhands": status, "error": ...}
with the conversation's execution status (finished, stuck, error, ... ; "max_iterations" when
the iteration budget ran out first).
"""

import json
import os
import sys
import time
import traceback


def preload() -> None:
    """The SDK's imports: ~85 % of an episode's CPU. A prefork server (prefork_server.py) runs this once and
    forks each episode's runner, already imported, into its sandbox; run directly, main() does it."""
    import openhands.sdk
    import openhands.tools.preset.default  # noqa: F401


def main() -> int:
    t0 = time.monotonic()
    spec = json.loads(os.environ["LEGORL_OPENHANDS_SPEC"])
    preload()
    from openhands.sdk import LLM, Agent, Conversation, Tool
    from openhands.tools.preset.default import register_default_tools

    register_default_tools(enable_browser=False)
    if "task" in spec["tools"]:
        from openhands.tools.task import TaskToolSet  # noqa: F401  (registers the sub-agent tool)
    llm = LLM(model=f"openai/{spec['model']}", base_url=spec["base_url"], api_key=spec["api_key"],
              usage_id="agent", num_retries=0, timeout=spec.get("timeout", 3600))
    params = spec.get("tool_params") or {}
    agent = Agent(llm=llm, tools=[Tool(name=name, params=params.get(name, {})) for name in spec["tools"]],
                  system_prompt=spec.get("system_prompt"), system_prompt_kwargs={"cli_mode": True})
    conversation = Conversation(agent=agent, workspace=os.getcwd(), visualizer=None,
                                max_iteration_per_run=spec["max_iterations"])
    conversation.send_message(spec["task"])
    t1 = time.monotonic()
    error = ""
    try:
        conversation.run()
    except Exception as e:  # noqa: BLE001 - the SDK raises on an LLM error: report it, as its CLI does
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    status = str(getattr(conversation.state.execution_status, "value", conversation.state.execution_status))
    codes = [(getattr(e, "code", ""), getattr(e, "detail", "")) for e in conversation.state.events
             if type(e).__name__ == "ConversationErrorEvent"]
    if any(code == "MaxIterationsReached" for code, _ in codes):
        status = "max_iterations"
    error = "; ".join([error] * bool(error) + [f"{code}: {detail}" for code, detail in codes])
    timings = {"setup_s": round(t1 - t0, 3), "run_s": round(time.monotonic() - t1, 3)}
    print(json.dumps({"legorl_openhands": status, "error": error, "timings": timings}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
