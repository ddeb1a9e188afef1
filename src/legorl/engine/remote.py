"""Remote engines: vLLM (OpenAI-compatible ``/v1/completions``) and SGLang (native ``/generate``) servers.

Both implement the Engine protocol over httpx: token ids in, token ids + logprobs (+ routed
experts when the server returns them) out. Every response is validated on arrival (ids are
integers in range, as many logprobs as ids, nothing empty, logprobs finite-or--inf and <= 0);
vLLM's ``"token_id:N"`` token strings are parsed when ``token_ids`` is absent.

Several servers: a rollout's calls stick to one server (its prefix cache holds the rollout's
history); a rollout's first call goes to the least-loaded healthy server (ties broken by a hash
of the rollout id). A server that fails (connection error, 5xx, timeout, invalid response) is
marked down and the call is retried on another; down servers are probed again (``/health``)
after ``recheck_s``. When no server can answer, the call fails with EngineError (the rollout
outcome ``engine_error``). Bad requests (4xx) are not retried; a context-length 400 becomes
ContextOverflowError. Once the context length is known (given, or ``max_model_len`` from
``/v1/models``), a prompt with no room fails with ContextOverflowError before it is sent, and
``max_tokens`` is capped to the room left, as the embedded engine does (vLLM would cut the
completion silently).

Weight sync: ``update_weights(state_dict)`` writes a safetensors checkpoint under
``checkpoint_dir`` (shared disk), or ``update_weights_from_dir(path)`` uses one that the trainer
wrote; new calls wait, in-flight calls finish, every server reloads (SGLang:
``/update_weights_from_disk``; vLLM: dev-mode ``/collective_rpc`` ``reload_weights``), then
``weight_version`` is bumped and stamped on every later result. A server that fails to reload
is taken out of rotation (it still has the old weights) until a later reload succeeds.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import math
import re
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from legorl.engine.base import ContextOverflowError, EngineError, Weights, no_conversations
from legorl.records import GenerationResult, SamplingParams

log = logging.getLogger(__name__)

STICKY_MAX = 100_000  # rollout -> server entries kept


class InvalidResponse(EngineError):
    """A server answered something that is not a valid generation (retried on another server)."""


class _Retryable(Exception):
    pass


@dataclasses.dataclass(eq=False)
class _Server:
    url: str
    inflight: int = 0
    down_since: float | None = None  # None = healthy
    stale: bool = False  # failed the latest weight reload: holds other weights
    served: int = 0


def validate_result(
    ids: Any, logprobs: Any, finish: Any, vocab_size: int | None, where: str
) -> tuple[list[int], list[float], str]:
    """Check a server's answer; raises InvalidResponse naming the problem."""
    if not isinstance(ids, list) or not ids:
        raise InvalidResponse(f"{where}: no completion token ids in the response")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidResponse(f"{where}: completion ids are not all integers: {ids[:5]}")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
        raise InvalidResponse(f"{where}: completion ids outside [0, {vocab_size})")
    if not isinstance(logprobs, list) or len(logprobs) != len(ids):
        n = len(logprobs) if isinstance(logprobs, list) else "no"
        raise InvalidResponse(f"{where}: {len(ids)} completion ids but {n} logprobs")
    out_lp: list[float] = []
    for lp in logprobs:
        if isinstance(lp, bool) or not isinstance(lp, int | float) or math.isnan(lp) or lp > 1e-4:
            raise InvalidResponse(f"{where}: invalid logprob {lp!r} (must be a number <= 0)")
        out_lp.append(float(lp))
    if finish not in ("stop", "length"):
        raise InvalidResponse(f"{where}: finish reason {finish!r} (expected stop or length)")
    return ids, out_lp, finish


def parse_token_id(token: Any, where: str) -> int:
    """vLLM's ``return_tokens_as_token_ids`` form: ``"token_id:123"`` -> 123."""
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:") :])
        except ValueError:
            pass
    raise InvalidResponse(f"{where}: token {token!r} is not of the form 'token_id:N'")


def _all_token_id_strings(tokens: Any) -> bool:
    return (
        isinstance(tokens, list)
        and bool(tokens)
        and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens)
    )


def _routes(value: Any, where: str) -> list[list[list[int]]] | None:
    if value is None:
        return None
    ok = isinstance(value, list) and all(
        isinstance(t, list)
        and all(isinstance(layer, list) and all(isinstance(e, int) for e in layer) for layer in t)
        for t in value
    )
    if not ok:
        raise InvalidResponse(f"{where}: routed experts are not a [tokens][layers][top_k] integer list")
    return value


class RemoteEngine:
    """Shared client machinery; subclasses speak one server API (see module docstring)."""

    kind = "remote"
    tied_head_file = False  # write a tied LM head as its own tensor (see VLLMEngine)

    def __init__(
        self,
        urls: list[str] | str,
        *,
        model: str | None = None,
        max_context: int | None = None,
        vocab_size: int | None = None,
        timeout_s: float = 600.0,
        recheck_s: float = 5.0,
        checkpoint_dir: str | Path | None = None,
        base_model_dir: str | Path | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise EngineError(f"{type(self).__name__} needs at least one server URL")
        self.servers = [_Server(u.rstrip("/")) for u in urls]
        self.model = model
        self.vocab_size = vocab_size
        self._max_context = max_context
        self.recheck_s = recheck_s
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.base_model_dir = Path(base_model_dir) if base_model_dir is not None else None
        self._weight_version = 0
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self._sticky: collections.OrderedDict[str, _Server] = collections.OrderedDict()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()  # cleared while weights are being updated
        self._open.set()
        self._update_lock = asyncio.Lock()
        self._closed = False
        self._discovered = False

    async def _discover(self) -> None:
        """Learn the context length from ``/v1/models`` (``max_model_len``: vLLM, SGLang, legorl serve)."""
        self._discovered = True
        for server in self.servers:
            try:
                r = await self._client.get(f"{server.url}/v1/models", timeout=10.0)
                cards = r.json().get("data") or []
                lengths = [c.get("max_model_len") for c in cards if isinstance(c, dict)]
                lengths = [n for n in lengths if isinstance(n, int) and n > 0]
                if lengths:
                    self._max_context = min(lengths)
                    return
            except (httpx.HTTPError, ValueError, AttributeError):
                continue

    # ---- protocol ----

    takes_messages = False

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def weights(self) -> Weights:
        return Weights(self._weight_version, tuple(s.url for s in self.servers if s.stale))

    def follow(self, weights: Weights) -> None:
        """Another client (the Ray driver's) reloaded these servers: stamp its version from now on; servers
        that failed its reload hold other weights and stay out of rotation until a later reload succeeds."""
        self._weight_version = weights.version
        for server in self.servers:
            server.stale = server.url in weights.stale_urls
        self._sticky.clear()  # old prefix caches are gone anyway

    def max_context(self) -> int:
        """The servers' context length (given, or learned on the first call; 2**30 while unknown)."""
        return self._max_context if self._max_context is not None else 1 << 30

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, rollout_id: str = ""
    ) -> GenerationResult:
        if self._closed:
            raise EngineError("engine is closed")
        if not prompt_ids or not all(isinstance(t, int) and t >= 0 for t in prompt_ids):
            raise EngineError("prompt must be a non-empty list of token ids (non-negative integers)")
        if self.vocab_size is not None and max(prompt_ids) >= self.vocab_size:
            raise EngineError(f"prompt has token ids outside [0, {self.vocab_size})")
        if self._max_context is None and not self._discovered:
            await self._discover()
        if len(prompt_ids) + 1 > self.max_context():
            raise ContextOverflowError(
                f"prompt of {len(prompt_ids)} tokens leaves no room in a context of {self.max_context()} tokens"
            )
        if params.max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {params.max_tokens}")
        room = self.max_context() - len(prompt_ids)
        if params.max_tokens > room:  # the embedded engine's rule; vLLM would cut the completion silently
            params = dataclasses.replace(params, max_tokens=room)
        self._check_params(params)
        await self._open.wait()
        self._inflight += 1
        self._idle.clear()
        version = self.weight_version
        try:
            return await self._generate(prompt_ids, params, rollout_id, version)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def _generate(
        self, prompt_ids: list[int], params: SamplingParams, rollout_id: str, version: int
    ) -> GenerationResult:
        tried: set[int] = set()
        errors: list[str] = []
        while True:
            server = await self._pick(rollout_id, tried)
            if server is None:
                raise EngineError(
                    f"no {self.kind} server could serve the request ({len(self.servers)} configured): "
                    + "; ".join(errors[-3:] or ["all servers are down"])
                )
            tried.add(id(server))
            server.inflight += 1
            try:
                ids, lps, finish, routes = await self._call(server, prompt_ids, params)
            except _Retryable as e:
                errors.append(str(e))
                self._mark_down(server, str(e))
                continue
            finally:
                server.inflight -= 1
            server.served += 1
            if rollout_id:
                self._stick(rollout_id, server)
            return self._finish(GenerationResult(ids, lps, finish, version, routed_experts=routes), params,
                                len(prompt_ids))

    async def generate_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                            params: SamplingParams, *, rollout_id: str = "") -> GenerationResult:
        raise no_conversations(self)

    async def update_weights(self, state_dict: dict[str, torch.Tensor], version: int | None = None, *,
                             in_flight: bool = False) -> int:
        """Write ``state_dict`` as a checkpoint under ``checkpoint_dir`` and have every server reload it.

        ``in_flight`` drains too: a server's answer does not say which of its tokens came before a pause
        (vLLM 0.32's ``/pause?mode=keep|abort`` included), so a generation never spans a reload here. Only the
        reload itself waits for in-flight calls; asynchronous RL still samples while the trainer trains."""
        if self.checkpoint_dir is None:
            raise EngineError(
                f"{type(self).__name__}.update_weights needs checkpoint_dir (a directory the servers can read)"
            )
        path = self._checkpoint_path(version if version is not None else self._weight_version + 1)
        await asyncio.to_thread(self._write_checkpoint, state_dict, path)
        return await self.update_weights_from_dir(path, version)

    async def update_weights_from_dir(self, path: str | Path, version: int | None = None) -> int:
        """Pause new calls, drain in-flight ones, reload ``path`` on every server; the new version is
        ``version`` where given, else the current one + 1."""
        async with self._update_lock:
            self._open.clear()
            try:
                await self._idle.wait()
                new_version = version if version is not None else self._weight_version + 1
                candidates = [s for s in self.servers if s.down_since is None or await self._probe(s)]
                results = await asyncio.gather(
                    *[self._reload(s, str(path), new_version) for s in candidates], return_exceptions=True
                )
                ok = 0
                for server, result in zip(candidates, results, strict=True):
                    if isinstance(result, BaseException):
                        log.error("%s: weight reload failed: %s", server.url, result)
                        server.stale = True
                    else:
                        server.stale = False
                        ok += 1
                for server in self.servers:
                    if server not in candidates:
                        server.stale = True  # down during the reload: it still has the old weights
                if ok == 0:
                    raise EngineError(f"weight reload of {path} failed on every {self.kind} server")
                self._weight_version = new_version
                self._sticky.clear()  # old prefix caches are gone anyway
                return new_version
            finally:
                self._open.set()

    async def close(self) -> None:
        self._closed = True
        await self._client.aclose()

    # ---- routing and health ----

    def _stick(self, rollout_id: str, server: _Server) -> None:
        self._sticky[rollout_id] = server
        self._sticky.move_to_end(rollout_id)
        while len(self._sticky) > STICKY_MAX:
            self._sticky.popitem(last=False)

    def _usable(self, server: _Server) -> bool:
        return server.down_since is None and not server.stale

    async def _pick(self, rollout_id: str, tried: set[int]) -> _Server | None:
        sticky = self._sticky.get(rollout_id) if rollout_id else None
        if sticky is not None and id(sticky) not in tried and self._usable(sticky):
            return sticky
        for s in self.servers:  # down servers whose recheck time has come get a health probe
            if (
                s.down_since is not None
                and not s.stale
                and id(s) not in tried
                and time.monotonic() - s.down_since >= self.recheck_s
                and await self._probe(s)
                and not await self._serves_current_weights(s)
            ):
                log.error("%s server %s came back with other weights: out of rotation until the next reload",
                          self.kind, s.url)
                s.stale = True
        healthy = [s for s in self.servers if self._usable(s) and id(s) not in tried]
        if not healthy:
            return None
        h = int(hashlib.sha256(rollout_id.encode()).hexdigest()[:8], 16) if rollout_id else 0
        n = len(self.servers)
        return min(healthy, key=lambda s: (s.inflight, (self.servers.index(s) - h) % n))

    def _mark_down(self, server: _Server, reason: str) -> None:
        if server.down_since is None:
            log.warning("%s server %s marked down: %s", self.kind, server.url, reason)
        server.down_since = time.monotonic()

    async def _probe(self, server: _Server) -> bool:
        try:
            r = await self._client.get(f"{server.url}/health", timeout=5.0)
            healthy = r.status_code == 200
        except httpx.HTTPError:
            healthy = False
        server.down_since = None if healthy else time.monotonic()
        return healthy

    async def health(self) -> dict[str, bool]:
        """Probe every server now; returns url -> healthy (and updates the routing state)."""
        results = await asyncio.gather(*[self._probe(s) for s in self.servers])
        return {s.url: ok for s, ok in zip(self.servers, results, strict=True)}

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.kind,
            "weight_version": self.weight_version,
            "inflight": self._inflight,
            "servers": [
                {
                    "url": s.url,
                    "inflight": s.inflight,
                    "served": s.served,
                    "down": s.down_since is not None,
                    "stale": s.stale,
                }
                for s in self.servers
            ],
        }

    # ---- HTTP ----

    async def _post(self, server: _Server, path: str, body: dict[str, Any], *, answer: bool = True) -> Any:
        """POST ``body``; the JSON answer (``answer=False``: a route that answers 200 with no body)."""
        where = f"{server.url}{path}"
        try:
            r = await self._client.post(where, json=body)
        except httpx.HTTPError as e:  # connection refused/reset, timeout, protocol error
            raise _Retryable(f"{where}: {type(e).__name__}: {e}") from e
        if r.status_code >= 500 or r.status_code in (408, 429):
            raise _Retryable(f"{where}: HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            message = _error_message(r)
            if _CONTEXT_ERROR.search(message) or "ContextOverflow" in r.text:
                raise ContextOverflowError(f"{where}: {message}")
            raise EngineError(f"{where}: HTTP {r.status_code}: {message}")
        if not answer:
            return None
        try:
            return r.json()
        except ValueError as e:
            raise _Retryable(f"{where}: response is not JSON") from e

    async def _call(
        self, server: _Server, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], list[float], str, list[list[list[int]]] | None]:
        path, body = self._request(prompt_ids, params)
        data = await self._post(server, path, body)
        try:
            return self._parse(data, len(prompt_ids), f"{server.url}{path}")
        except InvalidResponse as e:
            raise _Retryable(str(e)) from e

    def _checkpoint_path(self, version: int) -> Path:
        """Where update_weights writes version ``version`` (a new directory per version by default)."""
        assert self.checkpoint_dir is not None
        return self.checkpoint_dir / f"v{version}"

    def _write_checkpoint(self, state_dict: dict[str, torch.Tensor], path: Path) -> None:
        """A loadable model directory at ``path``: model.safetensors (+ config/tokenizer from base_model_dir)."""
        tmp = path.with_name(path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.base_model_dir is not None:
            for f in self.base_model_dir.iterdir():
                if f.is_file() and not _is_weight_file(f):
                    shutil.copy2(f, tmp / f.name)
        _save_safetensors(state_dict, tmp / "model.safetensors", tied_head=self.tied_head_file)
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)

    def _check_label(self, label: Any, where: str) -> None:
        """A server that reports its weight version must serve the one this client last loaded
        (a restarted server comes back with its start-up weights). Before any reload, any label goes."""
        if label is not None and self.weight_version > 0 and str(label) != str(self.weight_version):
            raise InvalidResponse(f"{where}: served weight version {label!r}, expected {self.weight_version}")

    # ---- per-API parts ----

    def _check_params(self, params: SamplingParams) -> None:
        """Refuse what this server API cannot honour (EngineError naming the fix)."""

    def _finish(self, result: GenerationResult, params: SamplingParams, prompt_len: int) -> GenerationResult:
        """Client-side post-processing of a validated result (default: none)."""
        return result

    async def _serves_current_weights(self, server: _Server) -> bool:
        """Whether a server that came back after being down still has this client's weights."""
        return True

    def _request(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _parse(
        self, data: Any, prompt_len: int, where: str
    ) -> tuple[list[int], list[float], str, list[list[list[int]]] | None]:
        raise NotImplementedError

    async def _reload(self, server: _Server, path: str, version: int) -> None:
        raise NotImplementedError


# vLLM: "This model's maximum context length is ...", "The decoder prompt (length N) is longer than the
# maximum model length of N", and for a prompt exactly at the limit (vLLM caps max_tokens to the room
# left, 0) "max_tokens must be at least 1, got 0"; legorl serve and SGLang: "context"
_CONTEXT_ERROR = re.compile(
    r"context|maximum model length|max_model_len|max_tokens must be at least 1, got 0", re.IGNORECASE
)


def stop_string_end(ids: list[int], stops: list[str], tokenizer: Any) -> int | None:
    """Index of the token that completes the first stop string in the decoded ``ids`` (None: no stop
    string), by the embedded engine's rule: the completion ends at that token, kept."""
    if not any(s and s in tokenizer.decode(ids, skip_special_tokens=False) for s in stops):
        return None
    window = max((len(s.encode()) for s in stops), default=0) + 2  # every token is at least one byte
    for i in range(len(ids)):
        text = tokenizer.decode(ids[max(0, i + 1 - window) : i + 1], skip_special_tokens=False)
        if any(s and s in text for s in stops):
            return i
    return None


def _is_weight_file(f: Path) -> bool:
    return f.name.endswith((".safetensors", ".bin", ".pt")) or f.name.endswith(".index.json")


def _save_safetensors(state_dict: dict[str, torch.Tensor], path: Path, *, tied_head: bool = False) -> None:
    """A tied LM head shares the embedding's storage: stored once, unless ``tied_head`` (then a copy)."""
    from safetensors.torch import save_file

    seen: set[int] = set()
    tensors = {}
    for k, v in state_dict.items():
        ptr = v.data_ptr()
        if ptr in seen and k.endswith("lm_head.weight"):
            if not tied_head:
                continue
            v = v.clone()  # safetensors refuses two names for one storage
        seen.add(ptr)
        tensors[k] = v.detach().to("cpu").contiguous()
    save_file(tensors, str(path))


def _error_message(r: httpx.Response) -> str:
    try:
        data = r.json()
    except ValueError:
        return r.text[:300]
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict):
        return str(err.get("message", err))
    if isinstance(data, dict) and "message" in data:
        return str(data["message"])
    return r.text[:300]


def _top_k(params: SamplingParams) -> int:
    return int(getattr(params, "top_k", 0) or 0)


def _sampling_fields(params: SamplingParams, *, max_tokens: str, seed: str) -> dict[str, Any]:
    """The sampling parameters both servers read, under each server's names for the completion
    budget and the seed (top_k -1: off); stops and the seed only when set."""
    fields: dict[str, Any] = {
        max_tokens: params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": _top_k(params) or -1,
    }
    if params.stop:
        fields["stop"] = params.stop
    if params.stop_token_ids:
        fields["stop_token_ids"] = params.stop_token_ids
    if params.seed is not None:
        fields[seed] = params.seed
    return fields


class VLLMEngine(RemoteEngine):
    """vLLM servers started by ``legorl vllm serve --model DIR`` (engine/vllm_server.py has the flags:
    token ids in and out with ``--skip-tokenizer-init``, ``--logprobs-mode processed_logprobs``, no
    chunked prefill on the CPU build, ``VLLM_SERVER_DEV_MODE=1`` for the weight routes).

    Stop strings: a server without a tokenizer ignores them, so this client applies them itself with
    ``tokenizer`` (the completion ends at the token that completes one, as in the embedded engine);
    without a tokenizer a request with stop strings is refused. They are still sent: a server with a
    tokenizer (``legorl serve``) stops there and saves the tokens after, with the same result.

    Weight reload (vLLM >= 0.32, dev mode): ``POST /collective_rpc {"method": "reload_weights",
    "kwargs": {"weights_path": DIR}}`` loads a new directory per version (``checkpoint_dir/vN``), then
    ``/reset_prefix_cache`` (the prefix cache keeps the old weights' KV otherwise) and
    ``/update_weight_version``; a server that comes back from being down must report the client's
    version on ``GET /weight_info`` (a restarted server is back on its start-up weights).
    See docs/engines.md.
    """

    kind = "vllm"
    # vLLM's reload_weights keeps its own copy of a tied LM head: a checkpoint without lm_head.weight
    # reloads the embedding but leaves the old head (measured on 0.32: logprobs off, Pearson 0.45)
    tied_head_file = True

    def __init__(self, urls: list[str] | str, *, tokenizer: Any = None, **kwargs: Any) -> None:
        super().__init__(urls, **kwargs)
        self.tokenizer = tokenizer

    def _check_params(self, params: SamplingParams) -> None:
        if params.stop and self.tokenizer is None:
            raise EngineError(
                f"stop strings {params.stop!r}: a vLLM server started with --skip-tokenizer-init ignores "
                "them; give VLLMEngine a tokenizer (tokenizer=...) so that the client applies them"
            )

    def _request(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt_ids,
            **_sampling_fields(params, max_tokens="max_tokens", seed="seed"),
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "include_stop_str_in_output": True,
        }
        if self.model is None:
            del body["model"]
        return "/v1/completions", body

    def _finish(self, result: GenerationResult, params: SamplingParams, prompt_len: int) -> GenerationResult:
        if not params.stop:
            return result
        end = stop_string_end(result.completion_ids, params.stop, self.tokenizer)
        if end is None:
            return result
        n = end + 1
        routes = result.routed_experts[: prompt_len + n] if result.routed_experts is not None else None
        return dataclasses.replace(
            result, completion_ids=result.completion_ids[:n], logprobs=result.logprobs[:n],
            finish_reason="stop", routed_experts=routes,
        )

    def _parse(
        self, data: Any, prompt_len: int, where: str
    ) -> tuple[list[int], list[float], str, list[list[list[int]]] | None]:
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise InvalidResponse(f"{where}: expected exactly one choice")
        choice = choices[0]
        lp = choice.get("logprobs")
        if not isinstance(lp, dict):
            raise InvalidResponse(f"{where}: no logprobs in the choice (the request asked for them)")
        tokens = lp.get("tokens")
        ids = choice.get("token_ids")
        if ids is None:
            if not isinstance(tokens, list):
                raise InvalidResponse(f"{where}: neither token_ids nor logprobs.tokens in the choice")
            ids = [parse_token_id(t, where) for t in tokens]
        elif _all_token_id_strings(tokens) and [parse_token_id(t, where) for t in tokens] != ids:
            raise InvalidResponse(f"{where}: token_ids and logprobs.tokens disagree")
        ids, lps, finish = validate_result(
            ids, lp.get("token_logprobs"), choice.get("finish_reason"), self.vocab_size, where
        )
        self._check_label(data.get("weight_version"), where)  # legorl serve's extension; vLLM has none
        routes = None
        gen_routes = _routes(choice.get("routed_experts"), where)
        prompt_routes = _routes(data.get("prompt_routed_experts"), where)
        if gen_routes is not None and prompt_routes is not None:
            routes = prompt_routes + gen_routes
            if len(routes) != prompt_len + len(ids):
                raise InvalidResponse(
                    f"{where}: routed experts cover {len(routes)} tokens, expected {prompt_len + len(ids)}"
                )
        return ids, lps, finish, routes

    async def _reload(self, server: _Server, path: str, version: int) -> None:
        await self._post(server, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
        await self._post(server, "/reset_prefix_cache", {}, answer=False)  # else later calls reuse the old weights' KV
        await self._post(server, "/update_weight_version", {"new_version": str(version)})

    async def _serves_current_weights(self, server: _Server) -> bool:
        if self.weight_version == 0:
            return True  # nothing loaded yet: every server has the start-up weights
        try:
            r = await self._client.get(f"{server.url}/weight_info", timeout=5.0)
            label = r.json().get("weight_version") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return False
        return label is not None and str(label) == str(self.weight_version)


class SGLangEngine(RemoteEngine):
    """SGLang servers (``python -m sglang.launch_server --model-path MODEL``), native ``/generate`` API.

    Weight reload: ``POST /update_weights_from_disk {"model_path", "weight_version"}``; when a
    response carries ``meta_info.weight_version`` it must equal the version this client expects.
    """

    kind = "sglang"

    def _request(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, dict[str, Any]]:
        sp = {
            **_sampling_fields(params, max_tokens="max_new_tokens", seed="sampling_seed"),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        body = {
            "input_ids": prompt_ids,
            "sampling_params": sp,
            "return_logprob": True,
            "return_routed_experts": True,
        }
        return "/generate", body

    def _parse(
        self, data: Any, prompt_len: int, where: str
    ) -> tuple[list[int], list[float], str, list[list[list[int]]] | None]:
        meta = data.get("meta_info") if isinstance(data, dict) else None
        if not isinstance(meta, dict):
            raise InvalidResponse(f"{where}: no meta_info in the response")
        entries = meta.get("output_token_logprobs")
        if not isinstance(entries, list) or not all(
            isinstance(e, list | tuple) and len(e) >= 2 for e in entries
        ):
            raise InvalidResponse(
                f"{where}: meta_info.output_token_logprobs is not a list of [logprob, id, ...]"
            )
        ids = [e[1] for e in entries]
        output_ids = data.get("output_ids")
        if output_ids is not None and output_ids != ids:
            raise InvalidResponse(f"{where}: output_ids and output_token_logprobs disagree")
        finish = meta.get("finish_reason")
        finish_type = finish.get("type") if isinstance(finish, dict) else finish
        ids, lps, finish_type = validate_result(
            ids, [e[0] for e in entries], finish_type, self.vocab_size, where
        )
        self._check_label(meta.get("weight_version"), where)
        routes = _routes(meta.get("routed_experts"), where)
        if routes is not None and len(routes) != prompt_len + len(ids):
            raise InvalidResponse(
                f"{where}: routed experts cover {len(routes)} tokens, expected {prompt_len + len(ids)}"
            )
        return ids, lps, finish_type, routes

    async def _reload(self, server: _Server, path: str, version: int) -> None:
        data = await self._post(
            server, "/update_weights_from_disk", {"model_path": path, "weight_version": str(version)}
        )
        if not (isinstance(data, dict) and data.get("success")):
            raise EngineError(f"{server.url}: update_weights_from_disk failed: {data}")
