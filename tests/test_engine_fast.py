"""The fast local engine: its forward equals the HF model's, prefix reuse equals recomputation,
top-k sampling follows the documented definition, MoE routes are recorded, and the HF fallback agrees."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from legorl.engine import EngineError, LocalEngine, fast, sampling_logprobs, token_logprobs
from legorl.engine.fast import FastDecoder, check_support
from legorl.engine.prefix import PrefixCache, PrefixEntry, common_prefix
from legorl.engine.sampling import BatchParams, sample_batch
from legorl.models import ModelSpec, build_model
from legorl.records import GenerationResult, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tok):
    return build_model(ModelSpec(num_layers=2, seed=1), tok)


@pytest.fixture(scope="module")
def moe(tok):
    return build_model(ModelSpec(num_layers=2, moe=True, num_experts=4, num_experts_per_tok=2, seed=4), tok)


def llama(vocab: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


class TopK(SamplingParams):
    """SamplingParams with top_k (the engine reads ``params.top_k`` when present)."""

    def __init__(self, top_k: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.top_k = top_k


def run(engine: LocalEngine, coro_fn) -> Any:
    async def main() -> Any:
        try:
            return await coro_fn(engine)
        finally:
            await engine.close()

    return asyncio.run(main())


def ids(n: int, seed: int, vocab: int = 2000) -> list[int]:
    return torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logprobs(
    model, prompt: list[int], res: GenerationResult, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    x = torch.tensor([prompt + res.completion_ids])
    with torch.no_grad():
        logits = model(x).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(res.completion_ids), temperature, top_p, top_k)


@pytest.mark.parametrize("kind", ["dense", "moe", "llama"])
def test_fast_forward_matches_hf_logits(kind: str, model, moe, tok) -> None:
    m = {"dense": model, "moe": moe, "llama": llama(len(tok))}[kind]
    assert check_support(m) is None
    dec = FastDecoder(m, num_slots=3, max_len=128)
    seq = ids(48, 0)
    with torch.inference_mode():
        ref = m(torch.tensor([seq])).logits[0].float()
        full = dec.prefill(0, seq, 0, all_logits=True)
        head = dec.prefill(1, seq[:30], 0, all_logits=True)  # then the rest on top of the cached prefix
        tail = dec.prefill(1, seq[30:40], 30, all_logits=True)
        dec.prefill(2, seq[:20], 0)
        # Batched decode over slots of different lengths: slot 0 at 48, 1 at 40, 2 at 20.
        step = dec.decode([seq[47], seq[40], seq[20]], [47, 40, 20])
    assert (full - ref).abs().max() < 1e-4
    assert (head - ref[:30]).abs().max() < 1e-4 and (tail - ref[30:40]).abs().max() < 1e-4
    assert (step - ref[[47, 40, 20]]).abs().max() < 1e-4
    # And it is not trivially equal: another model's logits differ.
    assert (ref - llama(len(tok))(torch.tensor([seq])).logits[0]).abs().max() > 1e-2 or kind == "llama"


@pytest.mark.parametrize("kind,split", [("dense", False), ("moe", False), ("dense", True), ("moe", True)])
def test_one_step_mixes_decoding_and_joining_rows(
    kind: str, split: bool, model, moe, tok, monkeypatch
) -> None:
    """An engine step packs decoding rows (one token each) and joining rows (a prompt remainder after a
    cached prefix, or a whole prompt) into one forward; every row's logits equal the HF model's, and
    the KV it wrote serves the next step. Dense models take the last-layer shortcut (only each row's
    last token), MoE models run every token (their routes are recorded). Split: the step runs as two
    forwards over two runs of slots, one in a helper thread."""
    m = {"dense": model, "moe": moe}[kind]
    monkeypatch.setattr(fast, "_SPLIT_MIN_COST", 0)
    dec = FastDecoder(m, num_slots=4, max_len=128, split_threads=split)
    seqs = [ids(40, 10 + i) for i in range(4)]
    with torch.inference_mode():
        ref = [m(torch.tensor([s])).logits[0].float() for s in seqs]
        dec.prefill(0, seqs[0][:30], 0)
        dec.prefill(1, seqs[1][:20], 0)
        dec.prefill(2, seqs[2][:10], 0)  # slot 2 joins on top of a cached 10-token prefix, slot 3 fresh
        step = dec.step([[seqs[0][30]], [seqs[1][20]], seqs[2][10:25], seqs[3][:17]], [30, 20, 10, 0])
        after = dec.step([[seqs[0][31]], [seqs[1][21]], [seqs[2][25]], [seqs[3][17]]], [31, 21, 25, 17])
    assert (step - torch.stack([ref[0][30], ref[1][20], ref[2][24], ref[3][16]])).abs().max() < 1e-4
    assert (after - torch.stack([ref[0][31], ref[1][21], ref[2][25], ref[3][17]])).abs().max() < 1e-4
    if kind == "moe":  # routes of every token the step ran, prefix included
        assert dec.get_routes(3, 18) is not None and len(dec.get_routes(3, 18)) == 18  # type: ignore[arg-type]
    if split:
        assert dec._pool is not None and dec._pool._threads  # the helper thread did run half of a step
    dec.close()


def test_unsupported_models_use_the_fallback(tok) -> None:
    m = llama(len(tok))
    m.config.use_sliding_window = True  # not covered by the fast path
    assert "sliding" in (check_support(m) or "")
    eng = LocalEngine(m, tok, stop_token_ids=[])
    assert eng.backend == "hf"
    asyncio.run(eng.close())
    with pytest.raises(EngineError, match="fast engine path unavailable"):
        LocalEngine(m, tok, fast=True)


def test_sampling_definition_with_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    lp = sampling_logprobs(logits, 1.0, top_k=2)
    assert torch.isinf(lp[0, 2:]).all() and math.isclose(lp[0, :2].exp().sum().item(), 1.0, rel_tol=1e-6)
    assert torch.allclose(lp[0, :2], torch.log_softmax(logits[0, :2], -1))
    # top_k first, then the nucleus of the renormalised top-k distribution (vLLM/SGLang order):
    # top-3 probs at T=1 are ~[.63, .23, .14]; top_p=0.8 keeps two of them.
    both = sampling_logprobs(logits, 1.0, top_p=0.8, top_k=3)
    assert torch.isfinite(both[0, :2]).all() and torch.isinf(both[0, 2:]).all()
    # Greedy ignores top_k/top_p; per-row tensors give the same rows as scalars.
    assert torch.allclose(sampling_logprobs(logits, 0.0, 0.5, 1), torch.log_softmax(logits, -1))
    rows = logits.repeat(3, 1)
    batched = sampling_logprobs(
        rows,
        torch.tensor([[1.0], [0.7], [1.0]]),
        torch.tensor([[1.0], [0.8], [1.0]]),
        torch.tensor([[2], [3], [0]]),
    )
    assert torch.allclose(batched[0], lp[0]) and torch.allclose(batched[2], sampling_logprobs(logits, 1.0)[0])
    assert torch.allclose(batched[1], sampling_logprobs(logits, 0.7, 0.8, 3)[0])


def test_sample_batch_draws_from_the_distribution() -> None:
    logits = torch.tensor([[0.0, math.log(3.0), -50.0], [5.0, 0.0, 0.0]])
    params = BatchParams([1.0, 0.0], [1.0, 1.0], [0, 0], torch.device("cpu"))
    draws = [sample_batch(logits, params, [u, 0.3])[0] for u in (0.1, 0.3, 0.6, 0.9)]
    assert [d[0] for d in draws] == [0, 1, 1, 1]  # cdf [.25, 1.0]: u < .25 -> token 0
    assert all(d[1] == 0 for d in draws)  # the greedy row ignores its draw
    _, lps = sample_batch(logits, params, [0.9, 0.0])
    assert math.isclose(lps[0], math.log(0.75), rel_tol=1e-5)
    assert math.isclose(lps[1], torch.log_softmax(logits[1], -1)[0].item(), rel_tol=1e-6)


def test_top_k_sampling_in_engine(model, tok) -> None:
    prompt = ids(30, 1)
    params = TopK(3, temperature=1.0, max_tokens=40, seed=0, stop_token_ids=[])

    async def go(eng: LocalEngine):
        return await eng.generate(prompt, params)

    res = run(LocalEngine(model, tok, stop_token_ids=[]), go)
    ref = full_logprobs(model, prompt, res, 1.0, top_k=3)
    assert torch.allclose(ref, torch.tensor(res.logprobs), atol=1e-4)
    x = torch.tensor([prompt + res.completion_ids])
    with torch.no_grad():
        logits = model(x).logits[0, len(prompt) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(t in top3[i].tolist() for i, t in enumerate(res.completion_ids))


def multi_turn(
    model, tok, prefix_cache_mb: float, turns: int = 5, sessions: int = 3, fast: bool | None = None
):
    """Sessions whose every prompt extends the previous prompt + completion (what the token bridge sends)."""

    async def session(eng: LocalEngine, s: int) -> list[tuple[list[int], GenerationResult]]:
        prompt, out = ids(60, 100 + s), []
        for t in range(turns):
            sp = SamplingParams(
                temperature=0.9 if s % 2 else 0.0, max_tokens=12, seed=10 * s + t, stop_token_ids=[]
            )
            res = await eng.generate(prompt, sp)
            out.append((prompt, res))
            prompt = prompt + res.completion_ids + ids(15, 1000 * s + t)
        return out

    async def go(eng: LocalEngine):
        results = await asyncio.gather(*[session(eng, s) for s in range(sessions)])
        return results, eng.stats()

    engine = LocalEngine(
        model, tok, max_batch=4, stop_token_ids=[], prefix_cache_mb=prefix_cache_mb, fast=fast
    )
    return run(engine, go)


def test_prefix_reuse_equals_recomputation(model, tok) -> None:
    cached, stats = multi_turn(model, tok, prefix_cache_mb=64)
    plain, plain_stats = multi_turn(model, tok, prefix_cache_mb=0)
    assert plain_stats["prefill_tokens_reused"] == 0
    assert plain_stats["prefill_tokens_computed"] == stats["prompt_tokens"] == plain_stats["prompt_tokens"]
    # Turn t's prompt has (60 + t * 27) tokens and all but the new 15 (+ the last sampled token) are reused.
    assert stats["prefill_tokens_reused"] + stats["prefill_tokens_computed"] == stats["prompt_tokens"]
    assert stats["prefill_reuse_fraction"] > 0.6
    for sess_a, sess_b in zip(cached, plain, strict=True):
        for (prompt, a), (_, b) in zip(sess_a, sess_b, strict=True):
            assert a.completion_ids == b.completion_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    # ... and both equal a full forward pass over the whole sequence.
    prompt, last = cached[1][-1]
    assert torch.allclose(full_logprobs(model, prompt, last, 0.9), torch.tensor(last.logprobs), atol=1e-4)


def test_hf_fallback_prefix_reuse_equals_fast_path(model, tok) -> None:
    fast, _ = multi_turn(model, tok, prefix_cache_mb=0, turns=3, sessions=2)
    slow, stats = multi_turn(model, tok, prefix_cache_mb=64, turns=3, sessions=2, fast=False)
    assert stats["backend"] == "hf" and stats["prefill_tokens_reused"] > stats["prefill_tokens_computed"]
    for sess_a, sess_b in zip(fast, slow, strict=True):
        for (_, a), (_, b) in zip(sess_a, sess_b, strict=True):
            assert a.completion_ids == b.completion_ids
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


def test_group_samples_share_the_prompt_and_updates_clear_the_cache(tok) -> None:
    m = build_model(ModelSpec(num_layers=1, seed=2), tok)
    other = build_model(ModelSpec(num_layers=1, seed=3), tok)
    prompt = ids(200, 7)

    async def go(eng: LocalEngine):
        sp = [SamplingParams(temperature=1.0, max_tokens=8, seed=i, stop_token_ids=[]) for i in range(4)]
        group = await asyncio.gather(*[eng.generate(prompt, p) for p in sp])
        s1 = eng.stats()
        await eng.update_weights(other.state_dict())
        after = await eng.generate(prompt, sp[0])
        return group, s1, eng.stats(), after

    group, s1, s2, after = run(LocalEngine(m, tok, stop_token_ids=[]), go)
    # The first sample is prefilled, the other three copy its 199-token prompt prefix.
    assert s1["prefill_tokens_computed"] == 200 + 3 and s1["prefill_tokens_reused"] == 3 * 199
    assert len({tuple(g.completion_ids) for g in group}) > 1
    assert s2["prefill_tokens_computed"] - s1["prefill_tokens_computed"] == 200  # nothing crossed the update
    assert after.weight_version == 1
    assert torch.allclose(full_logprobs(other, prompt, after, 1.0), torch.tensor(after.logprobs), atol=1e-4)


def test_prefix_cache_lru_and_domination() -> None:
    def entry(tokens: list[int]) -> PrefixEntry:
        return PrefixEntry(torch.tensor(tokens), None, None, None, nbytes=10 * len(tokens))

    cache = PrefixCache(max_bytes=100)
    cache.add(entry([1, 2, 3]))
    cache.add(entry([1, 2, 3, 4, 5]))  # dominates the first
    assert len(cache) == 1 and cache.nbytes == 50
    assert not cache.would_store(torch.tensor([1, 2, 3, 4]), 40)
    cache.add(entry([7, 8, 9]))
    e, n = cache.match(torch.tensor([1, 2, 3, 9, 9]), limit=4)
    assert n == 3 and e is not None and len(e) == 5
    assert cache.match(torch.tensor([1, 2, 3, 4, 5, 6]), limit=5)[1] == 5
    cache.add(entry([5, 5, 5]))  # 110 bytes > 100: the least recently used ([7, 8, 9]) goes
    assert cache.evictions == 1 and cache.match(torch.tensor([7, 8, 9, 1]), 3)[1] == 0
    assert common_prefix(torch.tensor([1, 2]), torch.tensor([1, 2, 3])) == 2


def test_moe_routes_recorded_per_token(moe, tok) -> None:
    prompt = ids(20, 3)
    routes_seen: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, inp, out: routes_seen.append(out[2]))
        for layer in moe.model.layers
    ]

    async def go(eng: LocalEngine):
        a = await eng.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[]))
        b = await eng.generate(
            prompt + a.completion_ids + [5, 6], SamplingParams(temperature=0.0, max_tokens=4)
        )
        return a, b

    try:
        eng = LocalEngine(moe, tok, stop_token_ids=[])
        assert eng.backend == "fast"
        a, b = run(eng, go)
        routes_seen.clear()
        with torch.no_grad():
            moe(torch.tensor([prompt + a.completion_ids]))
    finally:
        for h in hooks:
            h.remove()
    assert a.routed_experts is not None and len(a.routed_experts) == len(prompt) + len(a.completion_ids)
    assert all(
        len(tok_routes) == 2 and all(len(r) == 2 for r in tok_routes) for tok_routes in a.routed_experts
    )
    ref = torch.stack(routes_seen, dim=1)  # [tokens, layers, top_k]
    assert sorted(map(sorted, ref.flatten(0, 1).tolist())) == sorted(
        map(sorted, torch.tensor(a.routed_experts).flatten(0, 1).tolist())
    )
    assert torch.equal(ref.sort(-1).values, torch.tensor(a.routed_experts).sort(-1).values)
    # The second call reused the first's KV and routes: its routes still cover its whole sequence.
    assert b.routed_experts is not None and len(b.routed_experts) == len(a.completion_ids) + 22 + len(
        b.completion_ids
    )
    assert b.routed_experts[: len(prompt)] == a.routed_experts[: len(prompt)]


def test_hf_fallback_matches_fast_path(moe, tok) -> None:
    prompts = [ids(25 + 7 * i, 50 + i) for i in range(3)]
    params = [
        SamplingParams(temperature=0.8 * (i % 2), max_tokens=10, seed=i, stop_token_ids=[]) for i in range(3)
    ]

    async def go(eng: LocalEngine):
        return await asyncio.gather(*[eng.generate(p, sp) for p, sp in zip(prompts, params, strict=True)])

    fast = run(LocalEngine(moe, tok, stop_token_ids=[], fast=True), go)
    slow_eng = LocalEngine(moe, tok, stop_token_ids=[], fast=False)
    assert slow_eng.backend == "hf"
    slow = run(slow_eng, go)
    for p, a, b in zip(prompts, fast, slow, strict=True):
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        # The fallback records routes with legorl.models.routing: the same experts per token and layer.
        assert a.routed_experts is not None and b.routed_experts is not None
        assert len(a.routed_experts) == len(b.routed_experts) == len(p) + len(a.completion_ids)
        assert torch.equal(
            torch.tensor(a.routed_experts).sort(-1).values, torch.tensor(b.routed_experts).sort(-1).values
        )
