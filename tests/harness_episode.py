"""One scripted episode of an in-sandbox harness (Claude Code, Codex, OpenCode, OpenHands), for the
conformance tests: the real harness in a real bubblewrap sandbox on a one-bug workspace, talking to
the proxy over the relay, the scripted engine answering."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from test_proxy import check_fidelity

from legorl.engine import ScriptedEngine
from legorl.harness.base import HarnessResult, HarnessRun
from legorl.proxy.server import Proxy
from legorl.proxy.sessions import Session
from legorl.records import MAIN_SESSION, LLMCall, Outcome
from legorl.rollout.outcomes import EpisodeFacts, decide
from legorl.sandbox import BwrapSandbox

CALC = "def add(a, b):\n    return a - b\n"
# A user's own agent (the official openai SDK, one bash tool), run by harness.name: command
BASH_AGENT = Path(__file__).resolve().parents[1] / "examples" / "bash_agent.py"
TASK = "add(2, 3) returns -1; it must return 5."


def sandbox_kwargs() -> dict:
    """Stay the driver's uid where the sandbox supports choosing (root here: the host venv lives under /root)."""
    return {"sandbox_uid": 0} if "sandbox_uid" in inspect.signature(BwrapSandbox.create).parameters else {}


def tool_names(prompt: str) -> set[str]:
    """The tools a rendered prompt declares."""
    block = prompt.split("XML tags:\n<tools>", 1)[-1].split("\n</tools>", 1)[0]
    return {json.loads(line)["function"]["name"] for line in block.splitlines() if line.startswith("{")}


async def run_episode(harness: Any, tokenizer: Any, tmp_path: Path, script: Any, box_kw: dict | None = None,
                      ) -> tuple[HarnessResult, Session, list[LLMCall], str]:
    """Start `harness`, run one episode with `script` answering (in a sandbox made with `box_kw`, default
    `sandbox_kwargs()`); its result, session, calls and calc.py after."""
    engine = ScriptedEngine(tokenizer)
    calls: list[LLMCall] = []
    proxy = Proxy(engine, tokenizer, on_call=calls.append)
    await proxy.start(unix_socket=tmp_path / "sock" / "proxy.sock")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "calc.py").write_text(CALC)
    await harness.start()
    box = await BwrapSandbox.create(workspace=ws, sandbox_dir=tmp_path / "box", label=f"test-{harness.name}",
                                    proxy_socket=proxy.unix_socket,
                                    visible_paths=getattr(harness, "visible_paths", ()),
                                    **(sandbox_kwargs() if box_kw is None else box_kw))
    session = proxy.open_session("r1", max_calls=getattr(harness, "max_calls", None), call_kind=harness.call_kind)
    engine.set_script("r1", script)
    run = HarnessRun(rollout_id="r1", task_text=TASK, api_base=proxy.openai_base_url(session.token),
                     api_key=session.token, model_name=proxy.model_name, control_socket=str(box.control_socket),
                     relay_base=f"http://127.0.0.1:{box.relay_port}/s/{session.token}")
    try:
        result = await harness.run(run)
    finally:
        proxy.close_session(session.token)
        await harness.close()
        await box.close()
        await proxy.stop()
    return result, session, calls, (ws / "calc.py").read_text()


def check_read_edit_check_episode(tokenizer: Any, result: HarnessResult, session: Session, calls: list[LLMCall],
                                  seen: list[str]) -> None:
    """What a scripted read, edit, check, reply episode must show through any CLI: every call token-exact, one
    chain, the tool outputs reached the model, the final reply came back, and a valid episode up to grading."""
    check_fidelity(tokenizer, calls)
    assert [c.parent_index for c in calls[1:]] == [c.index for c in calls[:-1]]  # one token-exact chain
    assert "return a - b" in seen[1] and "5" in seen[3].split("<tool_response>")[-1]  # tool output reached it
    assert "Fixed" in result.messages[-1]["content"]
    outcome, _ = decide(EpisodeFacts(harness=result, proxy_calls=session.n_calls), calls, None)
    assert outcome == Outcome.GRADER_ERROR  # i.e. everything up to grading was a valid episode


def answering_side_call(tokenizer: Any, agent_script: Any, marker: str, reply: str) -> Any:
    """`agent_script`, except that a prompt containing `marker` (a side call: a title request) gets `reply`."""
    def script(i: int, prompt_ids: list[int]) -> str:
        if marker in tokenizer.decode(prompt_ids, skip_special_tokens=False):
            return reply
        return agent_script(i, prompt_ids)
    return script


def check_side_session(tokenizer: Any, calls: list[LLMCall], session: Session, name: str, n_main: int,
                       ) -> list[LLMCall]:
    """A harness's side calls went to side session `name`: declaring no tools, not counted as the agent's turns,
    in the rollout's one index space, the agent's `n_main` calls one whole token-exact chain. The agent's calls."""
    main = [c for c in calls if c.session == MAIN_SESSION]
    side = [c for c in calls if c.session != MAIN_SESSION]
    assert len(main) == n_main and side and {c.session for c in side} == {name}
    assert all(not c.request.get("tools") for c in side)
    assert session.n_calls == n_main and session.sides[name].n_calls == len(side)  # not agent turns
    assert sorted(c.index for c in calls) == list(range(len(calls)))  # one index space per rollout
    assert [c.parent_index for c in main[1:]] == [c.index for c in main[:-1]]  # the agent's chain is whole
    check_fidelity(tokenizer, calls)
    return main
