"""MoE routing capture and replay (R3) for Hugging Face top-k routers.

Sampler and trainer run different kernels, batch shapes and precisions, so an MoE router
that sits near a tie picks different experts at generation and at training (about 10 % of
router decisions; docs/design.md, "Routing replay"). R3 records the experts the sampler used and
forces them in the trainer's forward pass.

Supported routers: every transformers 5.x ``*TopKRouter`` whose forward maps flattened hidden
states ``[N, H]`` to ``(router_logits [N, E], top_k_weights [N, K], top_k_index [N, K])``:
Qwen3-MoE, Mixtral and OLMoE. One "layer" below is one such router, in model order (layers
whose MLP is dense have none).

- :func:`record_routing` captures the top-k expert indices per token per layer; the engine
  stores them with the call as ``[tokens][layers][top_k]``.
- :func:`replay_routing` forces given indices. Only the indices are forced: the gate weights
  are gathered from ``softmax(live dense router logits)`` at the forced experts (and
  renormalised when the model renormalises its top-k), so router gradients still flow.
  A token-layer whose row holds the sentinel ``-1`` (padding, or a prompt token with no
  recorded route) is "not replayed": the router picks freely there. Never expert 0.

Both are context managers over forward hooks; they leave the model unchanged on exit, and
static forced indices mean activation recomputation (gradient checkpointing) replays the
same routes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

PAD_ROUTE = -1  # "no route here": padding, or a position whose route was not recorded


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of ``model`` in layer order (empty for a dense model)."""
    return [
        m
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "num_experts")
    ]


def routing_shape(model: nn.Module) -> tuple[int, int] | None:
    """(MoE layers, top_k) of ``model``, or None when it has no router."""
    routers = find_routers(model)
    if not routers:
        return None
    return len(routers), int(routers[0].top_k)


def _normalises(router: nn.Module) -> bool:
    # Qwen3-MoE / OLMoE carry the flag; Mixtral always renormalises its top-k.
    return bool(getattr(router, "norm_topk_prob", True))


@dataclass
class _Block:
    """Batch/sequence shape of the latest input to a router's MoE block ([B, T, H])."""

    shape: tuple[int, int] | None = None


@dataclass
class RoutingRecorder:
    """Collects, per forward pass, the top-k indices every router used: [B, T, layers, top_k]."""

    n_layers: int
    forwards: list[Tensor] = field(default_factory=list)
    _current: dict[int, Tensor] = field(default_factory=dict)

    def _add(self, layer: int, idx: Tensor) -> None:
        if layer in self._current:  # a new forward pass began (or activation recomputation)
            self._flush()
        self._current[layer] = idx
        if len(self._current) == self.n_layers:
            self._flush()

    def _flush(self) -> None:
        if self._current:
            layers = [self._current[i] for i in sorted(self._current)]
            self.forwards.append(torch.stack(layers, dim=2))  # [B, T, L, K]
            self._current = {}

    def pop(self) -> Tensor:
        """All recorded forwards so far, concatenated along tokens ([B, sum T, L, K]), then cleared.

        For an incremental decode with a fixed batch this is the routing of every fed token.
        Engines with changing batch composition should call it after each forward pass.
        """
        self._flush()
        if not self.forwards:
            raise RuntimeError("no forward pass was recorded; run the model inside record_routing()")
        out = torch.cat(self.forwards, dim=1)
        self.forwards = []
        return out


@dataclass
class ReplayStats:
    """How the trainer's own routing compared with the forced one, on replayed token-layers."""

    replayed: int = 0  # token-layer pairs that were forced
    differing: int = 0  # ... whose own top-k set differed from the forced set
    tokens: int = 0  # tokens with at least one replayed layer
    tokens_differing: int = 0  # ... that differed in at least one layer
    _per_layer: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def _set(self, layer: int, forced: Tensor, differs: Tensor) -> None:
        # Overwrite, not add: recomputation under gradient checkpointing reruns the same layer.
        if any(f.shape != forced.shape for f, _ in self._per_layer.values()):
            self._per_layer = {}  # another forward of a different size: count the latest only
        self._per_layer[layer] = (forced, differs)
        forced_all = torch.stack([f for f, _ in self._per_layer.values()])
        differs_all = torch.stack([d for _, d in self._per_layer.values()])
        self.replayed = int(forced_all.sum())
        self.differing = int(differs_all.sum())
        self.tokens = int(forced_all.any(0).sum())
        self.tokens_differing = int(differs_all.any(0).sum())


def _route_hook(
    layer: int,
    router: nn.Module,
    forced: Tensor | None,
    recorder: RoutingRecorder | None,
    stats: ReplayStats | None,
    block: _Block,
):
    def hook(module: nn.Module, args: tuple, output: tuple[Tensor, Tensor, Tensor]):
        logits, weights, index = output
        if forced is not None:
            k = index.shape[-1]
            f = forced[..., layer, :].reshape(-1, k).to(index.device)
            if f.shape[0] != index.shape[0]:
                raise ValueError(
                    f"routing replay: layer {layer} routes {index.shape[0]} tokens but {f.shape[0]} "
                    "forced routes were given; pass routes shaped [batch, seq_len, layers, top_k] for "
                    "exactly this forward's input_ids"
                )
            if bool((f >= router.num_experts).any()):
                raise ValueError(
                    f"routing replay: expert index >= num_experts ({router.num_experts}) in layer {layer}; "
                    "the recorded routes do not belong to this model"
                )
            use = (f >= 0).all(-1)  # a token-layer is replayed only when its whole row is recorded
            new_index = torch.where(use.unsqueeze(-1), f, index)
            probs = torch.softmax(logits.float(), dim=-1)  # the dense logits: gradients reach the router
            new_w = probs.gather(-1, new_index)
            if _normalises(router):
                new_w = new_w / new_w.sum(-1, keepdim=True)
            if stats is not None:
                with torch.no_grad():
                    same = (index.sort(-1).values == f.sort(-1).values).all(-1)
                    differs = use & ~same
                    stats._set(layer, use.detach().cpu(), differs.detach().cpu())
            weights, index = new_w.to(weights.dtype), new_index
            output = (logits, weights, index)
        if recorder is not None:
            b, t = block.shape if block.shape is not None else (1, index.shape[0])
            recorder._add(layer, index.detach().reshape(b, t, -1).cpu())
        return output

    return hook


@contextmanager
def _hooks(
    model: nn.Module,
    forced: Tensor | None,
    recorder: RoutingRecorder | None,
    stats: ReplayStats | None,
) -> Iterator[None]:
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no top-k MoE router; routing replay needs an MoE model")
    parents = {id(m.gate): m for m in model.modules() if isinstance(getattr(m, "gate", None), nn.Module)}
    handles = []
    try:
        for layer, router in enumerate(routers):
            block = _Block()
            parent = parents.get(id(router))
            if parent is not None:

                def pre(module: nn.Module, args: tuple, block: _Block = block) -> None:
                    if args and isinstance(args[0], Tensor) and args[0].dim() == 3:
                        block.shape = (args[0].shape[0], args[0].shape[1])

                handles.append(parent.register_forward_pre_hook(pre))
            handles.append(
                router.register_forward_hook(_route_hook(layer, router, forced, recorder, stats, block))
            )
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def record_routing(model: nn.Module, recorder: RoutingRecorder | None = None) -> Iterator[RoutingRecorder]:
    """Record the experts every router picks during the forwards run inside the block.

    Hooks run in registration order: to record the routes a replay actually used, pass ``record=``
    to :func:`replay_routing` instead of nesting the two.
    """
    routers = find_routers(model)
    if not routers:
        raise ValueError(f"{type(model).__name__} has no top-k MoE router; nothing to record")
    rec = recorder if recorder is not None else RoutingRecorder(n_layers=len(routers))
    with _hooks(model, None, rec, None):
        yield rec


@contextmanager
def replay_routing(
    model: nn.Module,
    routes: Tensor,
    record: RoutingRecorder | None = None,
    stats: ReplayStats | None = None,
) -> Iterator[ReplayStats]:
    """Force ``routes`` ([B, T, layers, top_k], -1 = route freely) in forwards inside the block.

    ``record`` (optional) captures the routes actually used (forced ones, free ones where -1);
    the yielded :class:`ReplayStats` counts how often the model's own choice differed.
    """
    shape = routing_shape(model)
    if shape is None:
        raise ValueError(f"{type(model).__name__} has no top-k MoE router; routing replay needs an MoE model")
    if routes.dim() != 4 or tuple(routes.shape[2:]) != shape:
        raise ValueError(
            f"routes of shape {tuple(routes.shape)} do not fit this model: expected [batch, seq, {shape[0]} "
            f"layers, top_k {shape[1]}]"
        )
    st = stats if stats is not None else ReplayStats()
    with _hooks(model, routes.long(), record, st):
        yield st


def routes_tensor(rows: list[list[list[list[int]]] | None], length: int, n_layers: int, top_k: int) -> Tensor:
    """Right-padded [B, length, layers, top_k] routes from per-sequence lists; None rows are all -1."""
    out = torch.full((len(rows), length, n_layers, top_k), PAD_ROUTE, dtype=torch.long)
    for i, r in enumerate(rows):
        if r is None or len(r) == 0:
            continue
        t = torch.tensor(r, dtype=torch.long)
        if t.dim() != 3 or tuple(t.shape[1:]) != (n_layers, top_k) or t.shape[0] > length:
            raise ValueError(
                f"routed_experts of row {i} has shape {tuple(t.shape)}; expected [<= {length} tokens, "
                f"{n_layers} layers, {top_k} top_k] for this model"
            )
        out[i, : t.shape[0]] = t
    return out
