"""Shared-prefix training: forward a prompt shared by several sequences once, not once per sequence.

Rollouts of one group share their first prompt (a harness's system prompt, tool schemas, the task:
often thousands of tokens; docs/design.md, "Harness prompts are long"). Sequences of a micro-batch whose
token ids start with the same ``length`` tokens form a ``PrefixGroup``: the prefix is forwarded once
(batch 1) into a KV cache, the cache is repeated along the batch dimension, and the continuations
(right-padded, positions offset by ``length``) attend to it. Exact, not an approximation: a causal
prefix does not depend on what follows it, and autograd through the repeated cache sums the
continuations' gradients into the prefix, which is what per-sequence training computes.

The prefix is cut before the token that predicts a sequence's first loss token, so every trained
logit lives in a continuation and the prefix forward needs no lm_head at all.

Fallbacks (``Trainer.shared_prefix`` is the effective switch; each gives the per-sequence path):
- no group found (no common prefix of ``min_len`` tokens before the first loss token);
- a model without HF ``logits_to_keep``, a KV-cache argument and ``base_model`` (``supports``);
- routing replay (routes are recorded and forced per padded position of the whole sequence);
- FSDP (the prefix forward calls the inner model, bypassing the root unit's hooks);
- gradient checkpointing (HF turns the KV cache off while checkpointing in train mode).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from legorl.records import TrainingSequence
from legorl.train import fast_forward
from legorl.train.logprobs import sequence_logprobs, token_logprobs_and_entropy

MIN_SHARED_PREFIX = 64  # tokens; a shorter shared prefix saves less than an extra forward costs


@dataclass(frozen=True)
class PrefixGroup:
    """Sequences sharing their first ``length`` token ids. ``members`` are sequence indices in a
    batch when planning, row numbers of a collated micro-batch in ``Micro.groups``."""

    members: tuple[int, ...]
    length: int


# ---- detection ------------------------------------------------------------------------------


def shareable(seq: TrainingSequence) -> int:
    """How many leading tokens may be shared: up to (not including) the token whose logit predicts
    the first loss token, and never the whole sequence (a continuation needs one token)."""
    first = next((t for t in range(1, len(seq.loss_mask)) if seq.loss_mask[t]), len(seq.token_ids))
    return first - 1


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def find_groups(
    seqs: list[TrainingSequence], indices: list[int], min_len: int = MIN_SHARED_PREFIX
) -> list[PrefixGroup]:
    """Groups of ``indices`` worth forwarding with a shared prefix (the rest stay per-sequence).

    In lexicographic order, the common prefix of a run of sequences is the minimum of its
    neighbours' common prefixes, so the runs form a tree (cut at the weakest link); each run is
    either one group or split further, whichever forwards fewer tokens.
    """
    cand = [i for i in indices if shareable(seqs[i]) >= min_len]
    order = sorted(cand, key=lambda i: seqs[i].token_ids)
    links = [_lcp(seqs[a].token_ids, seqs[b].token_ids) for a, b in pairwise(order)]
    lengths = [len(seqs[i].token_ids) for i in order]
    limits = [shareable(seqs[i]) for i in order]
    _, groups = _best(order, links, lengths, limits, min_len)
    return groups


def _best(
    order: list[int], links: list[int], lengths: list[int], limits: list[int], min_len: int
) -> tuple[int, list[PrefixGroup]]:
    """(tokens forwarded, groups) of the cheapest grouping of a lexicographic run."""
    if len(order) < 2:
        return sum(lengths), []
    p = min(min(links), min(limits))
    whole = p + sum(n - p for n in lengths) if p >= min_len else math.inf
    weakest = min(links)
    cuts = [0] + [j + 1 for j, link in enumerate(links) if link == weakest] + [len(order)]
    split_cost, split_groups = 0, []
    for a, b in pairwise(cuts):  # every part is smaller: the recursion ends
        c, g = _best(order[a:b], links[a : b - 1], lengths[a:b], limits[a:b], min_len)
        split_cost += c
        split_groups += g
    if whole <= split_cost:
        return int(whole), [PrefixGroup(tuple(order), p)]
    return split_cost, split_groups


# ---- the forward ----------------------------------------------------------------------------


def _params(model: torch.nn.Module) -> Sequence[str]:
    try:
        return list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return []


def _cache_kw(model: torch.nn.Module) -> str | None:
    """The KV-cache argument's name: ``cache`` since transformers 5.2x, ``past_key_values`` before."""
    params = _params(model)
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def supports(model: torch.nn.Module) -> bool:
    """A HF causal LM this module can drive: logits_to_keep, a KV cache, position ids, an inner model."""
    params = _params(model)
    base = getattr(model, "base_model", model)
    return (
        "logits_to_keep" in params
        and "position_ids" in params
        and _cache_kw(model) is not None
        and base is not model
        and _cache_kw(base) is not None
    )


def _cache_of(out: object) -> object:
    for name in ("cache", "past_key_values"):
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    raise RuntimeError(f"{type(out).__name__} returned no KV cache; the shared-prefix path needs one")


Part = tuple[Tensor, Tensor, Tensor, Tensor]  # rows, cols, logp, entropy at kept (loss) positions


def shared_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    groups: Sequence[PrefixGroup],
    temperature: float,
    top_p: float = 1.0,
    entropy_grad: bool = False,
    top_k: int = 0,
    fast: bool = False,
) -> tuple[Tensor, Tensor]:
    """``sequence_logprobs`` (with ``loss_mask``) of a right-padded batch whose ``groups`` (row
    numbers) share a prefix: same [B, T-1] outputs, 0 off the loss mask; rows in no group run the
    per-sequence path. Without groups, or for a model ``supports`` rejects, it IS that path.
    ``fast``: every forward runs train/fast_forward.py (prefixes through its ``prefix_cache``)."""
    kw = {"temperature": temperature, "top_p": top_p, "entropy_grad": entropy_grad, "top_k": top_k}
    if not groups or not supports(model):
        return sequence_logprobs(model, input_ids, attention_mask, loss_mask=loss_mask, fast=fast, **kw)
    grouped = {r for g in groups for r in g.members}
    rest = [r for r in range(input_ids.shape[0]) if r not in grouped]
    kw["fast"] = fast
    parts = [_group_part(model, input_ids, attention_mask, loss_mask, g, kw) for g in groups]
    if rest and bool(loss_mask[rest].any()):
        parts.append(_rest_part(model, input_ids, attention_mask, loss_mask, rest, kw))
    rows, cols, lp, ent = (torch.cat(x) for x in zip(*parts))
    logp = lp.new_zeros(loss_mask.shape).index_put((rows, cols), lp)
    entropy = ent.new_zeros(loss_mask.shape).index_put((rows, cols), ent)
    return logp, entropy


def _rest_part(
    model: torch.nn.Module, ids: Tensor, attn: Tensor, loss_mask: Tensor, rest: list[int], kw: dict
) -> Part:
    """Rows outside every group, forwarded together as today (trimmed to their own longest row)."""
    idx = torch.tensor(rest, device=ids.device)
    length = int(attn[idx].sum(1).max())
    mask = loss_mask[idx, : length - 1]
    logp, ent = sequence_logprobs(model, ids[idx, :length], attn[idx, :length], loss_mask=mask, **kw)
    r, c = mask.nonzero(as_tuple=True)
    return idx[r], c, logp[r, c], ent[r, c]


def _group_part(
    model: torch.nn.Module, ids: Tensor, attn: Tensor, loss_mask: Tensor, g: PrefixGroup, kw: dict
) -> Part:
    """The prefix once (batch 1, no lm_head), then the continuations against its repeated KV cache."""
    idx = torch.tensor(g.members, device=ids.device)
    p, k = g.length, len(g.members)
    if bool(loss_mask[idx, :p].any()):  # their logits would come from the prefix, which has none
        raise ValueError(f"prefix group {g}: loss tokens within the first {p + 1} tokens (see shareable)")
    width = int(attn[idx].sum(1).max()) - p  # the longest continuation
    cont = ids[idx, p : p + width]
    # Continuation position j predicts token p + j + 1, i.e. loss-mask column p + j; one zero
    # column past the end covers the longest row's last position (it predicts nothing).
    keep = F.pad(loss_mask[idx], (0, 1))[:, p : p + width]
    targets = F.pad(ids[idx], (0, 1))[:, p + 1 : p + width + 1]
    if kw.get("fast"):  # train/fast_forward.py: the prefix's k/v, then the continuations against them
        past = fast_forward.prefix_cache(model, ids[idx[:1], :p])
        logits = fast_forward.logits_at(model, cont, keep, past=past)
    else:
        prefix = model.base_model(input_ids=ids[idx[:1], :p], use_cache=True)
        cache = _cache_of(prefix)
        cache.batch_repeat_interleave(k)  # differentiable: the prefix gets the sum of k gradients
        cont_attn = torch.cat([attn.new_ones(k, p), attn[idx, p : p + width]], dim=1)
        positions = torch.arange(p, p + width, device=ids.device).unsqueeze(0).expand(k, -1)
        out = model(
            input_ids=cont,
            attention_mask=cont_attn,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=keep,
            **{_cache_kw(model): cache},
        )
        logits = out.logits.reshape(-1, out.logits.shape[-1])  # [n_kept, vocab], row-major like keep
    lp, ent = token_logprobs_and_entropy(
        logits, targets[keep], kw["temperature"], kw["top_p"], kw["entropy_grad"], kw["top_k"]
    )
    r, c = keep.nonzero(as_tuple=True)
    return idx[r], c + p, lp, ent
