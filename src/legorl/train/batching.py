"""Mini-batches (one optimizer step each), micro-batches (one forward each) and collation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from legorl.models.routing import routes_tensor
from legorl.records import TrainingSequence
from legorl.train.prefix import PrefixGroup


def mini_batches(seqs: list[TrainingSequence], n: int) -> list[list[int]]:
    """Split sequence indices into at most ``n`` mini-batches, keeping each rollout whole.

    A rollout's sequences share its per-rollout normalisation, so they are never split apart.
    Rollouts are dealt greedily (largest first) to the mini-batch with the fewest tokens; the
    split is deterministic, so the old-logprob pass and the update passes see the same batches.
    """
    if n < 1:
        raise ValueError(f"mini_batches must be >= 1, got {n}")
    by_rollout: dict[str, list[int]] = {}
    for i, s in enumerate(seqs):
        by_rollout.setdefault(s.rollout_id, []).append(i)
    groups = sorted(by_rollout.values(), key=lambda g: -sum(len(seqs[i].token_ids) for i in g))
    bins: list[list[int]] = [[] for _ in range(min(n, len(groups)))]
    sizes = [0] * len(bins)
    for g in groups:
        j = sizes.index(min(sizes))
        bins[j] += g
        sizes[j] += sum(len(seqs[i].token_ids) for i in g)
    return [sorted(b) for b in bins if b]


def micro_batches(seqs: list[TrainingSequence], indices: list[int], budget: int) -> list[list[int]]:
    """Group ``indices`` so that rows x padded length <= ``budget`` tokens.

    Sorting by length keeps padding small; a sequence longer than the budget gets its own batch.
    """
    order = sorted(indices, key=lambda i: -len(seqs[i].token_ids))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        n = len(seqs[i].token_ids)
        new_max = max(cur_max, n)
        if cur and new_max * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, new_max = [], n
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


@dataclass
class _Unit:
    """What micro-batching packs: one sequence (``prefix`` 0) or a prefix group's members."""

    members: list[int]
    prefix: int
    width: int  # the longest member's tokens after the prefix (a single sequence: all of them)


def _cost(units: list[_Unit]) -> int:
    """Tokens a micro-batch forwards: each prefix once plus its padded continuations, plus the single
    sequences as one padded batch (the measure ``micro_batches`` uses)."""
    singles = [u.width for u in units if not u.prefix]
    grouped = sum(u.prefix + len(u.members) * u.width for u in units if u.prefix)
    return grouped + len(singles) * max(singles, default=0)


def _split_group(seqs: list[TrainingSequence], g: PrefixGroup, budget: int) -> list[_Unit]:
    """A group as units within the budget, each recomputing the prefix (still exact). Like a sequence
    longer than the budget, a unit keeps two members even when they overflow; a lone member left
    over runs per-sequence (sharing with nobody saves nothing)."""
    rest = sorted(g.members, key=lambda i: -len(seqs[i].token_ids))
    units: list[_Unit] = []
    while rest:
        width = len(seqs[rest[0]].token_ids) - g.length
        k = max(2, (budget - g.length) // max(width, 1))
        take, rest = rest[:k], rest[k:]
        if len(take) == 1:
            units.append(_Unit(take, 0, len(seqs[take[0]].token_ids)))
        else:
            units.append(_Unit(take, g.length, width))
    return units


def plan_micro_batches(
    seqs: list[TrainingSequence], indices: list[int], budget: int, groups: list[PrefixGroup]
) -> list[tuple[list[int], list[PrefixGroup]]]:
    """``micro_batches`` counting each shared prefix once: (indices, groups) per micro-batch.

    Without groups it is exactly ``micro_batches``. Units (single sequences and groups) are packed
    largest first while the micro-batch's forwarded tokens stay within ``budget``.
    """
    if not groups:
        return [(idx, []) for idx in micro_batches(seqs, indices, budget)]
    grouped = {i for g in groups for i in g.members}
    units = [u for g in groups for u in _split_group(seqs, g, budget)]
    units += [_Unit([i], 0, len(seqs[i].token_ids)) for i in indices if i not in grouped]
    units.sort(key=lambda u: -_cost([u]))
    plan: list[list[_Unit]] = []
    cur: list[_Unit] = []
    for u in units:
        if cur and _cost(cur + [u]) > budget:
            plan.append(cur)
            cur = []
        cur.append(u)
    if cur:
        plan.append(cur)
    return [
        (
            [i for u in us for i in u.members],
            [PrefixGroup(tuple(u.members), u.prefix) for u in us if u.prefix],
        )
        for us in plan
    ]


@dataclass
class Micro:
    """One collated micro-batch, plus what the old-logprob pass computed for it."""

    index: list[int]  # sequence indices (rows)
    input_ids: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    mask: Tensor  # [B, T-1] bool, aligned with logits[:, :-1] (targets input_ids[:, 1:])
    rollout_logp: Tensor  # [B, T-1]
    advantages: Tensor  # [B]
    routes: Tensor | None = None  # [B, T, layers, top_k], -1 = route freely (sampler's routes)
    groups: list[PrefixGroup] = field(default_factory=list)  # shared prefixes; members are row numbers
    cache: dict[str, Tensor] = field(default_factory=dict)  # old_logp, entropy, ref_logp, routes_used


def collate(
    seqs: list[TrainingSequence],
    index: list[int],
    pad_id: int,
    device: torch.device,
    route_shape: tuple[int, int] | None = None,
    groups: Sequence[PrefixGroup] = (),
) -> Micro:
    """Right-padded tensors; targets/mask/logprobs shifted to align with logits[:, :-1].

    With ``route_shape`` (layers, top_k), the sequences' recorded routes are collated too, padded
    with the -1 sentinel (prompt/completion padding and unrecorded positions route freely).
    ``groups`` (sequence indices, all in ``index``) become ``Micro.groups`` (row numbers).
    """
    rows = [seqs[i] for i in index]
    length = max(len(s.token_ids) for s in rows)
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), length), dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.bool)
    rlp = torch.zeros((len(rows), length), dtype=torch.float32)
    for row, s in enumerate(rows):
        n = len(s.token_ids)
        if not (len(s.loss_mask) == len(s.rollout_logprobs) == n):
            raise ValueError(
                f"sequence of rollout {s.rollout_id}: token_ids/loss_mask/rollout_logprobs lengths "
                f"{n}/{len(s.loss_mask)}/{len(s.rollout_logprobs)} differ; rebuild it with build_sequences"
            )
        if s.routed_experts is not None and len(s.routed_experts) != n:
            raise ValueError(
                f"sequence of rollout {s.rollout_id}: {len(s.routed_experts)} routed_experts rows for {n} "
                "tokens; rebuild it with build_sequences"
            )
        ids[row, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attn[row, :n] = 1
        mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        rlp[row, :n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    routes = None
    if route_shape is not None and any(s.routed_experts for s in rows):
        routes = routes_tensor([s.routed_experts for s in rows], length, *route_shape).to(device)
    return Micro(
        index=list(index),
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        mask=mask[:, 1:].to(device),  # the first token is never predicted
        rollout_logp=rlp[:, 1:].to(device),
        advantages=torch.tensor([s.advantage for s in rows], dtype=torch.float32, device=device),
        routes=routes,
        groups=[PrefixGroup(tuple(index.index(i) for i in g.members), g.length) for g in groups],
    )
