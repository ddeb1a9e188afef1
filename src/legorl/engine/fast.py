"""A compact inference forward for Qwen3-family decoders (dense and MoE), over a slot KV cache.

It reads the weights of a stock transformers model (``model.model.layers[i].self_attn.q_proj`` ...)
and runs the same maths in a handful of tensor ops per layer: fused q/k/v and gate/up
projections, per-head RMSNorm on q and k (Qwen3), rotary tables precomputed by the model's own
rotary module, SwiGLU MLP or top-k routed experts (Qwen3-MoE), final norm and the LM head.
Llama / Qwen2-style layers (no q/k norm, optional q/k/v bias) use the same code.

The KV cache is preallocated: per layer ``[slots, kv_heads, max_len, head_dim]``. The engine keeps
its active sequences in slots ``0..n-1`` so a decode step attends over plain views
``cache[:n, :, :L]`` (no gather, no re-padding); each row is masked by its own length.
Prefill runs one sequence at a time from any start position (the prefix before it may have been
copied from the prefix cache). MoE layers record the top-k experts of every token they process.

``check_support`` says why a model is not covered (the engine then uses its HF fallback), and the
engine compares this forward's logits with the HF model's once at start-up.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

SUPPORTED_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama")


def check_support(model: PreTrainedModel) -> str | None:
    """None when the fast forward covers ``model``, else the reason it does not."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} (fast path covers {', '.join(SUPPORTED_TYPES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    layer_types = getattr(cfg, "layer_types", None) or []
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention"
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") in ("dynamic", "longrope"):
        return f"rope_type {rope['rope_type']!r} (position-dependent scaling)"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no model.model.layers / rotary_emb"
    for layer in inner.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            if not hasattr(mlp, "gate") or getattr(mlp, "shared_expert", None) is not None:
                return "MoE block with shared experts"
            if not isinstance(getattr(mlp.experts, "gate_up_proj", None), torch.Tensor):
                return "MoE experts not stored as fused 3D tensors"
        elif any(getattr(getattr(mlp, n, None), "bias", None) is not None for n in ("gate_proj", "up_proj")):
            return "MLP with bias"
    return None


@dataclasses.dataclass
class _Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    qk_norm: torch.Tensor | None  # [q_heads + kv_heads, 1, head_dim]: q_norm rows then k_norm rows
    wo: torch.Tensor
    bo: torch.Tensor | None
    ln2: torch.Tensor
    w_gate_up: torch.Tensor | None = None  # dense MLP
    w_down: torch.Tensor | None = None
    router: torch.Tensor | None = None  # MoE
    experts_gate_up: torch.Tensor | None = None  # [experts, 2 * inter, hidden]
    experts_down: torch.Tensor | None = None  # [experts, hidden, inter]
    top_k: int = 0
    norm_topk: bool = False


def _lin_bias(module: torch.nn.Module) -> torch.Tensor | None:
    return getattr(module, "bias", None)


class FastDecoder:
    """Weights of a Qwen3-family model plus a slot KV cache; forward for prefill and batched decode."""

    def __init__(self, model: PreTrainedModel, num_slots: int, max_len: int) -> None:
        cfg = model.config
        self.model = model
        self.num_slots, self.max_len = num_slots, max_len
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(cfg.num_key_value_heads)
        self.rep = self.n_heads // self.n_kv
        attn0 = model.model.layers[0].self_attn
        self.head_dim = int(getattr(attn0, "head_dim", cfg.hidden_size // self.n_heads))
        self.scaling = float(getattr(attn0, "scaling", self.head_dim**-0.5))
        self.eps = float(cfg.rms_norm_eps)
        self.n_layers = len(model.model.layers)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.moe_layers = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
        self.top_k = int(getattr(cfg, "num_experts_per_tok", 0)) if self.moe_layers else 0
        shape = (num_slots, self.n_kv, max_len, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.n_layers)]
        # Routed experts of every cached position: [slots, max_len, moe_layers, top_k] (MoE only).
        self.routes = (
            torch.zeros(
                (num_slots, max_len, len(self.moe_layers), self.top_k), dtype=torch.int16, device=self.device
            )
            if self.moe_layers
            else None
        )
        with torch.inference_mode():
            pos = torch.arange(max_len, device=self.device).unsqueeze(0)
            cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=self.dtype, device=self.device), pos)
        half = self.head_dim // 2
        self.cos = cos[0].to(self.dtype)  # [max_len, head_dim]
        # rotate_half(x) * sin == flip_halves(x) * [-sin_1, sin_2]
        self.sin_signed = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).to(self.dtype)
        self.arange = torch.arange(max_len, device=self.device)
        self.load_weights()

    # ---- weights ----

    def load_weights(self) -> None:
        """(Re)read the HF model's weights; call after every weight update (fused copies are rebuilt)."""
        m = self.model
        with torch.inference_mode():
            self.embed = m.model.embed_tokens.weight
            self.norm = m.model.norm.weight
            self.lm_head = m.get_output_embeddings().weight
            self.layers = [self._layer(layer) for layer in m.model.layers]

    def _layer(self, layer: torch.nn.Module) -> _Layer:
        a = layer.self_attn
        biases = [_lin_bias(a.q_proj), _lin_bias(a.k_proj), _lin_bias(a.v_proj)]
        qk_norm = None
        if hasattr(a, "q_norm"):
            qk_norm = torch.cat(
                [a.q_norm.weight.expand(self.n_heads, -1), a.k_norm.weight.expand(self.n_kv, -1)]
            ).unsqueeze(0)
        out = _Layer(
            ln1=layer.input_layernorm.weight,
            wqkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            bqkv=torch.cat(biases) if all(b is not None for b in biases) else None,  # type: ignore[misc]
            qk_norm=qk_norm,
            wo=a.o_proj.weight,
            bo=_lin_bias(a.o_proj),
            ln2=layer.post_attention_layernorm.weight,
        )
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            out.router = mlp.gate.weight
            out.experts_gate_up = mlp.experts.gate_up_proj
            out.experts_down = mlp.experts.down_proj
            out.top_k = int(mlp.gate.top_k)
            out.norm_topk = bool(mlp.gate.norm_topk_prob)
        else:
            out.w_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            out.w_down = mlp.down_proj.weight
        return out

    # ---- cache management ----

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first ``n`` cached positions of slot ``src`` into slot ``dst``."""
        if n <= 0 or src == dst:
            return
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :n] = k[src, :, :n]
            v[dst, :, :n] = v[src, :, :n]
        if self.routes is not None:
            self.routes[dst, :n] = self.routes[src, :n]

    def move(self, src: int, dst: int, n: int) -> None:
        """Compaction: slot ``src`` now lives in ``dst`` (``src`` becomes free)."""
        self.copy(src, dst, n)

    def release(self, first_free: int) -> None:
        """Slots >= first_free are free (nothing to do: the cache is preallocated)."""

    def export(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A compact copy of slot ``slot``'s first ``n`` positions: k, v [layers, kv, n, hd], routes."""
        k = torch.stack([k[slot, :, :n] for k in self.k])
        v = torch.stack([v[slot, :, :n] for v in self.v])
        routes = self.routes[slot, :n].clone() if self.routes is not None else None
        return k, v, routes

    def load(self, slot: int, k: torch.Tensor, v: torch.Tensor, routes: torch.Tensor | None, n: int) -> None:
        """Write the first ``n`` positions of an exported block into slot ``slot``."""
        for i in range(self.n_layers):
            self.k[i][slot, :, :n] = k[i, :, :n]
            self.v[i][slot, :, :n] = v[i, :, :n]
        if self.routes is not None and routes is not None:
            self.routes[slot, :n] = routes[:n]

    def get_routes(self, slot: int, n: int) -> list[list[list[int]]] | None:
        return self.routes[slot, :n].tolist() if self.routes is not None else None

    # ---- forward ----

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _qkv(
        self, layer: _Layer, h: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, hidden], pos [N] -> q [N, H, hd], k [N, KV, hd], v [N, KV, hd] (normed, rotated)."""
        n, hd, nq = h.shape[0], self.head_dim, self.n_heads + self.n_kv
        qkv = F.linear(h, layer.wqkv, layer.bqkv).view(n, nq + self.n_kv, hd)
        qk, v = qkv[:, :nq], qkv[:, nq:]
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), None, self.eps) * layer.qk_norm
        cos, sin = self.cos[pos].unsqueeze(1), self.sin_signed[pos].unsqueeze(1)
        flipped = qk.unflatten(-1, (2, hd // 2)).flip(-2).flatten(-2)
        qk = torch.addcmul(qk * cos, flipped, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], v

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if layer.w_gate_up is not None:
            gate, up = F.linear(h, layer.w_gate_up).chunk(2, dim=-1)
            return F.linear(F.silu(gate) * up, layer.w_down), None
        assert layer.router is not None and layer.experts_gate_up is not None
        assert layer.experts_down is not None
        probs = torch.softmax(F.linear(h, layer.router), dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, layer.top_k, dim=-1)
        if layer.norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(h.dtype)
        out = torch.zeros_like(h)
        for e in torch.unique(top_i).tolist():
            tok, kpos = (top_i == e).nonzero(as_tuple=True)
            gate, up = F.linear(h[tok], layer.experts_gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, layer.experts_down[e]) * top_w[tok, kpos].unsqueeze(1)
            out.index_add_(0, tok, y)
        return out, top_i

    def _block(
        self, i: int, layer: _Layer, x: torch.Tensor, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + F.linear(attn, layer.wo, layer.bo)
        y, routes = self._mlp(layer, self._rms(x, layer.ln2))
        return x + y, routes

    def prefill(self, slot: int, ids: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Run ``ids`` at positions ``start..`` of slot ``slot`` (positions < start must be cached).

        Returns fp32 logits of the last position [vocab], or of every position [T, vocab].
        """
        t = len(ids)
        end = start + t
        pos = self.arange[start:end]
        x = self.embed[torch.tensor(ids, device=self.device)]
        # Query row (r, t) of the grouped layout [KV, rep * T] sees keys 0..start + t.
        allowed = self.arange[:end].unsqueeze(0) <= pos.unsqueeze(1)
        mask = allowed.repeat(self.rep, 1)
        moe_i = 0
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(x, layer.ln1), pos)
            self.k[i][slot, :, start:end] = k.transpose(0, 1)
            self.v[i][slot, :, start:end] = v.transpose(0, 1)
            qg = q.transpose(0, 1).reshape(1, self.n_kv, self.rep * t, self.head_dim)
            out = F.scaled_dot_product_attention(
                qg,
                self.k[i][slot : slot + 1, :, :end],
                self.v[i][slot : slot + 1, :, :end],
                attn_mask=mask,
                scale=self.scaling,
            )
            attn = out.view(self.n_heads, t, self.head_dim).transpose(0, 1).reshape(t, -1)
            x, routes = self._block(i, layer, x, attn)
            if routes is not None and self.routes is not None:
                self.routes[slot, start:end, moe_i] = routes.to(torch.int16)
                moe_i += 1
        if not all_logits:
            x = x[-1:]
        logits = F.linear(self._rms(x, self.norm), self.lm_head).float()
        return logits if all_logits else logits[0]

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of slots ``0..n-1`` at its own position; returns fp32 logits [n, vocab]."""
        n = len(tokens)
        rows = self.arange[:n]
        pos = torch.tensor(positions, device=self.device)
        length = max(positions) + 1
        mask = (self.arange[:length].unsqueeze(0) <= pos.unsqueeze(1)).view(n, 1, 1, length)
        x = self.embed[torch.tensor(tokens, device=self.device)]
        moe_i = 0
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(x, layer.ln1), pos)
            self.k[i][rows, :, pos] = k
            self.v[i][rows, :, pos] = v
            out = F.scaled_dot_product_attention(
                q.view(n, self.n_kv, self.rep, self.head_dim),
                self.k[i][:n, :, :length],
                self.v[i][:n, :, :length],
                attn_mask=mask,
                scale=self.scaling,
            )
            x, routes = self._block(i, layer, x, out.reshape(n, -1))
            if routes is not None and self.routes is not None:
                self.routes[rows, pos, moe_i] = routes.to(torch.int16)
                moe_i += 1
        return F.linear(self._rms(x, self.norm), self.lm_head).float()
