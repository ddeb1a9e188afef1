"""Remote engines against `legorl serve` on loopback: the same conformance suite as the embedded engine,
plus routing (session-sticky, least-loaded), failover when a server dies, and validation of bad answers.

VLLMEngine against `legorl serve` is not only a stand-in: it is the pairing legorl runs itself (Ray
workers reach the driver's embedded engine that way, rollout/cluster.py). VLLMEngine against a real
vLLM is tests/test_engine_vllm_real.py; what stays here only is what one real CPU server cannot show:
several servers (routing, failover), malformed answers, cancellation on the server, SGLang."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn
from helpers import wait_until_async
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from legorl.engine import ContextOverflowError, EngineError, LocalEngine, token_logprobs
from legorl.engine.remote import SGLangEngine, VLLMEngine, parse_token_id
from legorl.engine.server import EngineServer
from legorl.models import ModelSpec, build_model
from legorl.records import GenerationResult, SamplingParams

SPEC = ModelSpec(num_layers=1, seed=11, max_position_embeddings=256)
OTHER = ModelSpec(num_layers=1, seed=12, max_position_embeddings=256)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ref(tok):
    return build_model(SPEC, tok)


@pytest.fixture(scope="module")
def other(tok):
    return build_model(OTHER, tok)


class Served:
    """A uvicorn server in a thread (its own event loop), on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True
        )
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                break
            threading.Event().wait(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@contextlib.contextmanager
def serve(tok, n: int = 1, model_path: Path | None = None) -> Iterator[list[Served]]:
    """``model_path``: the directory the server counts as "started from" (vLLM's reload re-reads it)."""
    engines = [LocalEngine(build_model(SPEC, tok), tok, stop_token_ids=[], max_batch=8) for _ in range(n)]
    path = str(model_path) if model_path else None
    servers = [Served(EngineServer(e, tok, model_path=path).app) for e in engines]
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()
        for e in engines:
            asyncio.run(e.close())


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(10, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def recompute(model, prompt: list[int], res: GenerationResult, temperature: float, top_p: float = 1.0):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + res.completion_ids])).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(res.completion_ids), temperature, top_p)


def run(fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(fn())


async def conformance(engine: Any, ref, other, update: Callable[[], Awaitable[int]]) -> None:
    """The checks every engine passes: fidelity, determinism, batching, stops, limits, weight updates."""
    p = ids(40, 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[])
    g1 = await engine.generate(p, greedy)
    g2 = await engine.generate(p, greedy, rollout_id="r-a")
    assert g1.completion_ids == g2.completion_ids and len(g1.completion_ids) == len(g1.logprobs) == 12
    assert g1.finish_reason == "length" and g1.weight_version == 0 and g1.sampled_from_policy
    assert torch.allclose(recompute(ref, p, g1, 0.0), torch.tensor(g1.logprobs), atol=1e-4)

    sp = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, stop_token_ids=[])
    s1, s2 = await engine.generate(p, sp), await engine.generate(p, sp)
    s3 = await engine.generate(p, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=8))
    assert s1.completion_ids == s2.completion_ids != s3.completion_ids
    assert torch.allclose(recompute(ref, p, s1, 0.8, 0.9), torch.tensor(s1.logprobs), atol=1e-4)

    prompts = [ids(20 + 9 * i, 10 + i) for i in range(4)]
    params = [
        SamplingParams(temperature=0.7 * (i % 2), max_tokens=8 + i, seed=i, stop_token_ids=[])
        for i in range(4)
    ]
    solo = [await engine.generate(q, s) for q, s in zip(prompts, params, strict=True)]
    together = await asyncio.gather(
        *[
            engine.generate(q, s, rollout_id=f"c{i}")
            for i, (q, s) in enumerate(zip(prompts, params, strict=True))
        ]
    )
    for a, b in zip(solo, together, strict=True):
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4

    stop_id = g1.completion_ids[4]
    stopped = await engine.generate(
        p, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    )
    first = g1.completion_ids.index(stop_id)
    assert stopped.finish_reason == "stop" and stopped.completion_ids == g1.completion_ids[: first + 1]

    with pytest.raises(ContextOverflowError):
        await engine.generate([5] * 256, greedy)
    with pytest.raises(EngineError):
        await engine.generate([10**9], greedy)
    capped = await engine.generate([5] * 250, greedy)  # prompt + max_tokens > context: capped, "length"
    assert capped.finish_reason == "length" and len(capped.completion_ids) == 6

    version = await update()
    after = await engine.generate(p, greedy)
    assert version == 1 and after.weight_version == 1
    assert torch.allclose(recompute(other, p, after, 0.0), torch.tensor(after.logprobs), atol=1e-4)
    assert after.logprobs != pytest.approx(g1.logprobs)


def test_local_engine_conformance(tok, ref, other) -> None:
    async def go() -> None:
        engine = LocalEngine(build_model(SPEC, tok), tok, stop_token_ids=[], max_batch=8)
        try:
            await conformance(engine, ref, other, lambda: engine.update_weights(other.state_dict()))
        finally:
            await engine.close()

    run(go)


@pytest.mark.parametrize("cls", [VLLMEngine, SGLangEngine])
def test_remote_engine_conformance(cls, tok, ref, other, tmp_path: Path) -> None:
    served_dir = tmp_path / "ckpt"
    with serve(tok, model_path=served_dir) as servers:

        async def go() -> None:
            engine = cls([servers[0].url], checkpoint_dir=served_dir)
            try:
                await conformance(engine, ref, other, lambda: engine.update_weights(other.state_dict()))
                assert engine.max_context() == 256  # learned from /v1/models
                blind = cls([servers[0].url])
                blind._discovered = True  # context unknown: the server's 400 must become ContextOverflowError
                with pytest.raises(ContextOverflowError):
                    await blind.generate([5] * 256, SamplingParams(max_tokens=2))
                await blind.close()
                assert (served_dir / "v1/model.safetensors").exists()  # a new directory per version
            finally:
                await engine.close()

        run(go)


def test_serve_wire_formats(tok, ref) -> None:
    """The raw HTTP shapes: vLLM's "token_id:N" tokens and token_ids, SGLang's output_token_logprobs."""
    p = ids(30, 3)
    with serve(tok) as (server,):
        c = httpx.post(
            f"{server.url}/v1/completions",
            json={
                "prompt": p,
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
            },
        )
        g = httpx.post(
            f"{server.url}/generate",
            json={
                "input_ids": p,
                "sampling_params": {"max_new_tokens": 5, "temperature": 0},
                "return_logprob": True,
            },
        )
        bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["x", 1], "max_tokens": 2})
        over = httpx.post(f"{server.url}/generate", json={"input_ids": [1] * 300})
        assert httpx.get(f"{server.url}/health").status_code == 200
        models = httpx.get(f"{server.url}/v1/models").json()
        upd = httpx.post(f"{server.url}/update_weights_from_disk", json={"model_path": "/nonexistent"})
    assert c.status_code == 200 and g.status_code == 200, (c.text, g.text)
    choice = c.json()["choices"][0]
    assert [parse_token_id(t, "test") for t in choice["logprobs"]["tokens"]] == choice["token_ids"]
    meta = g.json()["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == g.json()["output_ids"] == choice["token_ids"]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(
        choice["logprobs"]["token_logprobs"], abs=1e-5
    )
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]
    assert over.status_code == 400 and "context length" in over.json()["error"]["message"]
    assert models["data"][0]["max_model_len"] == 256
    assert upd.status_code == 400 and upd.json()["success"] is False


@pytest.mark.parametrize("cls", [VLLMEngine, SGLangEngine])
def test_cancelled_remote_generation_stops_on_the_server(cls, tok) -> None:
    """A caller that gives up on a remote generation (the proxy, when its own client went away) closes
    its request; `legorl serve` sees the disconnect and its engine drops the sequence, well before
    max_tokens, and keeps serving."""
    local = LocalEngine(build_model(ModelSpec(num_layers=1, seed=11, max_position_embeddings=32_768), tok), tok,
                        stop_token_ids=[], max_batch=2)
    server = Served(EngineServer(local, tok).app)
    try:

        async def go() -> None:
            engine = cls([server.url])
            try:
                task = asyncio.create_task(engine.generate(ids(20, 5), SamplingParams(max_tokens=30_000)))
                assert await wait_until_async(lambda: local.stats()["generated_tokens"] > 0, timeout=60)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert await wait_until_async(lambda: local.stats()["cancelled"] == 1, timeout=60)
                assert await wait_until_async(lambda: local.stats()["active"] == 0)
                assert local.stats()["generated_tokens"] < 30_000
                r = await engine.generate(ids(20, 6), SamplingParams(max_tokens=3))
                assert len(r.completion_ids) == 3
            finally:
                await engine.close()

        run(go)
    finally:
        server.stop()
        asyncio.run(local.close())


def test_sticky_routing_least_loaded_and_failover(tok) -> None:
    with serve(tok, n=2) as servers:

        async def go() -> None:
            engine = VLLMEngine([s.url for s in servers], recheck_s=60)
            greedy = SamplingParams(temperature=0.0, max_tokens=4, stop_token_ids=[])
            try:
                # A rollout's calls stick to one server; concurrent first calls spread by load.
                await asyncio.gather(
                    *[engine.generate(ids(12, i), greedy, rollout_id=f"r{i}") for i in range(6)]
                )
                served = [s["served"] for s in engine.stats()["servers"]]
                assert all(n > 0 for n in served) and sum(served) == 6
                home = engine._sticky["r0"]
                for _ in range(3):
                    await engine.generate(ids(12, 0), greedy, rollout_id="r0")
                assert engine._sticky["r0"] is home and home.served >= 4
                # The rollout's server dies: its next call is retried on the other one.
                dead = next(s for s in servers if s.url == home.url)
                dead.stop()
                res = await engine.generate(ids(12, 0), greedy, rollout_id="r0")
                assert len(res.completion_ids) == 4 and engine._sticky["r0"] is not home
                assert home.down_since is not None
                assert (await engine.health())[home.url] is False
                for s in servers:
                    s.stop()
                with pytest.raises(EngineError, match="no vllm server could serve"):
                    await engine.generate(ids(12, 1), greedy, rollout_id="r1")
            finally:
                await engine.close()

        run(go)


def fake_server(reply: dict[str, Any]) -> Served:
    async def handler(request: Request) -> JSONResponse:
        return JSONResponse(reply)

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({})

    return Served(
        Starlette(
            routes=[
                Route("/v1/completions", handler, methods=["POST"]),
                Route("/generate", handler, methods=["POST"]),
                Route("/health", health),
            ]
        )
    )


def vllm_reply(tokens: list[Any], logprobs: list[Any], finish: Any = "length") -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "text": "",
                "finish_reason": finish,
                "logprobs": {"tokens": tokens, "token_logprobs": logprobs},
            }
        ]
    }


@pytest.mark.parametrize(
    "reply,problem",
    [
        (vllm_reply(["token_id:5", "token_id:6"], [-0.1]), "2 completion ids but 1 logprobs"),
        (vllm_reply(["token_id:x"], [-0.1]), "not of the form 'token_id:N'"),
        (vllm_reply(["hello"], [-0.1]), "not of the form 'token_id:N'"),
        (vllm_reply([], []), "no completion token ids"),
        (vllm_reply(["token_id:5"], [0.7]), "invalid logprob"),
        (vllm_reply(["token_id:5"], [-0.7], "abort"), "finish reason"),
        ({"choices": []}, "exactly one choice"),
    ],
)
def test_invalid_answers_are_rejected_then_retried_elsewhere(
    tok, reply: dict[str, Any], problem: str
) -> None:
    bad = fake_server(reply)
    try:

        async def alone() -> None:
            engine = VLLMEngine([bad.url], vocab_size=len(tok))
            try:
                with pytest.raises(EngineError, match=problem):
                    await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
            finally:
                await engine.close()

        run(alone)
    finally:
        bad.stop()


def test_bad_server_is_bypassed_and_sglang_shapes(tok) -> None:
    bad = fake_server(
        {
            "text": "",
            "output_ids": [1, 2],
            "meta_info": {
                "output_token_logprobs": [[-0.1, 1, None], [-0.2, 3, None]],
                "finish_reason": {"type": "length"},
            },
        }
    )
    with serve(tok) as (good,):
        try:

            async def go() -> None:
                engine = SGLangEngine([bad.url, good.url])
                try:
                    for i in range(3):
                        res = await engine.generate(
                            ids(10, i), SamplingParams(temperature=0.0, max_tokens=3), rollout_id=f"x{i}"
                        )
                        assert len(res.completion_ids) == 3
                    assert engine.stats()["servers"][0]["down"] is True
                finally:
                    await engine.close()

            run(go)
        finally:
            bad.stop()
    assert json.dumps(SamplingParams().__dict__)  # params stay plain data
