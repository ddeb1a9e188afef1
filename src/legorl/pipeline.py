"""The training loop: rollouts of a group of tasks -> advantages -> token-exact sequences -> trainer -> engine.

One driver process hosts everything (docs/design.md, "Process model"): the proxy on
loopback TCP and a Unix socket, the engine in a worker thread, the harness
workers, the store writer and the trainer, which runs between rollout phases.
With `ray.address` set, rollouts run on Ray actors instead (rollout/cluster.py);
the scheduling, the store, the trainer and the engine stay here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self, TypeVar

import torch
import transformers
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from legorl.config import Config, ConfigError
from legorl.engine import LocalEngine, ScriptedEngine
from legorl.engine.base import Engine
from legorl.models import ModelSpec, load_or_build, load_tokenizer, save_model
from legorl.models.chat_format import chat_format
from legorl.monitor.alarms import AlarmMonitor
from legorl.monitor.behaviour import output_shares
from legorl.monitor.behaviour import step_metrics as behaviour_metrics
from legorl.monitor.failures import failure_kind, failure_shares
from legorl.monitor.loggers import make_loggers
from legorl.monitor.progress import RunProgress
from legorl.monitor.server import serve_dashboard
from legorl.records import Outcome, Rollout, TrainingSequence
from legorl.rollout.builders import (
    episode_threads,
    hidden_paths,
    make_context,
    make_harnesses,
    make_proxy,
    make_remote_engine,
    make_teacher,
)
from legorl.rollout.curriculum import family, pass_counts, prioritized_sample
from legorl.rollout.demo_report import demo_report
from legorl.rollout.episode import run_episode
from legorl.rollout.outcomes import resolve_policies
from legorl.rollout.scheduler import GroupRunner, RunEpisode
from legorl.rollout.teacher import Slip, scripted_teacher
from legorl.sandbox import reap_sandboxes
from legorl.store import Store
from legorl.tasks import Task, builtin_splits
from legorl.tasks.loaders import load_tasks as load_task_spec
from legorl.train.advantages import group_advantages
from legorl.train.schedule import LRSchedule
from legorl.train.sequences import build_sequences, merge_stats
from legorl.train.trainer import Trainer

T = TypeVar("T")
console = Console(stderr=True)
transformers.utils.logging.disable_progress_bar()  # the run has its own progress display


def make_trainer(cfg: Config, policy: torch.nn.Module, pad_id: int) -> Trainer:
    """The run's trainer: its `trainer` section, the `sampling` the engine samples with, `run.steps` RL steps."""
    return Trainer(policy, cfg.trainer, sampling=cfg.sampling, total_steps=cfg.run.steps, pad_id=pad_id)


def load_tasks(cfg: Config) -> tuple[list[Task], list[Task]]:
    """(train, heldout) tasks from the configured source."""
    t = cfg.tasks
    if t.source in ("jsonl", "harbor"):
        if not t.path:
            raise ValueError(f"tasks.source is {t.source} but tasks.path is not set")
        tasks = load_task_spec(t.path)
        train = [x for x in tasks if x.split != "heldout"]
        return train, [x for x in tasks if x.split == "heldout"]
    try:  # `tasks.families` (None: all) restricts both splits
        return builtin_splits(t.n_train, t.n_heldout, t.seed, families=t.families)
    except ValueError as e:  # e.g. too few distinct instances for the splits asked of the families
        raise ConfigError(f"tasks.families {t.families or 'null (all)'}: {e}; lower tasks.n_train / "
                          f"tasks.n_heldout or add families") from None


@dataclass
class StepResult:
    step: int
    rollouts: list[Rollout]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Batch:
    """A step's finished groups, with what sampling them measured."""

    rollouts: list[Rollout]
    metrics: dict[str, float]  # groups/..., engine/... over the batch's sampling
    seconds: float  # wall time from its first rollout's start to its last group's end


def keep_started_template(tokenizer: Any, saved: Path) -> str | None:
    """A resumed run keeps the chat template it started with, saved in `saved` (a run of the built-in
    model from before `model.tools_first` wrote the tools first): set on `tokenizer` when the config's
    differs, and the line saying so returned; None when they agree or nothing was saved."""
    if not (saved / "tokenizer_config.json").exists():
        return None
    started = load_tokenizer(saved).chat_template
    if started is None or started == tokenizer.chat_template:
        return None
    tokenizer.chat_template = started
    return (f"resuming with the chat template the run started with ({saved}), not the one its config builds "
            "(model.tools_first): one run trains one token layout")


def oldest_version(r: Rollout) -> int | None:
    """The oldest weight version any of the rollout's sampled tokens came from (None: it sampled none): a call's
    `weight_version` is its first token's, and versions only advance."""
    versions = [c.weight_version for c in r.calls if c.sampled_from_policy and c.completion_ids]
    return min(versions) if versions else None


def staleness_filter(rollouts: list[Rollout], version: int, max_staleness: int,
                     families: dict[str, str]) -> tuple[list[Rollout], dict[str, float]]:
    """Asynchronous RL: the rollouts the trainer at weight `version` may train on (none of whose tokens is more
    than `max_staleness` versions old), and the staleness histogram, tokens sampled across an update and
    the share dropped per task family (dropping favours the tasks that finish fast: watch it)."""
    kept: list[Rollout] = []
    m: dict[str, float] = {"async/dropped": 0.0, "async/calls_across_update": 0.0}
    by_family: dict[str, list[bool]] = {}
    lags: list[int] = []
    for r in rollouts:
        oldest = oldest_version(r)
        lag = version - oldest if oldest is not None else 0
        lags.append(lag)
        m[f"async/staleness/{lag}"] = m.get(f"async/staleness/{lag}", 0.0) + 1
        m["async/calls_across_update"] += sum(c.token_versions is not None for c in r.calls)
        stale = lag > max_staleness and r.reward is not None
        by_family.setdefault(families.get(r.task_id, "") or "other", []).append(stale)
        if stale:
            m["async/dropped"] += 1
        else:
            kept.append(r)
    m.update({f"async/dropped_share/{f}": sum(d) / len(d) for f, d in by_family.items()})
    m["async/staleness_mean"] = sum(lags) / len(lags) if lags else 0.0  # the dashboard banner's lag
    m["async/staleness_max"] = float(max(lags, default=0))
    return kept, m


def trainable(rollouts: list[Rollout], method: str, normalize_std: bool = False) -> list[tuple[Rollout, float]]:
    """(rollout, advantage) for every rollout that trains, advantages taken within its group.

    A masked rollout (reward None) leaves the loss and the baseline. A reward-0 rollout under
    reinforce stays: it adds no gradient but counts in the loss's mean, so a step with few
    successes makes a small update (normalising by the successes alone made one lucky episode
    a full-size step, and a weak seed collapsed: BENCHMARKS.md, "The main job").
    """
    groups: dict[str, list[Rollout]] = {}
    for r in rollouts:
        groups.setdefault(r.group_id, []).append(r)
    out = []
    for members in groups.values():
        advs = group_advantages([r.reward for r in members], method=method, normalize_std=normalize_std)
        out += [(r, adv) for r, adv in zip(members, advs) if adv is not None]
    return out


class Driver:
    """Owns the long-lived parts of a run and runs its steps."""

    def __init__(self, cfg: Config, run_dir: Path, resume: bool = False):
        self.cfg = cfg
        self.resume = resume
        self.first_step = 0
        self.run_dir = run_dir.resolve()
        self.cache_dir = Path(cfg.run.cache_dir).expanduser()
        self.label = f"legorl-{self.run_dir.name}"
        self._sock_dir = Path(tempfile.mkdtemp(prefix="legorl-"))  # short path: sun_path is 108 bytes
        self._family_counts: dict[str, tuple[int, int]] | None = None  # rollout.prioritize
        # Every trainer pass runs on this one thread. glibc gives each thread its own malloc arena and keeps
        # what a step freed there for that thread: steps on the default executor's threads in turn held one
        # step's peak per thread (SmolLM2's SFT grew ~2 GB an update, to an out-of-memory kill at 24 GB).
        # torch's thread count set on a thread other than the main one holds for that thread only
        threads = cfg.trainer.torch_threads
        self._trainer_thread = ThreadPoolExecutor(
            1, thread_name_prefix="legorl-trainer",
            initializer=functools.partial(torch.set_num_threads, threads) if threads else None)

    async def __aenter__(self) -> Self:
        cfg = self.cfg
        self.train_tasks, self.heldout_tasks = load_tasks(cfg)
        self.rl_pool()  # a task pool the config leaves empty fails now, before anything starts
        ray_mode = cfg.ray.address is not None
        # With Ray, the proxies, harnesses and sandboxes live on the rollout workers (rollout/cluster.py).
        # Built first: a harness switch it cannot honour fails before anything starts.
        self.harnesses = {} if ray_mode else make_harnesses(cfg, self.run_dir / "logs")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        episode_threads(cfg.rollout.concurrency)
        await reap_sandboxes(cfg.sandbox, self.run_dir / "sandboxes", self.label)  # a killed earlier run's
        if cfg.engine.torch_threads:
            torch.set_num_threads(cfg.engine.torch_threads)
        torch.manual_seed(cfg.run.seed)
        random.seed(cfg.run.seed)
        self.store = Store(self.run_dir / "store.sqlite")
        self.store.add_run(cfg.run.name, cfg.model_dump())
        (self.run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
        planned = (["demonstrations", "sft"] if cfg.sft.enabled and cfg.sft.demos else []) + (
            ["eval_before_rl"] if cfg.eval.before_training else []) + ["rl"] + (
            ["eval_after_rl"] if cfg.eval.after_training else [])
        self.progress = RunProgress(self.run_dir, cfg.run.steps, planned, cfg.rollout.mode)  # for the dashboard

        policy, self.tokenizer = await asyncio.to_thread(load_or_build, cfg.model.path,
                                                         ModelSpec.from_config(cfg.model),
                                                         self.cache_dir)
        if self.resume and (note := keep_started_template(self.tokenizer, self.run_dir / "tokenizer")):
            console.print(f"[yellow]{note}")
        self.tokenizer.save_pretrained(self.run_dir / "tokenizer")  # `legorl report` decodes with it
        self.vllm_server = None  # engine.serve: the vLLM server this run started
        self.engine = await self._make_engine(policy)  # the policy (chaos mode wraps it per rollout: run_episode)
        self.trainer = make_trainer(cfg, policy, pad_id=self.tokenizer.pad_token_id or 0)
        self.proxy, self.ctx, self.cluster = None, None, None
        if not ray_mode:
            self.proxy = make_proxy(cfg, self.engine, self.tokenizer, on_call=self.store.add_call)
            await self.proxy.start(cfg.proxy.host, cfg.proxy.port, unix_socket=self._sock_dir / "proxy.sock")
        m = cfg.monitor
        self.loggers = make_loggers(m.loggers, self.run_dir, cfg.model_dump())
        self.alarms = AlarmMonitor(m.alarms, self.run_dir, advantage=cfg.trainer.advantage)
        self.stop_dashboard = None
        if m.dashboard:
            url, self.stop_dashboard = await serve_dashboard(self.run_dir, m.host, m.port, m.token, m.alarms)
            console.print(f"dashboard: [bold]{url}[/]")
        for harness in self.harnesses.values():
            await harness.start()
        if self.resume:
            await self._restore()
        hide = hidden_paths(cfg, self.run_dir, self.cache_dir)
        r = cfg.rollout
        if ray_mode:
            from legorl.rollout.cluster import RayCluster

            policies = resolve_policies(r.policies)
            self.cluster = RayCluster(cfg, run_dir=self.run_dir, label=self.label, hide_paths=hide,
                                      tokenizer=self.tokenizer, store=self.store, engine=self.engine,
                                      policies=policies)
            await self.cluster.start()
            self.runner = GroupRunner(self.cluster.run_episode, policies, r)
        else:
            self.ctx = make_context(cfg, proxy=self.proxy, engine=self.engine, harness=self.harnesses,
                                    store=self.store, run_dir=self.run_dir, label=self.label, hide_paths=hide)
            self.runner = GroupRunner.local(self.ctx, r)
        return self

    async def _make_engine(self, policy: torch.nn.Module) -> Engine:
        e = self.cfg.engine
        if e.kind == "scripted":
            return ScriptedEngine(self.tokenizer)
        if e.serve:
            return await self._serve_vllm(policy)
        if e.kind in ("vllm", "sglang"):
            return make_remote_engine(self.cfg, self.tokenizer)
        model, _ = await asyncio.to_thread(load_or_build, self.cfg.model.path,
                                             ModelSpec.from_config(self.cfg.model), self.cache_dir)
        return LocalEngine(model, self.tokenizer, e)

    async def _serve_vllm(self, policy: torch.nn.Module) -> Engine:
        """engine.serve: a vLLM server for the run's initial policy (saved to RUN_DIR/engine/initial), which
        reloads every update from RUN_DIR/engine/weights (or engine.checkpoint_dir); stopped in __aexit__."""
        from legorl.engine.vllm_server import VLLMServerConfig, start

        base = self.run_dir / "engine" / "initial"
        await asyncio.to_thread(save_model, policy, self.tokenizer, base)
        e = self.cfg.engine
        server_cfg = VLLMServerConfig(model=base, port=0, device=e.serve_device, enforce_eager=e.serve_eager,
                                      max_model_len=int(policy.config.max_position_embeddings))
        log = self.run_dir / "logs" / "vllm-server.log"
        self.vllm_server = start(server_cfg, log, die_with_parent=True)  # from the main thread (prctl's parent)
        console.print(f"starting vLLM for the policy (log {log})")
        waited = await asyncio.to_thread(self.vllm_server.wait_ready, 900.0)
        console.print(f"vLLM ready at {self.vllm_server.url} after {waited:.0f} s")
        return make_remote_engine(self.cfg, self.tokenizer, urls=[self.vllm_server.url], base_model_dir=base,
                                  checkpoint_dir=e.checkpoint_dir or self.run_dir / "engine" / "weights")

    @functools.cached_property
    def reasoning_markers(self) -> tuple[str, str] | None:
        """The policy's reasoning markers (model.reasoning, else its chat format's), as the proxy splits them."""
        return chat_format(self.tokenizer).with_reasoning(self.cfg.model.reasoning).reasoning

    def engine_stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        ckpts = sorted((self.run_dir / "checkpoints").glob("step-*"))
        ckpts = [c for c in ckpts if (c / "trainer_state.pt").is_file()]
        return (int(ckpts[-1].name.split("-")[1]), ckpts[-1]) if ckpts else None

    async def _restore(self) -> None:
        """Continue a killed run: weights, optimiser and RNG from the last checkpoint, steps from the store."""
        found = self.latest_checkpoint()
        last = found[0] if found else -1
        sft = self.run_dir / "checkpoints" / "sft"
        if found is None and (sft / "trainer_state.pt").is_file():
            found = (-1, sft)  # killed after the warm start, before the first RL checkpoint
        if found:
            # A KL set only now (run extended with trainer.kl_coef) anchors to the warm start, as in a fresh run.
            warm = sft if (sft / "trainer_state.pt").is_file() else None
            await self.on_trainer_thread(self.trainer.load, found[1], warm)
            version = self.store.step_metrics(last).get("weight_version")  # keeps version stamps continuous
            await self.engine.update_weights(self.trainer.state_dict_for_engine(),
                                             int(version) if version is not None else None)
        changes = self.store.prepare_resume(last)
        self.first_step = last + 1
        console.print(f"resuming after step {last}: {changes}")

    async def on_trainer_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the trainer's own thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._trainer_thread,
                                                                functools.partial(fn, *args, **kwargs))

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No call straddles a weight update: new calls wait and in-flight ones drain, in this process's
        proxy or, with Ray, in every worker's (which then stamp the engine's new version on their calls)."""
        async with self.cluster.paused() if self.cluster is not None else self.proxy.paused():
            yield

    async def __aexit__(self, *exc: object) -> None:
        self.loggers.close()
        parts = [self.cluster, *self.harnesses.values()]  # the cluster with Ray, the harnesses without
        closers = [p.close for p in parts if p is not None]
        closers += [self.proxy.stop] if self.proxy is not None else []
        closers.append(self.engine.close)
        if self.vllm_server is not None:
            closers.append(functools.partial(asyncio.to_thread, self.vllm_server.stop))
        if self.stop_dashboard is not None:
            closers.append(self.stop_dashboard)
        for closer in closers:
            try:
                await closer()
            except Exception as e:  # noqa: BLE001 - keep closing the rest
                console.print(f"[yellow]while shutting down: {type(e).__name__}: {e}")
        await reap_sandboxes(self.cfg.sandbox, self.run_dir / "sandboxes", self.label)
        shutil.rmtree(self._sock_dir, ignore_errors=True)
        self._trainer_thread.shutdown(wait=False)

    # ---- one step -------------------------------------------------------------------------------
    def tasks_for_step(self, step: int) -> list[Task]:
        """The step's task pool: the groups to train on, then over-sampling and refill candidates."""
        r = self.cfg.rollout
        rng = random.Random(self.cfg.run.seed * 100_003 + step)
        pool = self.rl_pool()
        k = min(r.tasks_per_step + r.oversample_groups + r.zero_variance_refills, len(pool))
        if not r.prioritize:
            return rng.sample(pool, k)
        return prioritized_sample(pool, k, self.family_counts(), r.group_size, self.cfg.trainer.advantage, rng)

    def family_counts(self, finished: Iterable[Rollout] = ()) -> dict[str, tuple[int, int]]:
        """Train pass counts per family (rollout.prioritize), plus `finished`'s.

        Read from the store once per process, so a resumed run weighs families as the interrupted
        one did; then kept up to date from each step's finished rollouts.
        """
        tasks = {t.instance_id: t for t in self.rl_pool()}
        if self._family_counts is None:
            self._family_counts = pass_counts(self.store.rollouts(split="train"), tasks)
        else:
            self._family_counts = pass_counts(finished, tasks, into=self._family_counts)
        return self._family_counts

    def rl_pool(self) -> list[Task]:
        """The train tasks RL samples from (`rollout.task_pool`)."""
        if self.cfg.rollout.task_pool == "all" or not self.cfg.sft.enabled:
            return self.train_tasks
        pool = self.train_tasks[self.cfg.sft.demos:]  # collect_demos takes the first sft.demos
        if not pool:
            raise ConfigError(f"rollout.task_pool is undemonstrated but sft.demos ({self.cfg.sft.demos}) covers all "
                             f"{len(self.train_tasks)} train tasks: raise tasks.n_train or lower sft.demos")
        return pool

    def _progress(self, label: str, total: int, shown: bool = True) -> tuple[Progress, Any]:
        """A transient progress bar on a terminal (`shown` False: none; one live display at a time)."""
        progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console, transient=True, disable=not (shown and console.is_terminal))
        return progress, progress.add_task(label, total=total)

    def several_harnesses(self) -> list[str] | None:
        """harness.name's list when it names more than one harness, else None (the one harness)."""
        names = self.cfg.harness.names
        return names if len(names) > 1 else None

    async def rollouts(self, tasks: list[Task], step: int, samples: int, split: str,
                       harnesses: list[str | None] | None = None, runner: GroupRunner | None = None) -> list[Rollout]:
        """Every sample of every task, to completion (evaluation and demonstrations); task i through
        harnesses[i] (default: the run's first harness); `runner`: the teacher's (default: the policy's)."""
        progress, bar = self._progress(f"step {step} {split} rollouts", len(tasks) * samples)
        self.progress.expect(len(tasks) * samples)

        def on_rollout(_: Rollout) -> None:
            progress.advance(bar)
            self.progress.tick()

        with progress:
            groups, stats = await (runner or self.runner).all_groups(tasks, step, samples, split,
                                                                     on_rollout=on_rollout, harnesses=harnesses)
        for err in stats.errors:
            console.print(f"[red]rollout failed unexpectedly: {err}")
        return [r for g in groups for r in g]

    async def train_rollouts(self, step: int) -> tuple[list[Rollout], dict[str, float]]:
        r = self.cfg.rollout
        progress, bar = self._progress(f"step {step} rollouts", (r.tasks_per_step + r.oversample_groups)
                                       * r.group_size, shown=r.mode == "sync")  # async: batches overlap
        finished: list[Rollout] = []  # also the refilled groups': every graded sample tells a pass rate

        def on_rollout(x: Rollout) -> None:
            finished.append(x)
            progress.advance(bar)

        with progress:
            groups, stats = await self.runner.train_groups(
                self.tasks_for_step(step), r.tasks_per_step, step, r.group_size, oversample=r.oversample_groups,
                refills=r.zero_variance_refills, advantage=self.cfg.trainer.advantage, on_rollout=on_rollout,
                harnesses=self.several_harnesses())
        if r.prioritize:
            self.family_counts(finished)
        for err in stats.errors:
            console.print(f"[red]rollout failed unexpectedly: {err}")
        return [x for g in groups for x in g], stats.metrics()

    def sequences(self, rollouts: list[Rollout]
                  ) -> tuple[list[TrainingSequence], dict[str, float], list[tuple[str, int, float]]]:
        """Token-exact sequences of the trainable rollouts, merge stats, and what was trained (for tracing)."""
        seqs: list[TrainingSequence] = []
        all_calls = []
        trained: list[tuple[str, int, float]] = []
        t = self.cfg.trainer
        for r, adv in trainable(rollouts, t.advantage, t.normalize_std):
            calls = r.calls + r.side_calls if self.cfg.rollout.train_side_calls else r.calls
            built = build_sequences(r.id, calls, adv)
            seqs.extend(built)
            all_calls.extend(calls)
            if built:
                trained.append((r.id, len(built), adv))
        stats = merge_stats(all_calls, seqs) if seqs else {}
        return seqs, {f"seq/{k}": float(v) for k, v in stats.items()}, trained

    async def batch(self, step: int) -> Batch:
        """Sample step `step`'s groups to completion."""
        t0 = time.time()
        engine_before = self.engine_stats()
        rollouts, group_metrics = await self.train_rollouts(step)
        seconds = time.time() - t0
        return Batch(rollouts, group_metrics | engine_delta(engine_before, self.engine_stats(), seconds), seconds)

    async def step(self, step: int, batch: Awaitable[Batch] | None = None) -> StepResult:
        """Train on step `step`'s batch (sampled now, or `batch`: already being sampled, asynchronous RL), then
        update the engine."""
        t0, cpu0 = time.time(), machine_cpu_ticks()
        b = await (batch if batch is not None else self.batch(step))
        t_wait = time.time() - t0  # synchronous: the whole rollout phase; asynchronous: the trainer's idle wait
        rollouts, async_metrics = b.rollouts, {}
        asynchronous = self.cfg.rollout.mode == "async"
        if asynchronous:
            families = {t.instance_id: family(t) for t in self.train_tasks}
            rollouts, async_metrics = staleness_filter(b.rollouts, self.engine.weight_version,
                                                       self.cfg.rollout.max_staleness, families)
        seqs, seq_metrics, trained = self.sequences(rollouts)
        t1 = time.time()
        train_metrics = await self.on_trainer_thread(self.trainer.train_step, seqs) if seqs else {"train/skipped": 1.0}
        t_train = time.time() - t1
        t2 = time.time()
        state = self.trainer.state_dict_for_engine()
        if asynchronous and self.cluster is None:
            # the next steps' generations carry on across it, each token stamped with its version (an engine
            # that cannot tell which tokens came before a reload drains instead: remote servers)
            version = await self.engine.update_weights(state, in_flight=True)
        else:  # no call straddles the update; with Ray, the workers' proxies drain for the reload only
            async with self.paused():
                version = await self.engine.update_weights(state)
        t_sync = time.time() - t2
        metrics = rollout_metrics(b.rollouts)
        metrics.update(b.metrics)
        metrics.update(async_metrics)
        metrics.update(seq_metrics)
        metrics.update(behaviour_metrics(b.rollouts))
        metrics.update(per_harness_metrics(b.rollouts, self.several_harnesses()))
        metrics.update(train_metrics)
        metrics.update({"time/rollout_s": b.seconds, "time/wait_s": t_wait, "time/train_s": t_train,
                        "time/sync_s": t_sync, "time/step_s": time.time() - t0, "weight_version": float(version)})
        metrics.update(machine_busy_share(cpu0, machine_cpu_ticks()))
        if self.cfg.run.checkpoint_every and (step + 1) % self.cfg.run.checkpoint_every == 0:
            await self.on_trainer_thread(self.save_checkpoint, f"step-{step:05d}")
        metrics.update(self.alarms.metrics(self.alarms.update(step, metrics, rollouts)))
        self.store.add_trained(step, trained)
        self.store.add_step(step, metrics)  # after the checkpoint: a recorded step is never redone
        self.loggers.log(step, metrics)
        return StepResult(step, b.rollouts, metrics)

    def save_checkpoint(self, name: str) -> Path:
        """``checkpoints/NAME`` (``step-NNNNN``, or ``sft`` for the warm start): weights, optimiser and
        RNG to resume from, and the tokenizer, so any checkpoint is a model directory for
        `legorl eval --model`; ``latest`` always holds the newest weights."""
        path = self.run_dir / "checkpoints" / name
        self.trainer.save(path)
        self.tokenizer.save_pretrained(path)
        save_model(self.trainer.model, self.tokenizer, self.run_dir / "checkpoints" / "latest")
        return path

    # ---- teacher demonstrations and SFT ----------------------------------------------------------
    async def collect_demos(self, n: int) -> list[Rollout]:
        """Run the real harness with a teacher: the gold fix played by the scripted engine, or an upstream model.
        With several harnesses, the demonstrations take them in turn."""
        tasks = [self.train_tasks[i % len(self.train_tasks)] for i in range(n)]
        names = self.several_harnesses()
        harnesses = [names[i % len(names)] for i in range(n)] if names else None
        async with self.teacher() as run:
            runner = GroupRunner(run, self.runner.policies, self.cfg.rollout)
            return await self.rollouts(tasks, step=-1, samples=1, split="demo", harnesses=harnesses, runner=runner)

    @contextlib.asynccontextmanager
    async def teacher(self) -> AsyncIterator[RunEpisode]:
        """Episodes whose sessions the SFT teacher serves (in this process, or on the Ray workers), while the
        policy engine stays as it is: nothing is swapped, so policy episodes could run beside them."""
        if self.cluster is not None:
            async with self.cluster.teacher(self.cfg.sft) as run:
                yield run
            return
        teacher = make_teacher(self.cfg.sft, self.tokenizer)
        try:
            yield functools.partial(run_episode, replace(self.ctx, engine_for=teacher.engine_for))
        finally:
            await teacher.engine.close()

    def teacher_slips(self, demos: list[Rollout]) -> dict[str, set[int]]:
        """Per demonstration, the calls where the scripted teacher slipped on purpose (not trained on)."""
        c = self.cfg.sft
        if not c.recovery_demos:  # only the scripted teacher slips (the config refuses it for others)
            return {}
        script = scripted_teacher(c.check_edits, c.recovery_demos)
        tasks = {t.instance_id: t for t in self.train_tasks}
        return {r.id: {i for i, turn in enumerate(script(tasks[r.task_id])) if isinstance(turn, Slip)}
                for r in demos if r.task_id in tasks}

    async def sft(self, demos: list[Rollout]) -> dict[str, float]:
        """Supervised warm start on the resolved demonstrations, then sync the engine."""
        c = self.cfg.sft
        slips = self.teacher_slips(demos)
        seqs = [q for r in demos if r.outcome == Outcome.RESOLVED
                for q in build_sequences(r.id, r.calls, 1.0, include_unsampled=True, untrained=slips.get(r.id, ()))]
        if not seqs:
            raise RuntimeError("no resolved teacher demonstration to learn from "
                               f"({demo_report(demos, scripted=c.teacher == 'scripted')})")
        # A fractional epoch ends part-way through a shuffled pass; any positive epochs make an update.
        batches_per_epoch = -(-len(seqs) // c.batch_sequences)
        total = max(1, round(c.epochs * batches_per_epoch))
        schedule = LRSchedule(c.lr_schedule, 0, total)
        rng = random.Random(self.cfg.run.seed)

        def batches() -> Iterator[list[TrainingSequence]]:
            while True:
                rng.shuffle(seqs)
                for i in range(0, len(seqs), c.batch_sequences):
                    yield seqs[i:i + c.batch_sequences]

        losses: list[float] = []
        lr = c.lr
        with Progress(TextColumn("SFT"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[loss]}"), console=console, transient=True,
                      disable=not console.is_terminal) as progress:
            bar = progress.add_task("sft", total=total, loss="")
            self.progress.expect(total)
            for batch in itertools.islice(batches(), total):
                lr = c.lr * schedule.factor(len(losses))
                for group in self.trainer.optimizer.param_groups:
                    group["lr"] = lr
                m = await self.on_trainer_thread(self.trainer.sft_step, batch, max_grad_norm=c.max_grad_norm)
                losses.append(m["sft/loss"])
                progress.update(bar, advance=1, loss=f"loss {m['sft/loss']:.3f}")
                self.progress.tick()
        for group in self.trainer.optimizer.param_groups:
            group["lr"] = self.cfg.trainer.lr
        # RL gets a fresh first moment. Keeping the second one makes an RL update's size follow its
        # gradient's: fresh Adam moves every weight by ~lr on its first steps however little signal
        # the step had, and those sign-like steps of noise wore away what SFT taught.
        for state in self.trainer.optimizer.state.values():
            if c.keep_second_moments:
                state["exp_avg"].zero_()
            else:
                state.clear()
        self.trainer.reset_reference()  # trainer.kl_coef: KL to the SFT policy, not the untrained one
        async with self.paused():
            await self.engine.update_weights(self.trainer.state_dict_for_engine())
        return {"sft/sequences": float(len(seqs)), "sft/updates": float(total), "sft/first_loss": losses[0],
                "sft/last_loss": losses[-1], "sft/last_lr": lr,
                "sft/demos_resolved": float(sum(r.outcome == Outcome.RESOLVED for r in demos)),
                "sft/slips": float(sum(len(slips.get(r.id, ())) for r in demos if r.outcome == Outcome.RESOLVED))}

    # ---- evaluation -------------------------------------------------------------------------------
    async def evaluate(self, step: int, tasks: list[Task] | None = None, samples: int | None = None,
                       split: str | None = None) -> dict[str, float]:
        """pass@1 (mean resolved rate) and pass@k (any of k samples resolved) on a split, through each
        harness: `eval/SPLIT/HARNESS/...` with its behaviour and why rollouts failed (monitor/failures.py),
        and `eval/SPLIT/...` over all of them."""
        split = split or self.cfg.eval.split
        tasks = tasks if tasks is not None else (self.heldout_tasks if split == "heldout" else self.train_tasks)
        k = samples or self.cfg.eval.samples
        names = self.cfg.harness.names
        # Each task through every harness in turn: in harness blocks, one CLI's episodes would fill every slot
        # at once (54 OpenCode starts on 2 cores timed out where a mix of harnesses did not).
        pairs = [(task, name) for task in tasks for name in names]
        rollouts = await self.rollouts([t for t, _ in pairs], step, k, f"eval-{split}",
                                       harnesses=[n for _, n in pairs] if len(names) > 1 else None)
        by_harness = {name: [r for r in rollouts if r.harness == name] for name in names}
        by_id = {t.instance_id: t for t in tasks}
        kind = {r.id: failure_kind(r, by_id.get(r.task_id)) for r in rollouts}  # each rollout analysed once
        m = eval_metrics(rollouts, k, prefix=f"eval/{split}/") | failure_shares(kind.values(), f"eval/{split}/")
        reasoning = self.reasoning_markers
        for name, rs in by_harness.items():
            m.update(eval_metrics(rs, k, prefix=f"eval/{split}/{name}/"))
            m.update(failure_shares((kind[r.id] for r in rs), f"eval/{split}/{name}/"))
            m.update({f"eval/{split}/{name}/{key}": v for key, v in behaviour_metrics(rs).items()})
            shares = output_shares(rs, reasoning, self.tokenizer.decode)
            m.update({f"eval/{split}/{name}/behaviour/{key}": v for key, v in shares.items()})
        # the fixed cohort (this split's tasks): how much of it the evaluation covered with a graded rollout
        graded = {r.task_id for r in rollouts if r.reward is not None}
        m[f"eval/{split}/cohort_coverage"] = len(graded & set(by_id)) / len(by_id) if by_id else 0.0
        for key in ("pass_at_1", f"pass_at_{k}"):  # each harness weighs the same
            m[f"eval/{split}/{key}"] = sum(m[f"eval/{split}/{name}/{key}"] for name in names) / len(names)
        return m

    async def train(self) -> list[StepResult]:
        """The RL steps. Asynchronous (`rollout.mode: async`): steps up to `max_staleness` ahead are being
        sampled while a step trains, so a step's groups start at most that many updates before it trains
        on them; synchronous: each step samples its own, then trains."""
        results = []
        every, last = self.cfg.eval.every, self.cfg.run.steps
        ahead = self.cfg.rollout.max_staleness if self.cfg.rollout.mode == "async" else 0
        pending: dict[int, asyncio.Task[Batch]] = {}
        try:
            for step in range(self.first_step, last):
                for s in range(step, min(step + ahead + 1, last)):
                    if s not in pending:
                        pending[s] = asyncio.create_task(self.batch(s))
                self.progress.at_step(step)
                r = await self.step(step, pending.pop(step))
                if self.cfg.rollout.mode == "async":
                    self.progress.lag(r.metrics, ahead)
                if every and (step + 1) % every == 0 and step + 1 < last:
                    # no update comes while it runs (updates come from this loop), so every eval
                    # call sees one version, whatever the batches being sampled beside it
                    evaluation = await self.evaluate(step)
                    r.metrics.update(evaluation)
                    self.store.add_step(step, r.metrics)
                    self.loggers.log(step + 1, evaluation)  # at the count of RL updates it measured
                console.print(step_line(r), markup=False)  # "[resolved=3]" is not a style tag
                results.append(r)
        finally:
            for t in pending.values():  # an interrupted run: its rollouts clean up and record themselves
                t.cancel()
            await asyncio.gather(*pending.values(), return_exceptions=True)
        return results

    async def run(self) -> dict[str, Any]:
        """The whole job: teacher demos -> SFT -> eval -> RL -> eval; keeps summary.json up to date."""
        t0 = time.time()
        path = self.run_dir / "summary.json"
        summary: dict[str, Any] = {"run_dir": str(self.run_dir)}
        if self.resume and path.is_file():
            summary = json.loads(path.read_text())
            summary.pop("after_rl", None)

        def save() -> None:
            path.write_text(json.dumps(summary, indent=2))

        phase_times: dict[str, float] = summary.setdefault("phase_times_s", {})  # added to when resumed

        @contextlib.contextmanager
        def phase(name: str) -> Iterator[None]:
            t = time.time()
            self.progress.enter(name, phase_times)
            yield
            phase_times[name] = phase_times.get(name, 0.0) + time.time() - t

        if self.cfg.sft.enabled and self.cfg.sft.demos and "sft" not in summary:
            with phase("demonstrations"):
                demos = await self.collect_demos(self.cfg.sft.demos)
            console.print(demo_report(demos, scripted=self.cfg.sft.teacher == "scripted"))
            with phase("sft"):
                summary["sft"] = await self.sft(demos)
                await self.on_trainer_thread(self.save_checkpoint, "sft")
            save()
            console.print(f"SFT on {int(summary['sft']['sft/sequences'])} demonstration sequences: "
                          f"loss {summary['sft']['sft/first_loss']:.3f} -> {summary['sft']['sft/last_loss']:.3f}")
        if self.cfg.eval.before_training and "before_rl" not in summary:
            with phase("eval_before_rl"):
                summary["before_rl"] = await self.evaluate(step=-1)
            self.loggers.log(0, summary["before_rl"])  # evaluations go to the loggers at the RL updates done
            save()
            console.print(eval_line("before RL", summary["before_rl"]), markup=False)
        with phase("rl"):
            await self.train()
        if self.cfg.eval.after_training:
            with phase("eval_after_rl"):
                summary["after_rl"] = await self.evaluate(step=self.cfg.run.steps)
            self.loggers.log(self.cfg.run.steps, summary["after_rl"])
            console.print(eval_line("after RL", summary["after_rl"]), markup=False)
        key = f"eval/{self.cfg.eval.split}/pass_at_1"
        summary.update({
            f"{self.cfg.eval.split}_pass_at_1_before_rl": summary.get("before_rl", {}).get(key),
            f"{self.cfg.eval.split}_pass_at_1_after_rl": summary.get("after_rl", {}).get(key),
            "steps": len(self.store.step_numbers()),
            "wall_time_s": summary.get("wall_time_s", 0.0) + time.time() - t0,
            "per_harness": per_harness(summary, self.cfg.eval.split, self.cfg.harness.names),
        })
        save()
        self.progress.finish(phase_times)
        return summary


def per_harness_metrics(rollouts: list[Rollout], names: list[str] | None) -> dict[str, float]:
    """With several harnesses, each one's pass rate and behaviour in a step (`behaviour/by_harness/NAME/...`:
    the dashboard's behaviour charts split by harness)."""
    m: dict[str, float] = {}
    for name in names or []:
        mine = [r for r in rollouts if r.harness == name]
        if mine:
            m[f"pass_rate/{name}"] = sum(r.outcome == Outcome.RESOLVED for r in mine) / len(mine)
        m.update({f"behaviour/by_harness/{name}/{k.removeprefix('behaviour/')}": v
                  for k, v in behaviour_metrics(mine).items()})
    return m


def per_harness(summary: dict[str, Any], split: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each harness's held-out pass@1 and behaviour (turns, verification after edit, text-only turns...)
    before and after RL, from the evaluations in `summary`."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        prefix = f"eval/{split}/{name}/"
        row: dict[str, Any] = {}
        for when in ("before_rl", "after_rl"):
            m = summary.get(when, {})
            row[f"pass_at_1_{when}"] = m.get(prefix + "pass_at_1")
            row[f"behaviour_{when}"] = {k.removeprefix(prefix + "behaviour/"): v for k, v in m.items()
                                        if k.startswith(prefix + "behaviour/")}
        out[name] = row
    return out


def eval_metrics(rollouts: list[Rollout], k: int, prefix: str) -> dict[str, float]:
    by_task: dict[str, list[Rollout]] = {}
    for r in rollouts:
        by_task.setdefault(r.task_id, []).append(r)
    solved = [sum(r.outcome == Outcome.RESOLVED for r in rs) for rs in by_task.values()]
    n = max(len(by_task), 1)
    m = {f"{prefix}pass_at_1": sum(s / max(len(rs), 1) for s, rs in zip(solved, by_task.values())) / n,
         f"{prefix}pass_at_{k}": sum(s > 0 for s in solved) / n, f"{prefix}tasks": float(len(by_task))}
    for o, count in Counter(r.outcome.value for r in rollouts if r.outcome).items():
        m[f"{prefix}outcomes/{o}"] = float(count)
    return m


def eval_line(name: str, m: dict[str, float]) -> str:
    """`before RL: pass@1 0.312  [resolved=..]`, and each harness's pass@1 when there are several."""
    split_keys = {k: v for k, v in m.items() if k.count("/") == 2}  # eval/SPLIT/pass_at_1, not eval/SPLIT/HARNESS/..
    p1 = next((v for k, v in split_keys.items() if k.endswith("pass_at_1")), 0.0)
    outcomes = ", ".join(f"{k.rsplit('/', 1)[1]}={int(v)}" for k, v in m.items()
                         if k.count("/") == 3 and "/outcomes/" in k)
    harnesses = {k.split("/")[2]: v for k, v in m.items() if k.count("/") == 3 and k.endswith("/pass_at_1")}
    each = "  " + ", ".join(f"{h} {v:.3f}" for h, v in harnesses.items()) if len(harnesses) > 1 else ""
    return f"{name}: pass@1 {p1:.3f}  [{outcomes}]{each}"


def machine_cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) CPU ticks of the whole machine so far, all cores, from /proc/stat (Linux; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    except (OSError, ValueError):
        return None
    total = user + nice + system + idle + iowait + irq + softirq + steal
    return total - idle - iowait, total


def machine_busy_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> dict[str, float]:
    """The machine's CPU busy share between two `machine_cpu_ticks` readings: a step at ~1.0 is bound by the
    cores themselves (overlapping rollouts and training cannot make it faster, only less work can)."""
    if before is None or after is None or after[1] <= before[1]:
        return {}
    return {"time/machine_busy_share": (after[0] - before[0]) / (after[1] - before[1])}


def engine_delta(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, float]:
    """Engine throughput and idle share over one rollout phase (where the step's time goes)."""
    if not after:
        return {}

    def d(key: str) -> float:
        return float(after.get(key, 0) or 0) - float(before.get(key, 0) or 0)

    prompt, busy, steps = d("prompt_tokens"), d("busy_s"), d("decode_steps")
    return {
        "engine/generated_tokens_per_s": d("generated_tokens") / seconds if seconds > 0 else 0.0,
        "engine/busy_share": min(1.0, busy / seconds) if seconds > 0 else 0.0,
        # Of the engine thread's busy time: its CPU, and its wait for a core; the rest: OpenMP barriers, the GIL.
        "engine/busy_cpu_share": min(1.0, d("busy_cpu_s") / busy) if busy > 0 else 0.0,
        "engine/busy_runqueue_share": min(1.0, d("busy_runqueue_s") / busy) if busy > 0 else 0.0,
        "engine/rows_per_step": d("step_rows") / steps if steps else 0.0,
        "engine/prefill_reuse": d("prefill_tokens_reused") / prompt if prompt else 0.0,
    }


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    counts = Counter(r.outcome.value for r in rollouts if r.outcome is not None)
    trained = [r.reward for r in rollouts if r.reward is not None]
    m: dict[str, float] = {f"outcomes/{o.value}": float(counts.get(o.value, 0)) for o in Outcome}
    m["rollouts/count"] = float(len(rollouts))
    m["rollouts/trained"] = float(len(trained))
    m["reward/mean"] = sum(trained) / len(trained) if trained else 0.0
    m["pass_rate"] = counts.get("resolved", 0) / len(rollouts) if rollouts else 0.0
    turns = [len(r.calls) for r in rollouts]
    m["rollouts/turns_mean"] = sum(turns) / len(turns) if turns else 0.0
    lens = [len(c.completion_ids) for r in rollouts for c in r.calls]
    m["rollouts/completion_tokens_mean"] = sum(lens) / len(lens) if lens else 0.0
    # tokens per step (the dashboard's token panel; trained ones: train/loss_tokens)
    m["tokens/prompt"] = float(sum(len(c.prompt_ids) for r in rollouts for c in r.calls))
    m["tokens/sampled"] = float(sum(len(c.completion_ids) for r in rollouts for c in r.calls if c.sampled_from_policy))
    m["tokens/masked"] = float(sum(len(c.completion_ids) for r in rollouts if r.reward is None for c in r.calls
                                   if c.sampled_from_policy))
    return m


def step_line(r: StepResult) -> str:
    m = r.metrics
    outcomes = ", ".join(f"{k.split('/')[1]}={int(v)}" for k, v in m.items() if k.startswith("outcomes/") and v)
    head = f"step {r.step}: reward {m.get('reward/mean', 0):.2f}  pass {m.get('pass_rate', 0):.2f}  [{outcomes}]"
    if m.get("train/skipped"):
        return f"{head}  nothing to train (no rollout left a trainable sequence)  {m.get('time/step_s', 0):.0f}s"
    return (f"{head}  loss {m.get('train/loss', 0.0):.4f}  pearson {m.get('train/logprob_pearson', 0.0):.3f}  "
            f"{m.get('time/step_s', 0):.0f}s")


async def run_job(cfg: Config, run_dir: Path, resume: bool = False) -> dict[str, Any]:
    async with Driver(cfg, run_dir, resume=resume) as driver:
        return await driver.run()
