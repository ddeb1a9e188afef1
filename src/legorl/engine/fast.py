"""A compact inference forward for Qwen3-family decoders (dense and MoE), over a slot KV cache.

It reads the weights of a stock transformers model (``model.model.layers[i].self_attn.q_proj`` ...)
and runs the same maths in a handful of tensor ops per layer: fused q/k/v and gate/up
projections, per-head RMSNorm on q and k (Qwen3), rotary tables precomputed by the model's own
rotary module, SwiGLU MLP or top-k routed experts (Qwen3-MoE), final norm and the LM head.
Llama / Qwen2-style layers (no q/k norm, optional q/k/v bias) use the same code.

The KV cache is preallocated for all layers: keys ``[layers, slots, kv_heads, head_dim, max_len]``
(transposed), values ``[layers, slots, kv_heads, max_len, head_dim]``. One ``forward`` runs a whole engine step: every row (a slot) feeds its new
tokens, one token for a decoding sequence, a whole prompt remainder for a new one, all packed into
one ``[tokens, hidden]`` matrix, so the projections and the MLP are one matmul each for the step.
Attention is the only per-row part: decoding rows in slots ``0..d-1`` attend together (one
batched matmul over plain cache views ``[:d, :, :L]``, each row masked by its own length); a
prefilling row attends over its own slot. Rows whose hidden states nobody reads are dropped
before the last layer's attention and MLP (only each row's last token needs logits), unless MoE
routes must be recorded for every token. MoE layers record the top-k experts of every token.

``check_support`` says why a model is not covered (the engine then uses its HF fallback), and the
engine compares this forward's logits with the HF model's once at start-up.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

SUPPORTED_TYPES = ("qwen3", "qwen3_moe", "qwen2", "llama")
# A step is split over two threads from this much work (MACs; the tiny model's 8 rows x ~600 keys).
_SPLIT_MIN_COST = 2e7


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

    def __init__(
        self, model: PreTrainedModel, num_slots: int, max_len: int, split_threads: bool = False
    ) -> None:
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
        # Keys transposed, [layers, slots, kv_heads, head_dim, max_len], so that a decode step's scores
        # are a plain q @ K matmul (twice as fast as q @ K^T for the few queries per head); values
        # [layers, slots, kv_heads, max_len, head_dim].
        size = (self.n_layers, num_slots, self.n_kv, self.head_dim * max_len)
        self.k = torch.zeros(size, dtype=self.dtype, device=self.device).unflatten(
            -1, (self.head_dim, max_len)
        )
        self.v = torch.zeros(size, dtype=self.dtype, device=self.device).unflatten(
            -1, (max_len, self.head_dim)
        )
        # Offsets of (kv head, dim) in a slot's flattened keys, and of a kv head in its values.
        heads = torch.arange(self.n_kv, device=self.device)
        self._k_off = ((heads.unsqueeze(1) * self.head_dim + torch.arange(self.head_dim)) * max_len).flatten()
        self._v_off = heads * max_len
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
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="legorl-engine-split")
            if split_threads
            else None
        )
        # Work of a step's row in MACs, to split a step evenly: per new token, every layer's projections and
        # MLP; per key a token reads, q.k and p.v of every head (x4: decoding reads are memory-bound).
        moe_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        inter = int(cfg.moe_intermediate_size) * moe_k if self.moe_layers else int(cfg.intermediate_size)
        width = (2 * self.n_heads + 2 * self.n_kv) * self.head_dim + 3 * inter
        self._token_cost = self.n_layers * int(cfg.hidden_size) * width
        self._key_cost = self.n_layers * self.n_heads * 2 * self.head_dim * 4
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
        self.k[:, dst, :, :, :n] = self.k[:, src, :, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        if self.routes is not None:
            self.routes[dst, :n] = self.routes[src, :n]

    def move(self, src: int, dst: int, n: int) -> None:
        """Compaction: slot ``src`` now lives in ``dst`` (``src`` becomes free)."""
        self.copy(src, dst, n)

    def release(self, first_free: int) -> None:
        """Slots >= first_free are free (nothing to do: the cache is preallocated)."""

    def export(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A compact copy of slot ``slot``'s first ``n`` positions: k [layers, kv, hd, n] (transposed),
        v [layers, kv, n, hd], routes."""
        routes = self.routes[slot, :n].clone() if self.routes is not None else None
        return self.k[:, slot, :, :, :n].clone(), self.v[:, slot, :, :n].clone(), routes

    def load(self, slot: int, k: torch.Tensor, v: torch.Tensor, routes: torch.Tensor | None, n: int) -> None:
        """Write the first ``n`` positions of an exported block into slot ``slot``."""
        self.k[:, slot, :, :, :n] = k[..., :n]
        self.v[:, slot, :, :n] = v[:, :, :n]
        if self.routes is not None and routes is not None:
            self.routes[slot, :n] = routes[:n]

    def get_routes(self, slot: int, n: int) -> list[list[list[int]]] | None:
        return self.routes[slot, :n].tolist() if self.routes is not None else None

    # ---- forward ----

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _qkv(
        self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [N, hidden] -> q [N, H, hd], k [N, KV, hd], v [N, KV, hd] (normed, rotated)."""
        n, hd, nq = h.shape[0], self.head_dim, self.n_heads + self.n_kv
        qkv = F.linear(h, layer.wqkv, layer.bqkv).view(n, nq + self.n_kv, hd)
        qk, v = qkv[:, :nq], qkv[:, nq:]
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), None, self.eps) * layer.qk_norm
        flipped = qk.unflatten(-1, (2, hd // 2)).flip(-2).flatten(-2)
        qk = torch.addcmul(qk * cos, flipped, sin)
        return qk[:, : self.n_heads], qk[:, self.n_heads :], v

    def _mlp(self, layer: _Layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x + MLP(rms_norm(x)); also the routed experts [N, top_k] of an MoE layer."""
        if layer.w_gate_up is not None:
            return self._dense_mlp(layer, x), None
        h = self._rms(x, layer.ln2)
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
        return x + out, top_i

    def _dense_mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        assert layer.w_gate_up is not None and layer.w_down is not None
        gate, up = F.linear(self._rms(x, layer.ln2), layer.w_gate_up).chunk(2, dim=-1)
        return torch.addmm(x, F.silu(gate) * up, layer.w_down.t())

    def _rows_attention(self, i: int, q: torch.Tensor, bias: torch.Tensor, first: int = 0) -> torch.Tensor:
        """One query per slot ``first..first + n - 1`` (q [n, H, hd]) over its cached keys; bias
        [n * KV, 1, L] is 0 where a row may look and -inf elsewhere. Returns [n, H * hd]."""
        n, length = q.shape[0], bias.shape[-1]
        rows = slice(first, first + n)
        k = self.k[i, rows, :, :, :length].reshape(n * self.n_kv, self.head_dim, length)  # views: the slot
        v = self.v[i, rows, :, :length].reshape(n * self.n_kv, length, self.head_dim)  # stride is kv * head's
        qg = q.reshape(n * self.n_kv, self.rep, self.head_dim)
        scores = torch.baddbmm(bias, qg, k, alpha=self.scaling)
        return torch.bmm(torch.softmax(scores, dim=-1), v).view(n, -1)

    def _prefill_attention(
        self, i: int, q: torch.Tensor, slot: int, end: int, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Queries q [t, H, hd] at positions ``end - t..end - 1`` of ``slot``; ``mask`` [t, end] (True where a
        query may look) or None when the row starts at 0 (plain causal). Returns [t, H * hd]."""
        t = q.shape[0]
        # SDPA's fused kernel wants keys [.., end, hd]: a small copy, cheaper than the scores it saves.
        k = self.k[i, slot, :, :, :end].transpose(-1, -2).contiguous().unsqueeze(0)
        v = self.v[i, slot, :, :end].unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scaling,
            enable_gqa=self.rep > 1,
        )
        return out[0].transpose(0, 1).reshape(t, -1)

    def _row_bias(self, last: list[int]) -> torch.Tensor:
        """The mask of ``_rows_attention`` for rows whose last position is ``last[r]``."""
        pos = torch.tensor(last, device=self.device)
        length = max(last) + 1
        bias = torch.zeros((len(last), length), dtype=self.dtype, device=self.device)
        bias.masked_fill_(self.arange[:length].unsqueeze(0) > pos.unsqueeze(1), float("-inf"))
        return bias.repeat_interleave(self.n_kv, dim=0).unsqueeze(1)

    def forward(
        self,
        ids: list[list[int]],
        starts: list[int],
        slots: list[int] | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """One step: row ``r`` runs ``ids[r]`` at positions ``starts[r]..`` of slot ``slots[r]`` (default
        ``r``; positions before ``starts[r]`` must be cached). Rows must use distinct slots.

        Returns fp32 logits of each row's last token [rows, vocab], or of every token [tokens, vocab].
        """
        n = len(ids)
        slot_list = list(range(n)) if slots is None else list(slots)
        lens = [len(x) for x in ids]
        ends = [s + t for s, t in zip(starts, lens, strict=True)]
        total = sum(lens)
        flat_ids = ids[0] if n == 1 else [t for x in ids for t in x]
        if total == n:  # every row feeds one token (a pure decode step)
            pos_list, slot_of = starts, slot_list
        else:
            pos_list = [p for s, e in zip(starts, ends, strict=True) for p in range(s, e)]
            slot_of = [s for s, t in zip(slot_list, lens, strict=True) for _ in range(t)]
        pos = torch.tensor(pos_list, device=self.device)
        slot_t = torch.tensor(slot_of, device=self.device)
        cos, sin = self.cos[pos].unsqueeze(1), self.sin_signed[pos].unsqueeze(1)
        # Where each token's k/v elements go in a layer's flattened cache.
        base = slot_t * (self.n_kv * self.head_dim * self.max_len)
        k_dest = ((base + pos).unsqueeze(1) + self._k_off).flatten()
        v_dest = ((slot_t * self.n_kv).unsqueeze(1) * self.max_len + self._v_off + pos.unsqueeze(1)).flatten()
        # Decoding rows (one token, in consecutive slots from the first row's) attend together; the
        # others one by one.
        first, d = slot_list[0], 0
        while d < n and lens[d] == 1 and slot_list[d] == first + d:
            d += 1
        dec_bias = self._row_bias(starts[:d]) if d else None
        singles = []  # (row, token offset, slot, end, mask)
        offset = d
        for r in range(d, n):
            p = self.arange[starts[r] : ends[r]]
            mask = self.arange[: ends[r]].unsqueeze(0) <= p.unsqueeze(1) if starts[r] else None
            singles.append((offset, lens[r], slot_list[r], ends[r], mask))
            offset += lens[r]
        # Only the last token of every row needs the last layer's output (not with MoE routes: they
        # are recorded for every token); its attention then runs for all rows together.
        cut = (
            not all_logits
            and self.routes is None
            and slot_list == list(range(first, first + n))
            and total > n
        )
        last_bias = self._row_bias([e - 1 for e in ends]) if cut else None
        last_idx = torch.tensor(list(itertools.accumulate(lens)), device=self.device) - 1  # rows' last tokens

        x = self.embed[torch.tensor(flat_ids, device=self.device)]
        moe_i = 0
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(x, layer.ln1), cos, sin)
            self.k[i].view(-1).index_copy_(0, k_dest, k.reshape(-1))
            self.v[i].view(-1, self.head_dim).index_copy_(0, v_dest, v.reshape(-1, self.head_dim))
            if cut and i == self.n_layers - 1:
                x = x[last_idx]
                attn = self._rows_attention(i, q[last_idx], last_bias, first)  # type: ignore[arg-type]
            else:
                parts = [self._rows_attention(i, q[:d], dec_bias, first)] if dec_bias is not None else []
                for off, t, slot, end, mask in singles:
                    parts.append(self._prefill_attention(i, q[off : off + t], slot, end, mask))
                attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = (
                torch.addmm(x, attn, layer.wo.t())
                if layer.bo is None
                else x + F.linear(attn, layer.wo, layer.bo)
            )
            x, routes = self._mlp(layer, x)
            if routes is not None and self.routes is not None:
                self.routes[slot_t, pos, moe_i] = routes.to(torch.int16)
                moe_i += 1
        if not all_logits and not cut and total > n:
            x = x[last_idx]
        return F.linear(self._rms(x, self.norm), self.lm_head).float()

    def step(self, ids: list[list[int]], starts: list[int]) -> torch.Tensor:
        """The engine's entry point: one step over slots ``0..n-1``, logits of each row's last token.

        Rows are independent sequences, so with ``split_threads`` a large step runs as two forwards over
        two runs of consecutive slots of about equal cost, the second in a helper thread (torch releases
        the GIL inside its kernels): both cores work on one step, and no OpenMP team spins on a loaded
        machine. A row's maths is the same either way."""
        n = len(ids)
        if self._pool is None or n < 2:
            return self.forward(ids, starts)
        # Cost of a row: its new tokens' matmuls plus the keys they read (in units of one hidden-sized MAC).
        cost = [
            len(x) * (self._token_cost + (s + len(x)) * self._key_cost)
            for x, s in zip(ids, starts, strict=True)
        ]
        if sum(cost) < _SPLIT_MIN_COST:
            return self.forward(ids, starts)
        half, acc, h = sum(cost) / 2, 0.0, 0
        while h < n - 1 and acc + cost[h] <= half:
            acc += cost[h]
            h += 1
        h = max(h, 1)
        other = self._pool.submit(self._forward_inference, ids[h:], starts[h:], list(range(h, n)))
        try:
            mine = self.forward(ids[:h], starts[:h])
        finally:
            theirs = other.result()
        return torch.cat([mine, theirs])

    def _forward_inference(self, ids: list[list[int]], starts: list[int], slots: list[int]) -> torch.Tensor:
        with torch.inference_mode():  # thread-local: the helper thread enters it itself
            return self.forward(ids, starts, slots)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def prefill(self, slot: int, ids: list[int], start: int, all_logits: bool = False) -> torch.Tensor:
        """Run ``ids`` at positions ``start..`` of slot ``slot``: logits of the last token [vocab] or of
        every token [T, vocab]."""
        logits = self.forward([ids], [start], [slot], all_logits=all_logits)
        return logits if all_logits else logits[0]

    def decode(self, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One token for each of slots ``0..n-1`` at its own position; returns fp32 logits [n, vocab]."""
        return self.forward([[t] for t in tokens], positions)
