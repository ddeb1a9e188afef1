"""The Ray backend: rollout workers (proxy + sandboxes + harness) as Ray actors.

    legorl train --config configs/smoke.yaml ray.address=local ray.workers=2

What runs where:

- The driver keeps the scheduling (GroupRunner: concurrency, retries, over-sampling, refills),
  the run's store, the trainer, the dashboard and the policy engine. With `engine.kind: local`
  it serves its embedded engine over HTTP (engine/server.py, the routes `legorl serve` has);
  with vllm / sglang the workers call `engine.urls` themselves.
- Each `RolloutWorker` actor builds, with the same builders as the driver (rollout/builders.py),
  an engine client, a Proxy, the harness and bubblewrap sandboxes, under
  `RUN_DIR/workers/wN/` on its node; an episode runs there with `run_episode`, unchanged. Its
  calls go to a journal store of the worker's own; the finished Rollout, calls included, comes
  back to the driver, which records it in the run's store: the same records and outcomes as
  the embedded path.
- The driver records each rollout when it dispatches it (as `run_episode` does), so a killed
  driver's resume finds it; a worker that dies takes its rollout's sandbox with it: the rollout
  is a `sandbox_error` (retried on another worker, by default).

Weight updates happen in the driver. No call straddles one: `RayCluster.paused()` holds every
worker's proxy (new calls wait, in-flight ones drain: `Proxy.paused`, the same guarantee as the
embedded path), the engine is updated, and the workers resume following the driver engine's
`weights()`, which their engine clients stamp on every later call. (Per-call stamping alone would
not be enough: a remote client stamps the version it knows when the call starts.)

Teacher demonstrations: `RayCluster.teacher(sft)` has every worker build the SFT teacher, and its
episodes (`run(..., teacher=True)`) open their sessions with it; the policy's stay as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from legorl.config import Config, SFTConfig
from legorl.engine.base import Engine, Weights
from legorl.records import Outcome, Rollout
from legorl.rollout.builders import (
    Teacher,
    episode_threads,
    make_context,
    make_harness,
    make_proxy,
    make_remote_engine,
    make_teacher,
)
from legorl.rollout.episode import CANCELLED_REASON, EpisodeContext, new_rollout_id, run_episode
from legorl.rollout.outcomes import reward_for
from legorl.rollout.scheduler import RunEpisode
from legorl.sandbox import reap_sandboxes
from legorl.store import Store
from legorl.tasks import Task

console = Console(stderr=True)

CANCEL_WAIT_S = 120.0  # a cancelled episode cleans up (sandbox, session) and records itself within this
CLOSE_WAIT_S = 60.0
START_WAIT_S = 600.0  # workers wait for free CPUs on the cluster, then set up their harness


class RolloutWorker:
    """A Ray actor (wrapped with `ray.remote` by RayCluster): runs episodes for the driver.

    `start()` builds everything; `run()` runs one episode and returns its Rollout with calls.
    """

    def __init__(self, index: int, cfg: dict[str, Any], tokenizer: Any, run_dir: str, label: str,
                 hide_paths: list[str], engine_url: str | None, weights: Weights):
        self.index = index
        self.cfg = Config.model_validate(cfg)
        self.tokenizer = tokenizer
        self.dir = Path(run_dir) / "workers" / f"w{index}"
        self.label = label
        self.hide_paths = [Path(p) for p in hide_paths]
        self.engine_url = engine_url
        self.weights = weights  # the driver engine's, followed by this worker's client
        self._running: dict[str, asyncio.Task] = {}
        self._pause: contextlib.AbstractAsyncContextManager | None = None
        self._teacher: Teacher | None = None
        self._teacher_ctx: EpisodeContext | None = None  # the policy's context, its sessions served by the teacher

    def _make_client(self) -> Engine:
        kind = self.cfg.engine.kind
        if kind == "local":  # the driver's embedded engine, served over HTTP
            from legorl.engine.remote import VLLMEngine

            return VLLMEngine([self.engine_url], vocab_size=len(self.tokenizer), tokenizer=self.tokenizer)
        if kind == "scripted":
            from legorl.engine.scripted import ScriptedEngine

            return ScriptedEngine(self.tokenizer)
        return make_remote_engine(self.cfg, self.tokenizer)

    async def start(self) -> dict[str, Any]:
        import ray

        cfg = self.cfg
        episode_threads(cfg.rollout.concurrency)
        await reap_sandboxes(cfg.sandbox, self.dir / "sandboxes", self.label)  # a killed earlier run's
        self.store = Store(self.dir / "store.sqlite")  # the worker's journal; the driver keeps the run's
        self.client = self._make_client()
        self.client.follow(self.weights)
        self._sock_dir = Path(tempfile.mkdtemp(prefix="legorl-"))  # short path: sun_path is 108 bytes
        self.proxy = make_proxy(cfg, self.client, self.tokenizer, on_call=self.store.add_call)
        # Port 0: several workers may share a node.
        await self.proxy.start(cfg.proxy.host, 0, unix_socket=self._sock_dir / "proxy.sock")
        self.harness = make_harness(cfg, self.dir / "logs")
        await self.harness.start()
        self.ctx = make_context(cfg, proxy=self.proxy, engine=self.client, harness=self.harness, store=self.store,
                                run_dir=self.dir, label=self.label, hide_paths=self.hide_paths)
        return {"worker": self.index, "node": ray.util.get_node_ip_address(), "pid": os.getpid()}

    async def run(self, task: Task, *, rollout_id: str, step: int, group_id: str, sample_index: int,
                  split: str, teacher: bool = False) -> Rollout:
        """`teacher`: the SFT teacher (open_teacher) serves the episode's sessions, else the policy."""
        if teacher and self._teacher_ctx is None:
            raise RuntimeError(f"rollout worker {self.index} has no teacher: open_teacher first")
        ctx = self._teacher_ctx if teacher else self.ctx
        episode = asyncio.create_task(run_episode(ctx, task, step=step, group_id=group_id, split=split,
                                                  sample_index=sample_index, rollout_id=rollout_id))
        self._running[rollout_id] = episode
        try:
            rollout = await episode
        except asyncio.CancelledError:
            if not episode.done():  # this call itself was cancelled (Ray shutting down)
                episode.cancel()
                raise
            # Cancelled by the driver (a straggler): run_episode recorded it before the cancellation went on.
            recorded = self.store.rollout(rollout_id)
            if recorded is None:
                raise
            rollout = recorded
        finally:
            self._running.pop(rollout_id, None)
        rollout.timings["ray_worker"] = float(self.index)
        return rollout

    async def cancel(self, rollout_id: str) -> None:
        episode = self._running.get(rollout_id)
        if episode is not None:
            episode.cancel()

    async def pause(self) -> None:
        """New calls wait, in-flight ones drain (held until resume)."""
        if self._pause is None:
            self._pause = self.proxy.paused()
            await self._pause.__aenter__()

    async def resume(self, weights: Weights) -> None:
        """Carry on under the driver engine's new `weights` (servers that failed its reload stay out of rotation)."""
        self.client.follow(weights)
        if self._pause is not None:
            pause, self._pause = self._pause, None
            await pause.__aexit__(None, None, None)

    async def open_teacher(self, sft: dict[str, Any]) -> None:
        """Build the SFT teacher for `run(..., teacher=True)`, until close_teacher()."""
        if self._teacher is None:
            self._teacher = make_teacher(SFTConfig.model_validate(sft), self.tokenizer)
            self._teacher_ctx = replace(self.ctx, engine_for=self._teacher.engine_for)

    async def close_teacher(self) -> None:
        if self._teacher is not None:
            teacher, self._teacher, self._teacher_ctx = self._teacher, None, None
            await teacher.engine.close()

    async def close(self) -> None:
        for episode in self._running.values():
            episode.cancel()
        await asyncio.gather(*self._running.values(), return_exceptions=True)
        closers = []  # what start() got to build
        for name, method in (("harness", "close"), ("proxy", "stop"), ("client", "close")):
            if hasattr(self, name):
                closers.append(getattr(getattr(self, name), method))
        closers.append(self.close_teacher)
        for closer in closers:
            try:
                await closer()
            except Exception as e:  # noqa: BLE001 - keep closing the rest
                print(f"rollout worker {self.index}: while shutting down: {type(e).__name__}: {e}")
        await reap_sandboxes(self.cfg.sandbox, self.dir / "sandboxes", self.label)
        if hasattr(self, "_sock_dir"):
            shutil.rmtree(self._sock_dir, ignore_errors=True)
        if hasattr(self, "store"):
            self.store.close()


@dataclass(eq=False)
class _Handle:
    index: int
    actor: Any
    info: dict[str, Any]
    inflight: int = 0
    alive: bool = True


class RayCluster:
    """The driver's side: starts the workers, dispatches episodes to them, records what comes back."""

    def __init__(self, cfg: Config, *, run_dir: Path, label: str, hide_paths: list[Path], tokenizer: Any,
                 store: Store, engine: Engine, policies: dict[Outcome, Any]):
        self.cfg = cfg
        self.run_dir = run_dir
        self.label = label
        self.hide_paths = hide_paths
        self.tokenizer = tokenizer
        self.store = store
        self.engine = engine
        self.policies = policies
        self.workers: list[_Handle] = []
        self.server: Any = None  # the engine server (engine.kind local)
        self._owns_ray = False

    async def start(self) -> None:
        import ray

        r = self.cfg.ray
        if not ray.is_initialized():  # a process that already called ray.init() keeps its connection
            if r.address == "local":  # room for every worker whatever the core count (Ray's CPUs are logical)
                cpus = max(os.cpu_count() or 1, math.ceil(r.workers * r.num_cpus))
                ray.init(num_cpus=cpus, logging_level="WARNING")
            else:
                ray.init(address=r.address, logging_level="WARNING")
            self._owns_ray = True
        engine_url = None
        if self.cfg.engine.kind == "local":
            from legorl.engine.server import EngineServer

            host = r.engine_host or ("127.0.0.1" if r.address == "local" else ray.util.get_node_ip_address())
            self.server = EngineServer(self.engine, self.tokenizer, self.cfg.proxy.served_model_name)
            engine_url = await self.server.start(host, 0)
        # The upstream teacher's key (and any other LEGORL_ setting) reaches workers on other nodes.
        env = {k: v for k, v in os.environ.items() if k.startswith("LEGORL_")}
        actor = ray.remote(RolloutWorker).options(num_cpus=r.num_cpus,
                                                  runtime_env={"env_vars": env} if env else None)
        cfg = self.cfg.model_dump()
        actors = [actor.remote(i, cfg, self.tokenizer, str(self.run_dir), self.label,
                               [str(p) for p in self.hide_paths], engine_url, self.engine.weights())
                  for i in range(r.workers)]
        self.workers = [_Handle(i, a, {}) for i, a in enumerate(actors)]
        try:
            infos = await asyncio.wait_for(asyncio.gather(*[a.start.remote() for a in actors]), START_WAIT_S)
        except TimeoutError:
            await self.close()
            need = f"{r.workers} x {r.num_cpus} free CPUs (ray.workers x ray.num_cpus)"
            raise RuntimeError(f"the Ray rollout workers did not start within {START_WAIT_S:.0f}s: "
                               f"has the cluster {need}?") from None
        except Exception as e:  # noqa: BLE001 - whatever stopped a worker, the others are closed and it is said
            await self.close()
            raise RuntimeError(f"a Ray rollout worker failed to start: {e}") from None
        for w, info in zip(self.workers, infos):
            w.info = info
        nodes = sorted({info["node"] for info in infos})
        console.print(f"ray: {len(self.workers)} rollout workers on {len(nodes)} node(s) {', '.join(nodes)}"
                      + (f"; engine served at {engine_url}" if engine_url else ""))

    def _pick(self) -> _Handle:
        alive = [w for w in self.workers if w.alive]
        if not alive:
            raise RuntimeError("every Ray rollout worker has died; see the Ray logs")
        return min(alive, key=lambda w: (w.inflight, w.index))

    def _ended(self, stub: Rollout, outcome: Outcome, reason: str) -> Rollout:
        """A rollout whose worker could not report it: recorded from what the driver knows."""
        stub.outcome, stub.outcome_reason = outcome, reason
        stub.reward = reward_for(outcome, self.policies)
        stub.weight_version_end = self.engine.weight_version
        return stub

    def _record(self, rollout: Rollout) -> None:
        self.store.upsert_rollout(rollout)
        for call in sorted(rollout.calls + rollout.side_calls, key=lambda c: c.index):
            self.store.add_call(call)

    async def run_episode(self, task: Task, *, step: int, group_id: str, sample_index: int,
                          split: str, harness: str | None = None, teacher: bool = False) -> Rollout:
        """One episode on the least-busy worker (a `RunEpisode` for the GroupRunner); one harness per run.
        `teacher`: served by the workers' SFT teacher (inside `teacher()`), else by the policy."""
        import ray

        if harness not in (None, self.cfg.harness.name):  # the config refuses a list of harnesses with Ray
            raise ValueError(f"Ray workers run {self.cfg.harness.name}, not {harness}")

        worker = self._pick()
        rid = new_rollout_id(step, task.instance_id, sample_index)
        stub = Rollout(id=rid, step=step, task_id=task.instance_id, group_id=group_id,
                       sample_index=sample_index, harness=self.cfg.harness.name, split=split,
                       weight_version_start=self.engine.weight_version)
        self.store.upsert_rollout(stub)  # in flight: a killed driver's resume finds it
        worker.inflight += 1
        ref = worker.actor.run.remote(task, rollout_id=rid, step=step, group_id=group_id,
                                      sample_index=sample_index, split=split, teacher=teacher)
        result = asyncio.wrap_future(ref.future())
        try:
            rollout = await asyncio.shield(result)
        except asyncio.CancelledError:  # a straggler: the worker cancels it, it cleans up and records itself
            worker.actor.cancel.remote(rid)
            try:
                rollout = await asyncio.wait_for(result, CANCEL_WAIT_S)
            except Exception as e:  # noqa: BLE001 - a worker that cannot answer: the rollout is still recorded
                rollout = self._ended(stub, Outcome.AGENT_TIMEOUT, f"{CANCELLED_REASON} ({type(e).__name__})")
            self._record(rollout)
            raise
        except ray.exceptions.RayActorError as e:  # the worker died, with the rollout's sandbox
            worker.alive = False
            console.print(f"[red]ray rollout worker {worker.index} died: {str(e).splitlines()[0]}")
            rollout = self._ended(stub, Outcome.SANDBOX_ERROR,
                                  f"the Ray rollout worker running it died: {type(e).__name__}")
        finally:
            worker.inflight -= 1
        self._record(rollout)
        return rollout

    def _alive(self) -> list[_Handle]:
        return [w for w in self.workers if w.alive]

    @contextlib.asynccontextmanager
    async def paused(self) -> Any:
        """Around a weight update: every worker's proxy holds new calls and drains in-flight ones;
        afterwards the workers carry on under the engine's new weights."""
        await asyncio.gather(*[w.actor.pause.remote() for w in self._alive()], return_exceptions=True)
        try:
            yield
        finally:
            weights = self.engine.weights()
            await asyncio.gather(*[w.actor.resume.remote(weights) for w in self._alive()], return_exceptions=True)

    @contextlib.asynccontextmanager
    async def teacher(self, sft: SFTConfig) -> AsyncIterator[RunEpisode]:
        """Inside the block, every worker holds the SFT teacher; the episodes run through the yielded
        `RunEpisode` are served by it (the policy's sessions are not touched)."""
        await make_teacher(sft, self.tokenizer).engine.close()  # a bad teacher config fails here, with its message
        await asyncio.gather(*[w.actor.open_teacher.remote(sft.model_dump()) for w in self._alive()])
        try:
            yield functools.partial(self.run_episode, teacher=True)
        finally:
            await asyncio.gather(*[w.actor.close_teacher.remote() for w in self._alive()],
                                 return_exceptions=True)

    async def close(self) -> None:
        import ray

        if self.workers:
            closing = [w.actor.close.remote() for w in self._alive()]
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), CLOSE_WAIT_S)
            for w in self.workers:
                with contextlib.suppress(Exception):
                    ray.kill(w.actor)
            self.workers = []
        if self.server is not None:
            await self.server.stop()
        if self._owns_ray:
            ray.shutdown()
