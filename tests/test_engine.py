"""Engines: token/logprob fidelity, batching equivalence, stops, limits, weight updates, scripted replay."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
from helpers import wait_until_async

from legorl.config import EngineConfig
from legorl.engine import (
    ContextOverflowError,
    Engine,
    EngineError,
    LocalEngine,
    ScriptedEngine,
    sample_token,
    sampling_logprobs,
    token_logprobs,
)
from legorl.models import IM_END, ModelSpec, build_model, render_tool_call_text
from legorl.pipeline import engine_delta
from legorl.records import GenerationResult, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tok):
    return build_model(ModelSpec(num_layers=2, seed=1), tok)


def admitted(eng: LocalEngine) -> int:
    """Requests the engine has taken into its batch (prefilled) so far."""
    return eng.stats()["requests"]


def no_stop_engine(model, tok, **kw: Any) -> LocalEngine:
    """No default stop ids: a random model may emit <|im_end|> anywhere, and these tests count tokens."""
    return LocalEngine(model, tok, stop_token_ids=[], **kw)


def run_with_engine(engine: Any, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        try:
            return await fn(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


def prompts(tok, n: int) -> list[list[int]]:
    # Different lengths on purpose: batching must left-pad and position rows correctly.
    return [
        tok.encode(f"<|im_start|>user\nFix bug {i} in {'x' * (3 * i)}.py<|im_end|>\n<|im_start|>assistant\n")
        for i in range(n)
    ]


def greedy(max_tokens: int = 24, **kw: Any) -> SamplingParams:
    kw.setdefault("stop_token_ids", [])
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_same(a: GenerationResult, b: GenerationResult) -> None:
    assert a.completion_ids == b.completion_ids
    assert a.finish_reason == b.finish_reason
    assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0) < 1e-4


def recompute(model, prompt: list[int], res: GenerationResult, temperature: float, top_p: float = 1.0):
    ids = torch.tensor([prompt + res.completion_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(res.completion_ids), temperature, top_p)


def test_sampling_definition() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    lp = sampling_logprobs(logits, 0.0)
    assert torch.allclose(lp, torch.log_softmax(logits, -1))
    assert torch.allclose(sampling_logprobs(logits, 0.5), torch.log_softmax(logits / 0.5, -1))
    # Nucleus: probs at T=1 are ~[.61, .22, .14, .03]; top_p=0.8 keeps the two tokens reaching 0.8.
    nucleus = sampling_logprobs(logits, 1.0, top_p=0.8)
    assert torch.isinf(nucleus[2:]).all() and math.isclose(nucleus[:2].exp().sum().item(), 1.0, rel_tol=1e-6)
    assert torch.isfinite(sampling_logprobs(logits, 1.0, top_p=1e-6)[0])  # the top token always stays
    tok, tlp = sample_token(logits, 0.0, 1.0, None)
    assert tok == 0 and math.isclose(tlp, lp[0].item(), rel_tol=1e-6)
    g = torch.Generator().manual_seed(0)
    draws = {sample_token(logits, 1.0, 0.8, g)[0] for _ in range(200)}
    assert draws == {0, 1}


def test_local_engine_satisfies_protocol(model, tok) -> None:
    eng = LocalEngine(model, tok)
    assert isinstance(eng, Engine) and isinstance(ScriptedEngine(tok), Engine)
    assert eng.max_context() == model.config.max_position_embeddings
    # engine.max_context caps it (each KV slot holds that many tokens); never above the model's own
    assert LocalEngine(model, tok, EngineConfig(max_context=64)).max_context() == 64
    assert LocalEngine(model, tok, EngineConfig(max_context=10**6)).max_context() == model.config.max_position_embeddings
    asyncio.run(eng.close())


def test_greedy_and_seeded_determinism_and_lengths(model, tok) -> None:
    p = prompts(tok, 1)[0]

    async def go(eng: LocalEngine):
        g1 = await eng.generate(p, greedy())
        g2 = await eng.generate(p, greedy())
        s1 = await eng.generate(p, SamplingParams(temperature=1.0, max_tokens=24, seed=5, stop_token_ids=[]))
        s2 = await eng.generate(p, SamplingParams(temperature=1.0, max_tokens=24, seed=5, stop_token_ids=[]))
        s3 = await eng.generate(p, SamplingParams(temperature=1.0, max_tokens=24, seed=6, stop_token_ids=[]))
        return g1, g2, s1, s2, s3

    g1, g2, s1, s2, s3 = run_with_engine(no_stop_engine(model, tok), go)
    for r in (g1, g2, s1, s2, s3):
        assert len(r.completion_ids) == len(r.logprobs) > 0
        assert all(isinstance(t, int) for t in r.completion_ids) and all(lp <= 0 for lp in r.logprobs)
        assert r.weight_version == 0 and r.sampled_from_policy
    # The repeats reuse the first call's KV (prefix cache): equal up to fp32 rounding.
    assert_same(g1, g2)
    assert_same(s1, s2)
    assert s1.completion_ids != s3.completion_ids


def test_concurrent_requests_match_solo(model, tok) -> None:
    ps = prompts(tok, 6)
    params = [
        greedy(20 + 3 * i)
        if i % 2
        else SamplingParams(temperature=0.8, top_p=0.95, max_tokens=30 - i, seed=i, stop_token_ids=[])
        for i in range(6)
    ]

    async def go(eng: LocalEngine):
        solo = [await eng.generate(p, sp) for p, sp in zip(ps, params, strict=True)]
        together = await asyncio.gather(*[eng.generate(p, sp) for p, sp in zip(ps, params, strict=True)])

        async def late(i: int) -> GenerationResult:  # join a batch that is already decoding
            assert await wait_until_async(lambda: admitted(eng) >= 12 + i, timeout=60)  # request i-1 is in
            return await eng.generate(ps[i], params[i])

        staggered = await asyncio.gather(*[late(i) for i in range(6)])
        return solo, together, staggered

    solo, together, staggered = run_with_engine(no_stop_engine(model, tok, max_batch=4), go)
    for a, b, c in zip(solo, together, staggered, strict=True):
        assert_same(a, b)
        assert_same(a, c)
    assert [len(r.completion_ids) for r in solo] == [sp.max_tokens for sp in params]


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (0.0, 1.0), (1.0, 0.9)])
def test_logprobs_match_full_forward(model, tok, temperature: float, top_p: float) -> None:
    ps = prompts(tok, 3)
    sp = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=32, seed=3, stop_token_ids=[])

    async def go(eng: LocalEngine):
        return await asyncio.gather(*[eng.generate(p, sp) for p in ps])

    for p, res in zip(ps, run_with_engine(no_stop_engine(model, tok), go), strict=True):
        ref = recompute(model, p, res, temperature, top_p)
        assert torch.allclose(ref, torch.tensor(res.logprobs), atol=1e-4)


def test_stop_strings_keep_tokens(model, tok) -> None:
    p = prompts(tok, 1)[0]

    async def go(eng: LocalEngine):
        full = await eng.generate(p, greedy(40))
        text = tok.decode(full.completion_ids)
        # A stop string inside the output, ending mid-way through some token's text.
        start = len(tok.decode(full.completion_ids[:5]))
        stop = text[start : start + 3] if len(text) > start + 3 else text[-2:]
        stopped = await eng.generate(p, greedy(40, stop=[stop]))
        return full, stop, stopped

    full, stop, stopped = run_with_engine(no_stop_engine(model, tok), go)
    n = len(stopped.completion_ids)
    assert stopped.finish_reason == "stop"
    assert stopped.completion_ids == full.completion_ids[:n] and stopped.logprobs == pytest.approx(
        full.logprobs[:n]
    )
    assert stop in tok.decode(stopped.completion_ids) and stop not in tok.decode(stopped.completion_ids[:-1])


def test_stop_token_is_included(model, tok) -> None:
    p = prompts(tok, 1)[0]

    async def go(eng: LocalEngine):
        full = await eng.generate(p, greedy(12))
        stop_id = full.completion_ids[3]
        return full, stop_id, await eng.generate(p, greedy(12, stop_token_ids=[stop_id]))

    full, stop_id, res = run_with_engine(no_stop_engine(model, tok), go)
    first = full.completion_ids.index(stop_id)
    assert res.finish_reason == "stop" and res.completion_ids == full.completion_ids[: first + 1]
    assert len(res.logprobs) == first + 1 and res.logprobs[-1] == pytest.approx(full.logprobs[first])
    # Default stop ids are <|im_end|> and <|endoftext|>.
    eng = LocalEngine(model, tok)
    assert set(eng.stop_token_ids) == {tok.convert_tokens_to_ids(IM_END), tok.pad_token_id}
    asyncio.run(eng.close())


def test_max_tokens_and_context_limits(tok) -> None:
    small = build_model(ModelSpec(num_layers=1, max_position_embeddings=32), tok)

    async def go(eng: LocalEngine):
        length = await eng.generate([5] * 10, greedy(4))
        capped = await eng.generate([5] * 29, greedy(50))
        edge = await eng.generate([5] * 31, greedy(50))
        with pytest.raises(ContextOverflowError):
            await eng.generate([5] * 32, greedy(1))
        with pytest.raises(EngineError, match="outside"):
            await eng.generate([10**9], greedy(1))
        with pytest.raises(EngineError, match="empty"):
            await eng.generate([], greedy(1))
        ok = await eng.generate([5] * 3, greedy(2))  # the engine still serves after bad requests
        return length, capped, edge, ok

    length, capped, edge, ok = run_with_engine(no_stop_engine(small, tok), go)
    assert length.finish_reason == "length" and len(length.completion_ids) == 4
    assert capped.finish_reason == "length" and len(capped.completion_ids) == 3
    assert edge.finish_reason == "length" and len(edge.completion_ids) == 1
    assert len(ok.completion_ids) == 2


def test_update_weights_between_steps(tok) -> None:
    m = build_model(ModelSpec(num_layers=1, seed=2), tok)
    other = build_model(ModelSpec(num_layers=1, seed=3), tok).state_dict()
    p = prompts(tok, 1)[0]

    async def go(eng: LocalEngine):
        before = await eng.generate(p, greedy(8))
        inflight = asyncio.create_task(eng.generate(p, greedy(60)))
        assert await wait_until_async(lambda: admitted(eng) == 2, timeout=60)  # it is decoding under version 0
        version = await eng.update_weights(other)
        after = await eng.generate(p, greedy(8))
        with pytest.raises(EngineError, match="unknown keys"):
            await eng.update_weights({"not.a.weight": torch.zeros(1)})
        with pytest.raises(EngineError, match="update_weights failed"):
            await eng.update_weights({"model.norm.weight": torch.zeros(3)})
        return before, await inflight, version, after

    before, inflight, version, after = run_with_engine(no_stop_engine(m, tok), go)
    assert version == 1 and before.weight_version == 0 and after.weight_version == 1
    assert inflight.weight_version == 0 and len(inflight.completion_ids) == 60  # never spans two versions
    assert before.completion_ids[:8] == inflight.completion_ids[:8]
    ref = build_model(ModelSpec(num_layers=1, seed=3), tok)
    assert torch.allclose(recompute(ref, p, after, 0.0), torch.tensor(after.logprobs), atol=1e-4)
    assert after.logprobs != pytest.approx(before.logprobs)


def test_cancel_and_close(model, tok) -> None:
    p = prompts(tok, 1)[0]

    async def go(eng: LocalEngine):
        task = asyncio.create_task(eng.generate(p, greedy(200)))
        assert await wait_until_async(lambda: admitted(eng) == 1, timeout=60)  # cancelled while decoding
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        res = await eng.generate(p, greedy(3))
        await eng.close()
        with pytest.raises(EngineError, match="closed"):
            await eng.generate(p, greedy(3))
        return res

    assert len(run_with_engine(no_stop_engine(model, tok), go).completion_ids) == 3


def test_scripted_engine(tok) -> None:
    call = render_tool_call_text("bash", {"command": "grep -rn 'é' ."})
    texts = ["Let me look at the file.\n" + call, "Done 🤖"]

    async def go(eng: ScriptedEngine):
        eng.set_script("r1", texts)
        eng.set_script("r2", lambda i, prompt: f"call {i} saw {len(prompt)} tokens")
        a = await eng.generate([1, 2], SamplingParams(), rollout_id="r1")
        b = await eng.generate([1, 2], SamplingParams(), rollout_id="r1")
        with pytest.raises(EngineError, match="script exhausted for rollout r1"):
            await eng.generate([1], SamplingParams(), rollout_id="r1")
        c = await eng.generate([1, 2, 3], SamplingParams(), rollout_id="r2")
        with pytest.raises(EngineError, match="no script"):
            await eng.generate([1], SamplingParams(), rollout_id="nope")
        return a, b, c, await eng.update_weights({})

    a, b, c, version = run_with_engine(ScriptedEngine(tok), go)
    im_end = tok.convert_tokens_to_ids(IM_END)
    for res, text in [(a, texts[0]), (b, texts[1]), (c, "call 0 saw 3 tokens")]:
        assert res.completion_ids[-1] == im_end and tok.decode(res.completion_ids[:-1]) == text
        assert res.logprobs == [0.0] * len(res.completion_ids)
        assert res.finish_reason == "stop" and not res.sampled_from_policy
    assert version == 1


def test_moe_model_generates_batched(tok) -> None:
    moe = build_model(ModelSpec(num_layers=1, moe=True, num_experts=4, num_experts_per_tok=2), tok)
    ps = prompts(tok, 3)

    async def go(eng: LocalEngine):
        solo = [await eng.generate(p, greedy(6)) for p in ps]
        return solo, await asyncio.gather(*[eng.generate(p, greedy(6)) for p in ps])

    solo, together = run_with_engine(no_stop_engine(moe, tok), go)
    for a, b in zip(solo, together, strict=True):
        assert_same(a, b)
        assert len(a.completion_ids) == 6


def test_stats_count_step_rows_and_busy_cpu(model, tok) -> None:
    """The counters behind the step metrics engine/rows_per_step, engine/busy_cpu_share and busy_runqueue_share."""
    ps = prompts(tok, 4)

    async def go(eng: LocalEngine):
        await eng.generate(ps[0], greedy(10))
        alone = eng.stats()
        await asyncio.gather(*[eng.generate(p, greedy(10)) for p in ps])
        return alone, eng.stats()

    alone, both = run_with_engine(no_stop_engine(model, tok, max_batch=4), go)
    assert alone["step_rows"] == alone["decode_steps"] == 10  # one row, one token a step
    assert both["step_rows"] - alone["step_rows"] == 40  # 4 rows x 10 tokens ...
    assert both["decode_steps"] - alone["decode_steps"] < 40  # ... in shared steps
    # the worker thread's CPU and its wait for a core fit within its busy wall time
    assert 0 < both["busy_cpu_s"] and 0 <= both["busy_runqueue_s"]
    assert both["busy_cpu_s"] + both["busy_runqueue_s"] <= both["busy_s"] + 1e-3
    m = engine_delta(alone, both, seconds=1.0)
    assert m["engine/rows_per_step"] > 1 and 0 < m["engine/busy_cpu_share"] <= 1
    assert 0 <= m["engine/busy_runqueue_share"] <= 1
