"""The trainer's forward for dense Qwen3-family decoders: the HF model's maths in fewer, larger ops.

``logits_at(model, input_ids, keep)`` equals ``model(input_ids, attention_mask, logits_to_keep=keep)
.logits`` on a right-padded batch (gradients included, to float rounding; tests/test_train_fast_forward.py),
computed from the model's own parameters with fewer tensor ops per layer than HF's modules:

- q/k/v and gate/up are one matmul each (the weights concatenated per call; autograd splits the
  gradient back), the o/down projections add into the residual in the same BLAS call (addmm);
- RMSNorm is one autograd Function with a hand-written backward (a third of autograd's ops), its
  weight folded into the next matmul's weight (``linear(n * w, W) == linear(n, W * w)`` up to
  rounding); q_norm/k_norm and rotary are one Function for q and k heads together, rotary as
  flip + multiply + addcmul, not slice/neg/cat/mul/mul/add per tensor;
- attention is ``is_causal`` SDPA without a mask even when rows are padded: padding is on the
  right, so a real token only ever sees real tokens before it, exactly as under HF's padding mask;
  padded positions compute something nobody reads (their logits are never kept);
- the final norm and the lm_head run at kept positions only.

On a small model these elementwise ops, not the matmuls, are most of a step, and on a shared
machine every large op is a thread barrier: fewer ops is what makes the step faster.

``why_not(model)`` says why a model is not covered (then the trainer calls the model itself):
MoE, sliding windows, biases on MLP or o_proj, non-SiLU activations, wrapped layers (LoRA, hooks:
the module forward would be bypassed), gradient checkpointing, FSDP-sharded (DTensor) or non-fp32
weights. The trainer also keeps the model's own forward under autocast and routing replay.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

SUPPORTED_TYPES = ("qwen3", "qwen2", "llama")
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


def why_not(model: torch.nn.Module) -> str | None:
    """None when ``logits_at`` covers ``model``, else the reason it does not."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_TYPES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} (covered: {', '.join(SUPPORTED_TYPES)})"
    if inner is None or not all(hasattr(inner, n) for n in ("layers", "embed_tokens", "norm", "rotary_emb")):
        return "no model.model.layers / embed_tokens / norm / rotary_emb"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention"
    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        return "gradient checkpointing (HF's layers recompute; this forward does not)"
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return "forward hooks on the model's modules (they would be bypassed)"
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(lm_head) is not torch.nn.Linear or lm_head.bias is not None:
        return "lm_head is not a plain bias-free Linear"
    for layer in inner.layers:
        mlp, attn = getattr(layer, "mlp", None), getattr(layer, "self_attn", None)
        if attn is None or mlp is None or hasattr(mlp, "experts"):
            return "not a dense decoder layer (MoE or unknown block)"
        mods = [getattr(attn, n, None) for n in _LINEARS]
        mods += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(m) is not torch.nn.Linear for m in mods):
            return "wrapped projection layers (e.g. LoRA): not plain torch.nn.Linear"
        if any(m.bias is not None for m in mods[3:]):
            return "bias on o_proj or the MLP"
    if any(type(p.data) is not Tensor for p in model.parameters()):
        return "sharded (DTensor) parameters"
    if any(p.dtype != torch.float32 for p in model.parameters()):
        return "weights not fp32 (HF's norms upcast low-precision activations; this forward does not)"
    return None


def _rstd(x: Tensor, eps: float) -> Tensor:
    """rsqrt(mean(x^2) + eps) over the last dim, as HF's RMSNorm computes it (a one-kernel
    vector_norm is cheaper, but its rounding moves gradients past the checkpointing test's 1e-5)."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class _Normalize(torch.autograd.Function):
    """x * rsqrt(mean(x^2) + eps) over the last dim: RMSNorm without its weight (the weight is folded
    into what follows). Three large ops forward and four backward, where autograd takes about ten."""

    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        rstd = _rstd(x, eps)
        y = x * rstd
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        y, rstd = ctx.saved_tensors
        m = (g * y).mean(-1, keepdim=True)
        return torch.addcmul(g, y, m, value=-1.0).mul_(rstd), None


def _norm(x: Tensor, eps: float) -> Tensor:
    return _Normalize.apply(x, eps)


class _NormRope(torch.autograd.Function):
    """Qwen3's q_norm/k_norm then rotary, for q and k heads together: ``rope(normalize(x) * w)``
    with rope(y) = y * cos + flip_halves(y) * sin (sin signed, see _run). Seven large ops
    forward and ten backward, where autograd takes about twice that (broadcast weight and table
    gradients, the flip, the accumulations)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, cos: Tensor, sin: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        rstd = _rstd(x, eps)
        n = x * rstd
        y = n * w
        ctx.save_for_backward(n, rstd, w, cos, sin)
        return torch.addcmul(y * cos, _flip(y), sin)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, Tensor, None, None, None]:  # type: ignore[override]
        n, rstd, w, cos, sin = ctx.saved_tensors
        gy = torch.addcmul(g * cos, _flip(g), _flip(sin))  # flip is its own transpose
        dw = (gy * n).sum(tuple(range(gy.dim() - w.dim())))
        gn = gy.mul_(w)
        m = (gn * n).mean(-1, keepdim=True)
        return torch.addcmul(gn, n, m, value=-1.0).mul_(rstd), dw, None, None, None


Past = list[tuple[Tensor, Tensor]]  # per layer: k, v [1, kv_heads, P, head_dim] of a shared prefix


def logits_at(model: torch.nn.Module, input_ids: Tensor, keep: Tensor, past: Past | None = None) -> Tensor:
    """Logits [n_kept, vocab] (row-major over ``keep`` [B, T] bool) of a right-padded batch; with
    ``past`` (``prefix_cache``), the rows are continuations of that prefix (positions P..P+T-1) and
    its gradient is the sum of theirs, like HF's repeated KV cache."""
    x = _run(model, input_ids, past, None)
    xk = x.view(*input_ids.shape, -1)[keep]
    norm = model.model.norm
    return F.linear(_norm(xk, norm.variance_epsilon) * norm.weight, model.get_output_embeddings().weight)


def prefix_cache(model: torch.nn.Module, input_ids: Tensor) -> Past:
    """k and v of every layer for a prefix [1, P] (what HF's KV cache holds; with gradients). No
    logits: the last layer stops once its k and v are known."""
    kv: Past = []
    _run(model, input_ids, None, kv)
    return kv


def _run(model: torch.nn.Module, input_ids: Tensor, past: Past | None, collect: Past | None) -> Tensor:
    """The decoder layers; a prefix (``collect`` given) appends each layer's (k, v) to it."""
    inner = model.model
    cfg = model.config
    b, t = input_ids.shape
    p = past[0][0].shape[2] if past else 0
    emb = inner.embed_tokens
    x = F.embedding(input_ids, emb.weight, emb.padding_idx)  # padding_idx: that row gets no gradient
    pos = torch.arange(p, p + t, device=input_ids.device).unsqueeze(0)
    cos, sin = inner.rotary_emb(x, pos)  # [1, T, hd], the model's own tables (any static rope type)
    dims = _Dims(
        b,
        t,
        int(cfg.num_attention_heads),
        int(cfg.num_key_value_heads),
        int(inner.layers[0].self_attn.head_dim),
    )
    half = dims.hd // 2
    # rotate_half(x) * sin == flip_halves(x) * [-sin_1, sin_2]; [1, T, 1, hd] broadcasts over heads
    rope = (cos.unsqueeze(2), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2))
    # Continuation row i (position p + i) sees the whole prefix and its own tokens up to i.
    mask = torch.arange(p + t, device=x.device) <= pos.transpose(0, 1) if past else None
    x = x.reshape(b * t, -1)
    last = len(inner.layers) - 1
    for i, layer in enumerate(inner.layers):
        x = _layer(
            layer,
            x,
            dims,
            rope,
            past[i] if past else None,
            mask,
            collect,
            kv_only=collect is not None and i == last,
        )
    return x


@dataclasses.dataclass(frozen=True)
class _Dims:
    b: int  # rows
    t: int  # tokens per row
    n_q: int  # query heads
    n_kv: int  # key/value heads
    hd: int  # head dim


def _flip(x: Tensor) -> Tensor:
    """Swap the two halves of the last dim."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)


def _layer(
    layer: torch.nn.Module,
    x: Tensor,
    d: _Dims,
    rope: tuple[Tensor, Tensor],
    past: tuple[Tensor, Tensor] | None,
    mask: Tensor | None,
    collect: Past | None,
    kv_only: bool = False,
) -> Tensor:
    """One decoder layer on x [B*T, hidden] -> [B*T, hidden]. Norm weights are folded into the
    weights that follow them (linear(n * w, W) == linear(n, W * w)), which are small next to the
    activations of a training micro-batch."""
    a, mlp = layer.self_attn, layer.mlp
    h = _norm(x, layer.input_layernorm.variance_epsilon)
    w_qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]) * layer.input_layernorm.weight
    biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
    b_qkv = torch.cat(biases) if all(v is not None for v in biases) else None
    nqk = d.n_q + d.n_kv
    # split(), not slicing: its backward is one cat, where each slice's is a zero-filled copy
    qk, v = F.linear(h, w_qkv, b_qkv).view(d.b, d.t, nqk + d.n_kv, d.hd).split([nqk, d.n_kv], dim=2)
    cos, sin = rope
    if hasattr(a, "q_norm"):  # Qwen3: per-head RMSNorm of q and k before rotary
        w = torch.cat([a.q_norm.weight.expand(d.n_q, d.hd), a.k_norm.weight.expand(d.n_kv, d.hd)])
        qk = _NormRope.apply(qk, w, cos, sin, a.q_norm.variance_epsilon)
    else:
        qk = torch.addcmul(qk * cos, _flip(qk), sin)
    q, k = (z.transpose(1, 2) for z in qk.split([d.n_q, d.n_kv], dim=2))
    v = v.transpose(1, 2)
    if collect is not None:
        collect.append((k, v))
    if kv_only:
        return x
    if past is not None:  # the prefix's k/v for every row (expand: its gradient sums the rows')
        k = torch.cat([past[0].expand(d.b, -1, -1, -1), k], dim=2)
        v = torch.cat([past[1].expand(d.b, -1, -1, -1), v], dim=2)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=float(a.scaling), enable_gqa=d.n_q != d.n_kv
    )
    x = torch.addmm(x, out.transpose(1, 2).reshape(d.b * d.t, d.n_q * d.hd), a.o_proj.weight.t())
    h = _norm(x, layer.post_attention_layernorm.variance_epsilon)
    w_gu = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) * layer.post_attention_layernorm.weight
    gate, up = F.linear(h, w_gu).chunk(2, dim=-1)
    return torch.addmm(x, F.silu(gate) * up, mlp.down_proj.weight.t())
