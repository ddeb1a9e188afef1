"""Routing replay (R3) on a tiny Qwen3-MoE: how often sampler and trainer route differently, and the
sampler/trainer mismatch KL, without and with replay, in one run.

The sampler and trainer differ the way they do in practice:
- sampler: KV-cache incremental decode (prefill, then one token per forward with past_key_values),
  all sequences decoded together in one batch, matmuls in bf16 (CPU autocast) -- or, with
  ``--mismatch noise``, fp32 with small Gaussian noise on the sampler's weights (another kernel's
  rounding), the routes recorded with legorl.models.routing.record_routing;
- trainer: legorl's Trainer (lr 0, so nothing changes), full-sequence fp32 forwards in micro-batches
  of another composition, routing_replay off vs R3.

A random tiny MoE is unlike a trained one: near-uniform routers (HF init std 0.02) and experts
whose output is negligible next to the residual stream (so a flipped route changes nothing). The
bench therefore re-draws the routers with std ``--router-std``, scales every weight by
``--init-scale`` (logits of a realistic size: bf16 mean |dlogp| lands in the 0.01-0.03 seen in the
field) and the experts by ``--expert-scale`` (an expert's output matters, as in a trained MoE).

    .venv/bin/python bench/routing_replay.py            # ~1 minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import time

import torch
import transformers

from legorl.models.routing import PAD_ROUTE, RoutingRecorder, find_routers, record_routing, replay_routing
from legorl.models.tiny import ModelSpec
from legorl.records import TrainingSequence
from legorl.train.trainer import Trainer


def build(
    spec: ModelSpec, vocab: int, router_std: float, init_scale: float, expert_scale: float
) -> transformers.PreTrainedModel:
    common = {
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
    }
    if spec.moe:
        cfg = transformers.Qwen3MoeConfig(
            **common,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            norm_topk_prob=True,
        )
    else:
        cfg = transformers.Qwen3Config(**common)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(spec.seed)
    model = (transformers.Qwen3MoeForCausalLM if spec.moe else transformers.Qwen3ForCausalLM)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(init_scale)
        for m in model.modules():
            if type(m).__name__.endswith("Experts"):  # experts that matter: a flip changes the output
                m.gate_up_proj.mul_(expert_scale)
                m.down_proj.mul_(expert_scale)
        for r in find_routers(model):
            r.weight.normal_(0.0, router_std)
    return model.eval()


# transformers 5.x renamed past_key_values -> cache (the old name warns until 5.40)
CACHE_KW = (
    "cache"
    if "cache" in inspect.signature(transformers.Qwen3MoeForCausalLM.forward).parameters
    else ("past_key_values")
)


def _cache(out: object) -> object:
    return getattr(out, "cache", None) or out.past_key_values  # type: ignore[attr-defined]


@torch.no_grad()
def sample(
    model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, bf16: bool, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """KV-cache decode of a batch; returns ids [B, P+N], logprobs [B, N], routes [B, P+N, L, K]."""
    dev = prompts.device.type
    ctx = torch.autocast(dev, dtype=torch.bfloat16) if bf16 else torch.autocast(dev, enabled=False)
    moe = bool(find_routers(model))
    ids, logps = prompts, []
    with record_routing(model) if moe else contextlib.nullcontext() as rec, ctx:
        out = model(input_ids=prompts, use_cache=True)
        for t in range(new_tokens):
            logp = torch.log_softmax(out.logits[:, -1].float(), -1)
            tok = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(prompts.device)
            logps.append(logp.gather(-1, tok))
            ids = torch.cat([ids, tok], 1)
            if t < new_tokens - 1:
                out = model(input_ids=tok, use_cache=True, **{CACHE_KW: _cache(out)})
    if not moe:
        return ids, torch.cat(logps, 1), None
    routes = rec.pop()  # the last sampled token is never fed back: no route for it
    pad = torch.full_like(routes[:, :1], PAD_ROUTE)
    return ids, torch.cat(logps, 1), torch.cat([routes, pad], 1)


def token_route_diff(
    model: torch.nn.Module, seqs: list[TrainingSequence], replay: bool
) -> tuple[float, float]:
    """(token fraction routed differently in >= 1 layer, router-decision fraction), trainer vs sampler."""
    tok_diff = dec_diff = tok_n = dec_n = 0
    for s in seqs:
        dev = next(model.parameters()).device
        ids = torch.tensor([s.token_ids], device=dev)
        sampler_routes = torch.tensor([s.routed_experts], device=dev)
        rec = RoutingRecorder(len(find_routers(model)))
        # the routes actually used: replay_routing records after forcing
        ctx = replay_routing(model, sampler_routes, record=rec) if replay else record_routing(model, rec)
        with torch.no_grad(), ctx:
            model(input_ids=ids)
        used = rec.pop()
        have = (sampler_routes >= 0).all(-1)  # [1, T, L]
        used = used.to(dev)
        differ = (used.sort(-1).values != sampler_routes.sort(-1).values).any(-1) & have
        tok_diff += int(differ.any(-1).sum())
        tok_n += int(have.all(-1).sum())
        dec_diff += int(differ.sum())
        dec_n += int(have.sum())
    return tok_diff / tok_n, dec_diff / dec_n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--router-std", type=float, default=0.2)
    ap.add_argument("--init-scale", type=float, default=1.5)
    ap.add_argument("--expert-scale", type=float, default=6.0)
    ap.add_argument("--mismatch", choices=["bf16", "noise"], default="bf16")
    ap.add_argument("--noise", type=float, default=2e-3, help="relative weight noise for --mismatch noise")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (the GPU check: bf16 sampler on the GPU)")
    ap.add_argument("--dense", action="store_true", help="a dense Qwen3 of the same size: mismatch only")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    t0 = time.time()

    spec = ModelSpec(moe=not args.dense)
    trainer_model = build(spec, args.vocab, args.router_std, args.init_scale, args.expert_scale)
    trainer_model.to(args.device)
    sampler_model = copy.deepcopy(trainer_model)
    if args.mismatch == "noise":
        with torch.no_grad():
            for p in sampler_model.parameters():
                p.add_(args.noise * p.abs().mean() * torch.randn_like(p))
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, args.vocab, (args.sequences, args.prompt_len), generator=gen).to(args.device)
    ids, logps, routes = sample(sampler_model, prompts, args.new_tokens, args.mismatch == "bf16", gen)

    p, n = args.prompt_len, args.new_tokens
    seqs = [
        TrainingSequence(
            rollout_id=f"r{i}",
            token_ids=ids[i].tolist(),
            loss_mask=[0] * p + [1] * n,
            rollout_logprobs=[0.0] * p + logps[i].tolist(),
            advantage=1.0 if i % 2 else -1.0,
            routed_experts=None if routes is None else routes[i].tolist(),
        )
        for i in range(args.sequences)
    ]
    # Trainer micro-batches of 3 sequences: another batch composition than the sampler's 8.
    budget = 3 * (p + n)
    results = {}
    for mode in ("off",) if args.dense else ("off", "R3"):
        tr = Trainer(trainer_model, lr=0.0, temperature=1.0, routing_replay=mode, micro_batch_tokens=budget)
        m = tr.train_step(seqs)
        tok, dec = (0.0, 0.0) if args.dense else token_route_diff(trainer_model, seqs, replay=mode == "R3")
        results[mode] = (tok, dec, m)

    how = (
        f"bf16 autocast KV-cache decode, batch {args.sequences}"
        if args.mismatch == "bf16"
        else f"fp32 KV-cache decode, batch {args.sequences}, weights + N(0, {args.noise:g} x mean|w|) noise"
    )
    arch = "dense" if args.dense else f"MoE, {spec.num_experts} experts top-{spec.num_experts_per_tok}"
    print(
        f"tiny Qwen3 ({arch}) on {args.device}: {spec.num_layers} layers, "
        f"hidden {spec.hidden_size}, vocab {args.vocab}; weights x{args.init_scale} (HF init), "
        f"experts x{args.expert_scale}, routers N(0, {args.router_std})"
    )
    print(f"sampler: {how}; trainer: fp32 full-sequence forward, micro-batches of 3")
    print(f"{args.sequences} sequences x ({p} prompt + {n} sampled) tokens\n")
    print(
        f"{'replay':<6} {'tokens routed differently':>26} {'router decisions differ':>24} "
        f"{'k3 KL':>10} {'mean|dlogp|':>12} {'pearson':>8}"
    )
    for mode, (tok, dec, m) in results.items():
        print(
            f"{mode:<6} {tok:>26.1%} {dec:>24.1%} {m['train/mismatch_k3_kl']:>10.2e} "
            f"{m['train/mismatch_abs_dlogp_mean']:>12.4f} {m['train/logprob_pearson']:>8.4f}"
        )
    if args.dense:
        return
    off, r3 = results["off"][2]["train/mismatch_k3_kl"], results["R3"][2]["train/mismatch_k3_kl"]
    print(
        f"\nR3 cuts k3 KL {off / r3 if r3 > 0 else float('inf'):.1f}x; routing differences with R3: "
        f"{results['R3'][0]:.1%} of tokens (target 0 and >= 2x)  [{time.time() - t0:.0f}s]"
    )


if __name__ == "__main__":
    main()
