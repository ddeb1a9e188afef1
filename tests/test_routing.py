"""Routing capture and replay (R3) on a tiny real Qwen3-MoE (and Mixtral / OLMoE routers)."""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers

from legorl.models.routing import (
    PAD_ROUTE,
    find_routers,
    record_routing,
    replay_routing,
    routes_tensor,
    routing_shape,
)

N_EXPERTS, TOP_K, LAYERS = 8, 2, 2


def tiny_moe(seed: int = 0, norm_topk_prob: bool = True) -> transformers.Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen3MoeForCausalLM(cfg)
    # HF initialises routers to zero (all experts tie); give them real preferences.
    with torch.no_grad():
        for r in find_routers(model):
            r.weight.normal_(0, 0.5)
    return model.eval()


def _ids(b: int = 2, t: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 300, (b, t), generator=torch.Generator().manual_seed(seed))


def test_recorder_shape_and_own_replay_is_bit_identical() -> None:
    model = tiny_moe()
    ids = _ids()
    assert routing_shape(model) == (LAYERS, TOP_K)
    with torch.no_grad(), record_routing(model) as rec:
        ref = model(input_ids=ids).logits
    routes = rec.pop()
    assert routes.shape == (2, 10, LAYERS, TOP_K)
    assert int(routes.min()) >= 0 and int(routes.max()) < N_EXPERTS
    with torch.no_grad(), replay_routing(model, routes) as stats:
        got = model(input_ids=ids).logits
    assert torch.equal(got, ref)
    assert stats.replayed == 2 * 10 * LAYERS and stats.differing == 0 and stats.tokens_differing == 0


@pytest.mark.parametrize("norm", [True, False])
def test_forced_routing_changes_outputs_and_uses_live_gate_weights(norm: bool) -> None:
    model = tiny_moe(norm_topk_prob=norm)
    ids = _ids(1, 6)
    with torch.no_grad(), record_routing(model) as rec:
        ref = model(input_ids=ids).logits
    own = rec.pop()
    forced = (own + 3) % N_EXPERTS  # other experts everywhere (top-2 stays distinct)
    # capture the gate weights the experts receive under replay
    seen: list[torch.Tensor] = []
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    h = experts.register_forward_pre_hook(lambda mod, args: seen.append(args[2].detach().clone()))
    probs: list[torch.Tensor] = []
    router = find_routers(model)[0]
    h2 = router.register_forward_hook(lambda mod, args, out: probs.append(torch.softmax(out[0].float(), -1)))
    try:
        with torch.no_grad(), replay_routing(model, forced) as stats:
            got = model(input_ids=ids).logits
    finally:
        h.remove()
        h2.remove()
    assert not torch.allclose(got, ref)
    assert stats.tokens_differing == 6 and stats.differing == 6 * LAYERS
    # hand-check layer 0: weights are the softmax of the dense logits at the forced experts
    expected = probs[0].gather(-1, forced[0, :, 0, :])
    if norm:
        expected = expected / expected.sum(-1, keepdim=True)
    assert torch.allclose(seen[0], expected, atol=1e-6)


def test_router_gets_gradients_under_replay() -> None:
    model = tiny_moe()
    ids = _ids()
    with torch.no_grad(), record_routing(model) as rec:
        model(input_ids=ids)
    forced = (rec.pop() + 1) % N_EXPERTS
    with replay_routing(model, forced):
        loss = model(input_ids=ids).logits.logsumexp(-1).mean()
        loss.backward()
    for r in find_routers(model):
        assert r.weight.grad is not None and float(r.weight.grad.abs().sum()) > 0


def test_sentinel_routes_freely_never_expert_zero() -> None:
    model = tiny_moe()
    ids = _ids(1, 8)
    with torch.no_grad(), record_routing(model) as rec:
        ref = model(input_ids=ids).logits
    own = rec.pop()
    # all -1: exactly the free forward, nothing replayed
    pad = torch.full_like(own, PAD_ROUTE)
    with torch.no_grad(), record_routing(model) as used, replay_routing(model, pad) as stats:
        got = model(input_ids=ids).logits
    assert torch.equal(got, ref) and stats.replayed == 0
    assert torch.equal(used.pop(), own)  # -1 did not become expert 0
    # a forced route on the last token only changes the last position's logits (causal; earlier
    # positions move by float noise only, since expert matmuls see other token groups)
    partial = pad.clone()
    partial[0, -1] = (own[0, -1] + 4) % N_EXPERTS
    with torch.no_grad(), replay_routing(model, partial) as stats:
        got = model(input_ids=ids).logits
    assert torch.allclose(got[0, :-1], ref[0, :-1], atol=1e-5) and not torch.allclose(got[0, -1], ref[0, -1])
    assert stats.tokens == 1


def test_kv_cache_decode_recording_matches_full_forward_routes() -> None:
    model = tiny_moe()
    ids = _ids(1, 7)
    with torch.no_grad(), record_routing(model) as rec:
        # transformers 5.x renamed past_key_values -> cache (the old name warns)
        kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        out = model(input_ids=ids[:, :4], use_cache=True)
        cache = getattr(out, kw)
        for t in range(4, 7):
            out = model(input_ids=ids[:, t : t + 1], use_cache=True, **{kw: cache})
            cache = getattr(out, kw)
    incremental = rec.pop()
    assert incremental.shape == (1, 7, LAYERS, TOP_K)
    with torch.no_grad(), record_routing(model) as rec:
        model(input_ids=ids)
    full = rec.pop()
    # fp32 on CPU: routes agree except at exact near-ties
    assert (incremental == full).float().mean() > 0.9


def test_bad_routes_are_rejected_clearly() -> None:
    model = tiny_moe()
    ids = _ids(1, 4)
    too_many_layers = torch.zeros(1, 4, 3, TOP_K, dtype=torch.long)
    with pytest.raises(ValueError, match="do not fit this model"), replay_routing(model, too_many_layers):
        pass
    bad_expert = torch.full((1, 4, LAYERS, TOP_K), N_EXPERTS)
    with pytest.raises(ValueError, match="num_experts"), torch.no_grad(), replay_routing(model, bad_expert):
        model(input_ids=ids)
    wrong_len = torch.zeros(1, 5, LAYERS, TOP_K, dtype=torch.long)
    with (
        pytest.raises(ValueError, match="exactly this forward"),
        torch.no_grad(),
        replay_routing(model, wrong_len),
    ):
        model(input_ids=ids)
    dense = transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    assert routing_shape(dense) is None
    with pytest.raises(ValueError, match="no top-k MoE router"), record_routing(dense):
        pass


def test_routes_tensor_pads_with_sentinel() -> None:
    t = routes_tensor([[[[1, 2]], [[3, 4]]], None], length=3, n_layers=1, top_k=2)
    assert t.tolist() == [[[[1, 2]], [[3, 4]], [[-1, -1]]], [[[-1, -1]], [[-1, -1]], [[-1, -1]]]]
    with pytest.raises(ValueError, match="routed_experts of row 0"):
        routes_tensor([[[[1, 2, 3]]]], length=3, n_layers=1, top_k=2)


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_other_hf_moe_routers_replay(arch: str) -> None:
    common = {
        "vocab_size": 100,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "num_experts_per_tok": 2,
    }
    torch.manual_seed(0)
    if arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, **common))
    else:
        model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=4, **common))
    model.eval()
    with torch.no_grad():
        for r in find_routers(model):
            r.weight.normal_(0, 0.5)
    ids = _ids(1, 5) % 100
    with torch.no_grad(), record_routing(model) as rec:
        ref = model(input_ids=ids).logits
    own = rec.pop()
    with torch.no_grad(), replay_routing(model, own):
        assert torch.equal(model(input_ids=ids).logits, ref)
    with torch.no_grad(), replay_routing(model, (own + 1) % 4):
        assert not torch.allclose(model(input_ids=ids).logits, ref)
