"""`legorl serve`: the embedded engine over HTTP, speaking the parts of vLLM's and SGLang's APIs that RL uses.

Routes (token ids in, token ids + logprobs out; no streaming, one sample per request):

    POST /v1/completions            vLLM / OpenAI completions: ``prompt`` as token ids (or text), ``max_tokens``,
                                    ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``,
                                    ``logprobs``, ``return_tokens_as_token_ids`` ("token_id:N" tokens), and
                                    ``choices[0].token_ids`` always (vLLM's ``return_token_ids`` shape)
    POST /generate                  SGLang native: ``input_ids``, ``sampling_params`` (``max_new_tokens``,
                                    ``temperature``, ``top_p``, ``top_k``, ``stop``, ``stop_token_ids``,
                                    ``sampling_seed``), ``return_logprob`` -> ``meta_info.output_token_logprobs``
                                    as ``[logprob, token_id, null]``
    GET  /health, /health_generate  200 when the engine serves
    GET  /v1/models                 the served model with ``max_model_len``
    GET  /get_model_info            SGLang shape; /get_weight_version -> {"weight_version": label}
    POST /update_weights_from_disk  SGLang: {"model_path": dir, "weight_version": label?} loads every *.safetensors
    POST /collective_rpc            vLLM 0.32 dev-mode shape: {"method": "reload_weights", "kwargs": {"weights_path"?}}
    POST /update_weight_version     vLLM dev mode: {"new_version": label}; GET /weight_info -> {"weight_version": label}
    POST /reset_prefix_cache        clears the prefix cache
    GET  /stats                     legorl: the engine's counters (prefill tokens computed / reused, ...)

Routed experts (MoE models) come back like vLLM with ``--enable-return-routed-experts``
(``prompt_routed_experts`` and ``choices[0].routed_experts``) and, on /generate with
``return_routed_experts``, as ``meta_info.routed_experts`` covering prompt + completion.
Logprobs follow ``legorl.engine.sampling`` (the distribution actually sampled from).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from pathlib import Path
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from transformers import PreTrainedTokenizerBase

from legorl.engine.base import ContextOverflowError, EngineError
from legorl.engine.local import LocalEngine
from legorl.records import GenerationResult, SamplingParams
from legorl.serving import LoopServer


class BadRequest(Exception):
    pass


class _ClientGone(Exception):
    """The client disconnected before its generation finished (the generation was cancelled)."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed its connection (the body is read: the next ASGI message says so)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _error(message: str, status: int = 400, kind: str = "BadRequestError") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in ``path`` (a checkpoint directory)."""
    from safetensors.torch import load_file

    directory = Path(path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        raise BadRequest(f"no *.safetensors files in {str(path)!r}; pass a checkpoint directory")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _int_list(value: Any, name: str) -> list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]  # a batch of one prompt
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{name} must be a list of token ids (integers)")
    return value


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise BadRequest("stop must be a string or a list of strings")


def _num(body: dict[str, Any], key: str, default: float, cast: type = float) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{key} must be a number, got {value!r}")
    return cast(value)


def _params(body: dict[str, Any], max_key: str, max_default: int, seed_key: str) -> SamplingParams:
    top_k = _num(body, "top_k", 0, int)
    params = SamplingParams(
        temperature=_num(body, "temperature", 1.0),
        top_p=_num(body, "top_p", 1.0),
        max_tokens=_num(body, max_key, max_default, int),
        stop=_stops(body.get("stop")),
        stop_token_ids=_int_list(body.get("stop_token_ids") or [], "stop_token_ids"),
        seed=None if body.get(seed_key) is None else _num(body, seed_key, 0, int),
    )
    params.top_k = max(top_k, 0)  # type: ignore[attr-defined]  # -1 (vLLM/SGLang "off") -> 0
    return params


class EngineServer:
    """Owns the engine and the served weight-version label; ``app`` is the ASGI application."""

    def __init__(
        self,
        engine: LocalEngine,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str = "legorl-policy",
        model_path: str | None = None,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name, self.model_path = model_name, model_path
        self._label: str | None = None  # a label given with a reload; None: the engine's version number
        self._update_lock = asyncio.Lock()
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/get_weight_version", self.weight_version, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/update_weights_from_disk", self.update_from_disk, methods=["POST"]),
            Route("/collective_rpc", self.collective_rpc, methods=["POST"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST", "GET"]),
            Route("/update_weight_version", self.update_weight_version, methods=["POST"]),
            Route("/weight_info", self.weight_version, methods=["GET"]),
        ]
        self.app = Starlette(routes=routes)
        self._loop_server = LoopServer(self.app)

    @property
    def version_label(self) -> str:
        """The served weight version: follows the engine, so in-process updates (a driver serving its
        embedded engine to Ray workers) keep it right; a reload may set its own label."""
        return self._label if self._label is not None else str(self.engine.weight_version)

    # ---- serving inside an existing event loop ----

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve from this event loop (the driver, sharing its engine with Ray workers); returns the URL."""
        # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (see proxy/server.py).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        await self._loop_server.start([sock])
        return f"http://{host}:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        await self._loop_server.stop()

    # ---- info ----

    async def health(self, request: Request) -> Response:
        if self.engine.closed:
            return _error("engine closed", 503, "ServiceUnavailable")
        return Response(status_code=200)

    async def models(self, request: Request) -> JSONResponse:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "legorl",
            "root": self.model_path or self.model_name,
            "max_model_len": self.engine.max_context(),
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def model_info(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "model_path": self.model_path or self.model_name,
                "is_generation": True,
                "max_context": self.engine.max_context(),
                "weight_version": self.version_label,
            }
        )

    async def weight_version(self, request: Request) -> JSONResponse:
        return JSONResponse({"weight_version": self.version_label})

    async def stats(self, request: Request) -> JSONResponse:
        return JSONResponse(self.engine.stats())

    # ---- generation ----

    async def _body(self, request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not JSON: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        return body

    def _prompt(self, value: Any, name: str) -> list[int]:
        if isinstance(value, str):
            return self.tokenizer.encode(value, add_special_tokens=False)
        return _int_list(value, name)

    async def _run(self, prompt: list[int], params: SamplingParams, request: Request) -> GenerationResult:
        """Generate while watching the client: one that disconnects first (a proxy whose own client went
        away closes its request) has its generation cancelled, so the engine drops it at its next step."""
        task = asyncio.ensure_future(self.engine.generate(prompt, params))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this handler was cancelled (shutdown): so is the generation
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
            raise _ClientGone
        return task.result()

    def _failed(self, e: BadRequest | EngineError, overflow: str) -> JSONResponse:
        """A failed request's error: 400 for bad input or a prompt too long (``overflow``, in the words
        of the API the client speaks, with ``{e}`` and ``{max_context}``), 503 once the engine is closed."""
        if isinstance(e, ContextOverflowError):
            message = overflow.format(e=e, max_context=self.engine.max_context())
            return _error(message, 400, "ContextOverflowError")
        if isinstance(e, EngineError):
            return _error(str(e), 400 if "engine is closed" not in str(e) else 503)
        return _error(str(e))

    async def completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            if body.get("stream"):
                raise BadRequest("stream=true is not supported by legorl serve")
            if body.get("n", 1) != 1:
                raise BadRequest("n must be 1 (send one request per sample)")
            prompt = self._prompt(body.get("prompt"), "prompt")
            params = _params(body, "max_tokens", 16, "seed")
            res = await self._run(prompt, params, request)
        except (BadRequest, EngineError) as e:
            return self._failed(e, "This model's maximum context length is {max_context} tokens: {e}")
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        pieces = [f"token_id:{t}" if as_ids else self.tokenizer.decode([t]) for t in res.completion_ids]
        logprobs = None
        if body.get("logprobs") is not None:
            offsets, pos = [], 0
            for p in pieces:
                offsets.append(pos)
                pos += len(p)
            top = [{p: lp} for p, lp in zip(pieces, res.logprobs, strict=True)] if body["logprobs"] else None
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": res.logprobs,
                "tokens": pieces,
                "top_logprobs": top,
            }
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.tokenizer.decode(res.completion_ids),
            "logprobs": logprobs,
            "finish_reason": res.finish_reason,
            "stop_reason": None,
            "token_ids": res.completion_ids,
        }
        out: dict[str, Any] = {
            "id": f"cmpl-{secrets.token_hex(12)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(res.completion_ids),
                "total_tokens": len(prompt) + len(res.completion_ids),
            },
            "weight_version": self.version_label,
        }
        if res.routed_experts is not None:
            out["prompt_routed_experts"] = res.routed_experts[: len(prompt)]
            choice["routed_experts"] = res.routed_experts[len(prompt) :]
        return JSONResponse(out)

    async def generate(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            if body.get("stream"):
                raise BadRequest("stream=true is not supported by legorl serve")
            if body.get("input_ids") is None and body.get("text") is None:
                raise BadRequest("give input_ids (token ids) or text")
            prompt = self._prompt(
                body["input_ids"] if body.get("input_ids") is not None else body["text"], "input_ids"
            )
            sp = body.get("sampling_params") or {}
            if not isinstance(sp, dict):
                raise BadRequest("sampling_params must be an object")
            params = _params(sp, "max_new_tokens", 128, "sampling_seed")
            res = await self._run(prompt, params, request)
        except (BadRequest, EngineError) as e:
            return self._failed(
                e, "The input ({e}) is longer than the model's context length ({max_context} tokens)."
            )
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        if res.finish_reason == "stop":
            last = res.completion_ids[-1]
            finish: dict[str, Any] = {
                "type": "stop",
                "matched": last
                if last in params.stop_token_ids or last in self.engine.stop_token_ids
                else None,
            }
        else:
            finish = {"type": "length", "length": len(res.completion_ids)}
        meta: dict[str, Any] = {
            "id": secrets.token_hex(16),
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(res.completion_ids),
            "cached_tokens": 0,
            "weight_version": self.version_label,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [
                [lp, t, None] for t, lp in zip(res.completion_ids, res.logprobs, strict=True)
            ]
        if body.get("return_routed_experts") and res.routed_experts is not None:
            meta["routed_experts"] = res.routed_experts
        return JSONResponse(
            {
                "text": self.tokenizer.decode(res.completion_ids),
                "output_ids": res.completion_ids,
                "meta_info": meta,
            }
        )

    # ---- weights ----

    async def _reload(self, path: str | None, label: str | None) -> int:
        if not path:
            if not self.model_path:
                raise BadRequest("no model_path given and the server was not started from a directory")
            path = self.model_path
        async with self._update_lock:
            state = await asyncio.to_thread(load_safetensors_dir, path)
            version = await self.engine.update_weights(state)
            self._label = label
            return version

    async def update_from_disk(self, request: Request) -> JSONResponse:
        try:
            body = await self._body(request)
            label = body.get("weight_version")
            version = await self._reload(body.get("model_path"), None if label is None else str(label))
        except (BadRequest, EngineError) as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return JSONResponse(
            {
                "success": True,
                "message": f"loaded weights, engine version {version}",
                "num_paused_requests": 0,
                "weight_version": self.version_label,
            }
        )

    async def collective_rpc(self, request: Request) -> JSONResponse:
        try:
            body = await self._body(request)
            if body.get("method") != "reload_weights":
                raise BadRequest(
                    f"legorl serve only implements method 'reload_weights', not {body.get('method')!r}"
                )
            kwargs = body.get("kwargs") or {}
            label = kwargs.get("weight_version")
            await self._reload(kwargs.get("weights_path"), None if label is None else str(label))
        except (BadRequest, EngineError) as e:
            return _error(str(e))
        return JSONResponse({"results": [None]})

    async def update_weight_version(self, request: Request) -> JSONResponse:
        try:
            label = (await self._body(request)).get("new_version")
            if label is None:
                raise BadRequest("give new_version")
        except BadRequest as e:
            return _error(str(e))
        self._label = str(label)
        return JSONResponse({"success": True, "new_version": self._label})

    async def reset_prefix_cache(self, request: Request) -> Response:
        self.engine.clear_prefix_cache()
        return Response(status_code=200)
