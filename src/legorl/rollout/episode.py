"""One rollout, end to end: sandbox, harness through the proxy, diff, grade, outcome.

Every step that can fail is caught here and turned into a typed outcome, so one
broken rollout never takes its step down. The rollout's proxy session is opened with the engine
its context chooses for it (`EngineFor`: the policy, or a teacher playing the task), wrapped in
chaos mode by a fault injector of its own. A cancelled rollout (a straggler once
its step has enough groups) cleans up after itself and is recorded as such.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from legorl.config import FaultsConfig, SandboxConfig
from legorl.engine.base import Engine
from legorl.engine.scripted import Script, ScriptedEngine
from legorl.grading import empty_patch_report, grade, workspace_diff
from legorl.harness.base import Harness, HarnessCrashed, HarnessResult, HarnessRun, ToolStyle
from legorl.proxy.server import Proxy
from legorl.records import GraderReport, Outcome, Rollout
from legorl.rollout.faults import FaultPlan, FaultyEngine, InjectedFault, kill_later, plan_for
from legorl.rollout.outcomes import DEFAULT_POLICIES, EpisodeFacts, Policy, decide, reward_for
from legorl.sandbox import Sandbox, SandboxError
from legorl.sandbox.control import RELAY_PORT
from legorl.sandbox.factory import create_sandbox
from legorl.sandbox.limits import SandboxLimits
from legorl.store import Store
from legorl.tasks import Task
from legorl.tasks.pristine import PRISTINE

CANCELLED_REASON = "cancelled: a straggler, its step already had enough complete groups"


class EngineFor(Protocol):
    """The engine that serves a rollout's sessions, chosen per rollout by whoever runs the episodes."""

    def __call__(self, task: Task, harness: Harness, rollout_id: str) -> Engine: ...


def always(engine: Engine) -> EngineFor:
    """Every rollout served by `engine`: the policy (RL, evaluation) or the upstream teacher."""
    return lambda task, harness, rollout_id: engine


def scripted(engine: ScriptedEngine, script_for: Callable[[Task, str | ToolStyle], Script]) -> EngineFor:
    """The scripted teacher: each rollout plays the script `script_for` writes for its task and its harness's
    teacher_style, given to the engine as the rollout's session opens."""
    def choose(task: Task, harness: Harness, rollout_id: str) -> Engine:
        engine.set_script(rollout_id, script_for(task, harness.teacher_style))
        return engine
    return choose


@dataclass
class EpisodeContext:
    """The long-lived parts a rollout uses (owned by the driver)."""

    proxy: Proxy
    harnesses: dict[str, Harness]  # by name; the first is the default
    store: Store
    run_dir: Path
    label: str  # the run's label on every sandbox, for reaping
    agent_timeout: float
    grading_timeout: float
    engine_for: EngineFor  # which engine serves each rollout's sessions
    hide_paths: list[Path] = field(default_factory=list)  # invisible inside sandboxes (run dir, task files)
    keep_workspaces: bool = False
    policies: dict[Outcome, Policy] = field(default_factory=lambda: dict(DEFAULT_POLICIES))
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    limits: SandboxLimits | None = None  # None: the sandbox's defaults
    sandbox_uid: int | None = None
    relay_port: int = RELAY_PORT  # inside the sandbox, 127.0.0.1:relay_port reaches the proxy
    require_submit: bool = True  # only a submitted episode can be resolved (outcomes.decide)
    one_version: bool = True  # every sampled token under one weight version (false: asynchronous RL)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # the backend (kind, image, engine) of its sandboxes


def _harness(ctx: EpisodeContext, name: str | None) -> Harness:
    if name is None:
        return next(iter(ctx.harnesses.values()))
    if name not in ctx.harnesses:
        raise ValueError(f"no harness {name!r} in this run (harness.name: {list(ctx.harnesses)})")
    return ctx.harnesses[name]


def new_rollout_id(step: int, task_id: str, sample: int) -> str:
    return f"s{step}-{task_id}-{sample}-{uuid.uuid4().hex[:6]}"


async def _run_harness(ctx: EpisodeContext, harness: Harness, run: HarnessRun, plan: FaultPlan) -> HarnessResult:
    if "harness_hang" in plan:
        await asyncio.sleep(ctx.agent_timeout + 60)  # the deadline fires first
    if "harness_crash" in plan:
        raise HarnessCrashed("injected fault: the harness process died")
    if "no_model_calls" in plan:
        return HarnessResult(exit_status="Submitted", n_calls=0)
    return await harness.run(run)


async def _diff(sandbox: Sandbox, plan: FaultPlan) -> str:
    if "disk_full" in plan:
        # Simulated at the sandbox boundary: the workspace cannot be read back, as when its disk is full.
        raise InjectedFault("injected fault: no space left on device inside the sandbox")
    return await workspace_diff(sandbox)


async def _grade(ctx: EpisodeContext, task: Task, diff: str, work_dir: Path, plan: FaultPlan) -> GraderReport:
    try:
        if "grader_crash" in plan:
            raise InjectedFault("injected fault: the grader crashed")
        if not diff.strip():
            return empty_patch_report(task)
        return await grade(task, diff, work_dir=work_dir, timeout=ctx.grading_timeout, hide_paths=ctx.hide_paths,
                           sandbox=ctx.sandbox, label=ctx.label)
    except Exception as e:  # noqa: BLE001 - a grader bug must not take the step down
        return GraderReport(resolved=False, outcome=Outcome.GRADER_ERROR, reason=f"{type(e).__name__}: {e}")


async def run_episode(ctx: EpisodeContext, task: Task, *, step: int, group_id: str, sample_index: int,
                      split: str = "train", rollout_id: str | None = None, harness: str | None = None) -> Rollout:
    """`rollout_id`: given by a caller that records the rollout elsewhere too (the Ray driver).
    `harness`: which of the run's harnesses plays the episode (default: the first)."""
    rid = rollout_id or new_rollout_id(step, task.instance_id, sample_index)
    agent = _harness(ctx, harness)
    engine = ctx.engine_for(task, agent, rid)
    # Chaos mode: engine faults are drawn per call by this rollout's own wrapper, which names the ones it met.
    faulty = FaultyEngine(engine, ctx.faults, rid) if ctx.faults.engine_exception or ctx.faults.engine_malformed \
        else None
    rollout = Rollout(id=rid, step=step, task_id=task.instance_id, group_id=group_id, sample_index=sample_index,
                      harness=agent.name, split=split, weight_version_start=engine.weight_version)
    ctx.store.upsert_rollout(rollout)
    plan = plan_for(ctx.faults, rid)
    box_dir = ctx.run_dir / "sandboxes" / rid
    facts = EpisodeFacts(harness=None)
    t0 = time.time()
    sandbox: Sandbox | None = None
    session = None
    killer: asyncio.Task | None = None
    try:
        try:
            if "slow_sandbox_start" in plan:
                await asyncio.sleep(ctx.faults.slow_start_seconds)
            await asyncio.to_thread(PRISTINE.copy, task, box_dir / "workspace")  # prepare_repo's result, cached
            sandbox = await create_sandbox(
                ctx.sandbox, workspace=box_dir / "workspace", sandbox_dir=box_dir, label=ctx.label,
                proxy_socket=ctx.proxy.unix_socket, relay_port=ctx.relay_port, hide_paths=ctx.hide_paths,
                limits=ctx.limits, inside_workspace=task.workdir, sandbox_uid=ctx.sandbox_uid,
                cpus=task.limits.get("cpus"), image=task.image, environment=task.environment,
                visible_paths=getattr(agent, "visible_paths", ()))  # host paths the harness runs from
        except Exception as e:  # noqa: BLE001 - a sandbox that cannot start is this rollout's outcome, not the step's
            facts.sandbox_error = f"sandbox set-up failed: {type(e).__name__}: {e}"
        rollout.timings["setup_s"] = time.time() - t0

        if sandbox is not None:
            t1 = time.time()
            session = ctx.proxy.open_session(rid, faulty or engine, max_calls=getattr(agent, "max_calls", None),
                                             call_kind=agent.call_kind)
            run = HarnessRun(rollout_id=rid, task_text=task.problem_statement,
                             api_base=ctx.proxy.openai_base_url(session.token), api_key=session.token,
                             model_name=ctx.proxy.model_name, control_socket=str(sandbox.control_socket),
                             relay_base=f"http://127.0.0.1:{sandbox.relay_port}/s/{session.token}")
            if "sandbox_killed" in plan:
                killer = asyncio.create_task(kill_later(sandbox, random.Random(rid)))
            try:
                facts.harness = await asyncio.wait_for(sandbox.guard(_run_harness(ctx, agent, run, plan)),
                                                       timeout=ctx.agent_timeout)
            except TimeoutError:
                facts.timed_out = True
            except SandboxError as e:  # its watchdog killed it mid-run (a limit blown, its process budget exhausted)
                facts.sandbox_error = sandbox.violation or str(e)
            except HarnessCrashed as e:
                facts.crashed = str(e)
            except Exception as e:  # noqa: BLE001 - a harness adapter's bug is this rollout's crash
                facts.crashed = f"{type(e).__name__}: {e}"
            finally:
                # Closing the session first makes any late call of a timed-out agent fail fast.
                ctx.proxy.close_session(session.token)
            facts.proxy_errors = tuple(session.errors)
            facts.proxy_calls = session.n_calls
            rollout.timings["agent_s"] = time.time() - t1
            facts.sandbox_error = facts.sandbox_error or sandbox.violation
            try:
                if not facts.sandbox_error:
                    rollout.diff = await _diff(sandbox, plan)
            except Exception as e:  # noqa: BLE001 - an unreadable workspace is this rollout's outcome
                facts.sandbox_error = f"could not read the workspace diff: {type(e).__name__}: {e}"
            await sandbox.close()

        ctx.store.load_calls(rollout)  # its agent's calls (what outcomes read) and its side calls
        report = None
        if not facts.sandbox_error and facts.harness is not None and facts.proxy_calls > 0:
            t2 = time.time()
            report = await _grade(ctx, task, rollout.diff, box_dir / "grade", plan)
            rollout.timings["grading_s"] = time.time() - t2
        rollout.report = report
        rollout.outcome, rollout.outcome_reason = decide(facts, rollout.calls, report, ctx.require_submit,
                                                         ctx.one_version)
    except asyncio.CancelledError:
        rollout.outcome, rollout.outcome_reason = Outcome.AGENT_TIMEOUT, CANCELLED_REASON
        ctx.store.load_calls(rollout)
        raise
    finally:
        # Record first: a second cancellation while cleaning up must not leave the rollout unrecorded.
        # Engine faults are drawn per call, so they are named here too: a rollout hit by two faults says so.
        if injected := plan.faults | (faulty.hits if faulty is not None else set()):
            rollout.timings["injected_faults"] = float(len(injected))
            rollout.outcome_reason += f" [injected: {', '.join(sorted(injected))}]"
        rollout.reward = reward_for(rollout.outcome, ctx.policies) if rollout.outcome else None
        rollout.weight_version_end = engine.weight_version
        rollout.timings["total_s"] = time.time() - t0
        ctx.store.upsert_rollout(rollout)
        if killer is not None:
            killer.cancel()
        if session is not None:
            ctx.proxy.close_session(session.token)
        if sandbox is not None:
            with contextlib.suppress(BaseException):
                await asyncio.shield(sandbox.close())
        if not ctx.keep_workspaces:
            shutil.rmtree(box_dir, ignore_errors=True)
    return rollout
