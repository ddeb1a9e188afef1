"""The parts a rollout needs, built from the config: one place for the driver and the Ray workers.

The embedded driver builds one harness, proxy and EpisodeContext; each Ray rollout worker
(rollout/cluster.py) builds its own with the same functions, so both paths run the same
episodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.config import Config, ConfigError, HarnessConfig, SFTConfig
from legorl.engine.base import Engine
from legorl.harness.base import Harness
from legorl.proxy.server import Proxy
from legorl.records import LLMCall
from legorl.rollout.episode import EngineFor, EpisodeContext, always, scripted
from legorl.rollout.outcomes import resolve_policies
from legorl.sandbox.limits import SandboxLimits
from legorl.store import Store


def make_harnesses(cfg: Config, log_dir: Path) -> dict[str, Harness]:
    """Every configured harness by name (one, or each of harness.name's list), in the config's order."""
    return {name: make_harness(cfg, log_dir, cfg.harness.for_harness(name)) for name in cfg.harness.names}


def episode_threads(concurrency: int) -> None:
    """Size the running loop's default executor for `concurrency` episodes at once. An in-sandbox harness holds
    one of its threads for its whole episode (the sandbox's exec is a blocking call), beside grading and file
    writes; Python's default, min(32, cores + 4), is 6 threads on 2 cores, which ran 6 episodes at a time
    whatever `rollout.concurrency` asked for."""
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(2 * concurrency + 8, thread_name_prefix="legorl-episode"))


def make_harness(cfg: Config, log_dir: Path, h: HarnessConfig | None = None) -> Harness:
    """A harness (the configured one, or `h`): mini-swe-agent (Python API in a worker), or a CLI in the sandbox."""
    from legorl.harness.claude_code import ClaudeCodeHarness
    from legorl.harness.codex import CodexHarness
    from legorl.harness.command import CommandHarness
    from legorl.harness.gemini_cli import GeminiCliHarness
    from legorl.harness.mini_swe_agent import MiniSweAgentHarness
    from legorl.harness.opencode import OpenCodeHarness
    from legorl.harness.openhands import OpenHandsHarness
    from legorl.harness.qwen_code import QwenCodeHarness

    h = h or cfg.harness
    kw: dict[str, Any] = {"instance_template": h.instance_template} if h.instance_template else {}
    if h.name in ("claude-code", "codex", "opencode", "openhands", "gemini-cli", "qwen-code"):
        kw.update(system_prompt=h.system_prompt, append_system_prompt=h.append_system_prompt, tools=h.tools,
                  extra_args=list(h.extra_args), timeout=cfg.rollout.agent_timeout)
    try:
        if h.name == "claude-code":
            return ClaudeCodeHarness(max_turns=h.step_limit, **kw)
        if h.name == "codex":
            return CodexHarness(max_calls=h.step_limit, config=dict(h.codex_config), **kw)
        if h.name == "openhands":
            return OpenHandsHarness(max_calls=h.step_limit, prefork=h.prefork, tool_params=dict(h.tool_params), **kw)
        if h.name == "opencode":
            return OpenCodeHarness(max_calls=h.step_limit, config=dict(h.opencode_config), wire_format=h.wire_format,
                                   **kw)
        if h.name == "gemini-cli":
            return GeminiCliHarness(max_calls=h.step_limit, settings=dict(h.settings), **kw)
        if h.name == "qwen-code":
            return QwenCodeHarness(max_calls=h.step_limit, settings=dict(h.settings), **kw)
        if h.name == "command":
            return CommandHarness(command=h.command or "", shell_tool=h.shell_tool, shell_arg=h.shell_arg,
                                  shell_submit=h.shell_submit, side_calls=h.side_calls,
                                  limit_exit_codes=tuple(h.limit_exit_codes), env=dict(h.env),
                                  visible_paths=tuple(h.visible_paths), max_calls=h.step_limit,
                                  timeout=cfg.rollout.agent_timeout, **kw)
    except ValueError as e:  # a switch the harness cannot honour (an unknown tool, a value TOML cannot hold)
        raise ConfigError(str(e)) from None
    return MiniSweAgentHarness(h, command_timeout=cfg.sandbox.command_timeout, log_dir=log_dir)


def make_proxy(cfg: Config, engine: Engine, tokenizer: Any, on_call: Callable[[LLMCall], None]) -> Proxy:
    """The LLM proxy with the run's sampling overrides, tool-call format (model.tool_format) and reasoning markers
    (model.reasoning); every call goes to `on_call` (a store). `engine` (the policy) serves the sessions opened
    without an engine of their own; episodes open theirs with the engine their context chooses."""
    return Proxy(engine, tokenizer, model_name=cfg.proxy.served_model_name, sampling=cfg.sampling, on_call=on_call,
                 parser=cfg.model.tool_format, reasoning=cfg.model.reasoning)


def make_remote_engine(cfg: Config, tokenizer: Any, *, urls: list[str] | None = None,
                       base_model_dir: str | Path | None = None, checkpoint_dir: str | Path | None = None) -> Any:
    """A vLLM / SGLang client for `engine.urls` (engine.kind vllm or sglang), or for `urls` (a server the
    driver started: engine.serve), whose model and weight checkpoints lie where given."""
    from legorl.engine.remote import SGLangEngine, VLLMEngine

    e = cfg.engine
    urls = urls or e.urls
    if not urls:
        raise ValueError(f"engine.kind is {e.kind} but engine.urls is empty: give one URL per server")
    common: dict[str, Any] = {"checkpoint_dir": checkpoint_dir or e.checkpoint_dir,
                              "base_model_dir": base_model_dir or cfg.model.path, "vocab_size": len(tokenizer)}
    if e.kind == "vllm":  # vLLM serves without a tokenizer: the client applies stop strings
        return VLLMEngine(urls, tokenizer=tokenizer, **common)
    return SGLangEngine(urls, **common)


@dataclass(frozen=True)
class Teacher:
    """The SFT teacher: the engine (closed when the demonstrations end) and the choice of it per rollout."""

    engine: Engine
    engine_for: EngineFor


def make_teacher(c: SFTConfig, tokenizer: Any) -> Teacher:
    """The upstream teacher serves every demonstration; the scripted one plays each its task's script."""
    from legorl.engine.scripted import ScriptedEngine
    from legorl.engine.upstream import UpstreamEngine
    from legorl.rollout.teacher import scripted_teacher

    if c.teacher == "upstream":
        if not (c.teacher_url and c.teacher_model):
            raise ValueError("sft.teacher is upstream: set sft.teacher_url and sft.teacher_model")
        upstream = UpstreamEngine(c.teacher_url, c.teacher_model, tokenizer)
        return Teacher(upstream, always(upstream))
    engine = ScriptedEngine(tokenizer)
    return Teacher(engine, scripted(engine, scripted_teacher(c.check_edits, c.recovery_demos)))


def hidden_paths(cfg: Config, run_dir: Path, cache_dir: Path) -> list[Path]:
    """What sandboxes must not see: the run directory, the model cache, the task files."""
    hide = [run_dir, cache_dir]
    if cfg.tasks.path:
        hide.append(Path(cfg.tasks.path).resolve().parent)
    return hide


def make_context(cfg: Config, *, proxy: Proxy, engine: Engine, harness: Harness | dict[str, Harness], store: Store,
                 run_dir: Path, label: str, hide_paths: list[Path]) -> EpisodeContext:
    """The long-lived parts an episode uses, its sessions served by `engine` (the policy; a teacher's episodes
    get a copy with the teacher's `engine_for`); sandboxes go under `run_dir / "sandboxes"`."""
    r = cfg.rollout
    harnesses = harness if isinstance(harness, dict) else {harness.name: harness}
    return EpisodeContext(proxy=proxy, engine_for=always(engine), harnesses=harnesses, store=store, run_dir=run_dir,
                          label=label,
                          hide_paths=hide_paths, agent_timeout=r.agent_timeout,
                          grading_timeout=r.grading_timeout, policies=resolve_policies(r.policies),
                          faults=cfg.faults, limits=SandboxLimits.from_dict(cfg.sandbox.limits),
                          sandbox_uid=cfg.sandbox.uid, relay_port=cfg.sandbox.relay_port,
                          require_submit=r.require_submit, sandbox=cfg.sandbox, one_version=r.mode == "sync")
