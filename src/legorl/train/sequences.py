"""Turn a rollout's recorded LLM calls into token-exact training sequences.

Calls are merged while each prompt starts with the tokens of an open sequence
(its parent's prompt + completion, plus any bridging tokens the proxy rendered),
so a k-turn conversation trains as ONE sequence instead of k (O(turns) compute,
not O(turns^2)). Sampled tokens are never re-tokenized: the sequence is made of
the recorded ids, and the loss mask is 1 only on tokens the policy sampled.

Several open sequences are kept, not just the latest, so that interleaved
conversations (e.g. a sub-agent's calls between two main-agent turns) still merge
into their own chains instead of restarting from scratch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from legorl.records import ABANDONED, LLMCall, Rollout, TrainingSequence

PAD_ROUTE = -1  # same sentinel as legorl.models.routing (kept torch-free here)


@dataclass
class _Open:
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    call_indices: list[int] = field(default_factory=list)
    # Per-token routes (None = not recorded); the first call that contained a position wins, so
    # sampled tokens keep the routing of the call that sampled them (R3 replays sampling-time routes).
    routes: list[list[list[int]] | None] = field(default_factory=list)


def _check(call: LLMCall) -> None:
    if len(call.completion_ids) != len(call.completion_logprobs):
        raise ValueError(
            f"call {call.index} of rollout {call.rollout_id}: {len(call.completion_ids)} completion ids "
            f"but {len(call.completion_logprobs)} logprobs; the capture is invalid, mark the rollout "
            "invalid_capture instead of training on it"
        )


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def _call_routes(call: LLMCall) -> list[list[list[int]] | None]:
    """Routes of prompt + completion, one entry per token; None where the engine recorded none.

    Engines usually have no route for the last sampled token (it is never fed back) and, with a
    prefix cache, none for cached prompt tokens; such positions become -1 rows ("route freely")
    when the sequence is materialised. Routes longer than the call are not trusted at all.
    """
    n = len(call.prompt_ids) + len(call.completion_ids)
    r = call.routed_experts
    if r is None or len(r) > n:
        return [None] * n
    return [row if _recorded(row) else None for row in r] + [None] * (n - len(r))


def _recorded(row: list[list[int]]) -> bool:
    return bool(row) and any(x >= 0 for layer in row for x in layer)


def _materialise(routes: list[list[list[int]] | None]) -> list[list[list[int]]] | None:
    """[tokens][layers][top_k] with -1 rows (the padding sentinel, never expert 0) for gaps."""
    known = next((row for row in routes if row is not None), None)
    if known is None:
        return None
    gap = [[PAD_ROUTE] * len(known[0]) for _ in known]
    return [row if row is not None else [list(x) for x in gap] for row in routes]


def build_sequences(
    rollout_id: str,
    calls: list[LLMCall],
    advantage: float,
    include_unsampled: bool = False,
    untrained: Collection[int] = (),
) -> list[TrainingSequence]:
    """Merge a rollout's calls into token-exact sequences.

    Loss mask is 1 on completion tokens of calls sampled from the policy (and, with
    ``include_unsampled`` for SFT, of every call but those in ``untrained``: a teacher's deliberate
    slips); prompt and bridging tokens get 0.
    Rollout logprobs are aligned to token_ids and 0.0 where the mask is 0.
    Sequences without any loss token are dropped (they carry no signal).
    """
    open_seqs: list[_Open] = []
    owner: dict[int, _Open] = {}  # call index -> the sequence that holds it
    for call in sorted(calls, key=lambda c: c.index):
        if call.finish_reason == ABANDONED:  # never answered (the client went away): nothing sampled to train
            continue
        _check(call)
        trained = (call.sampled_from_policy or include_unsampled) and call.index not in untrained
        n_c = len(call.completion_ids)
        c_mask = [1 if trained else 0] * n_c
        c_lp = [float(x) for x in call.completion_logprobs] if trained else [0.0] * n_c
        target = None
        if call.segment_break is None:
            # Prefer the parent's chain, then the longest open chain that is a prefix.
            parent = owner.get(call.parent_index) if call.parent_index is not None else None
            candidates = ([parent] if parent is not None else []) + sorted(
                open_seqs, key=lambda s: -len(s.token_ids)
            )
            target = next((s for s in candidates if _is_prefix(s.token_ids, call.prompt_ids)), None)
        routes = _call_routes(call)
        if target is None:
            target = _Open(
                token_ids=list(call.prompt_ids) + list(call.completion_ids),
                loss_mask=[0] * len(call.prompt_ids) + c_mask,
                logprobs=[0.0] * len(call.prompt_ids) + c_lp,
                routes=routes,
            )
            open_seqs.append(target)
        else:
            start = len(target.token_ids)
            bridge = list(call.prompt_ids[start:])
            target.token_ids += bridge + list(call.completion_ids)
            target.loss_mask += [0] * len(bridge) + c_mask
            target.logprobs += [0.0] * len(bridge) + c_lp
            # Positions already held keep their earlier route; prompt positions the parent never
            # routed (the parent's last sampled token) take this call's prefill route when recorded.
            target.routes = [a if a is not None else b for a, b in zip(target.routes, routes)]
            target.routes += routes[start:]
        target.call_indices.append(call.index)
        owner[call.index] = target

    kept = [s for s in open_seqs if any(s.loss_mask)]
    return [
        TrainingSequence(
            rollout_id=rollout_id,
            token_ids=s.token_ids,
            loss_mask=s.loss_mask,
            rollout_logprobs=s.logprobs,
            advantage=float(advantage),
            n_sequences_in_rollout=len(kept),
            routed_experts=_materialise(s.routes),
        )
        for s in kept
    ]


def build_batch(
    rollouts: list[Rollout], advantages: list[float | None], include_unsampled: bool = False
) -> list[TrainingSequence]:
    """Sequences of many rollouts (with their calls loaded); a None advantage (masked) is skipped."""
    if len(rollouts) != len(advantages):
        raise ValueError(f"{len(rollouts)} rollouts but {len(advantages)} advantages")
    out: list[TrainingSequence] = []
    for r, adv in zip(rollouts, advantages):
        if adv is not None:
            out += build_sequences(r.id, r.calls, adv, include_unsampled)
    return out


def merge_stats(calls: list[LLMCall], sequences: list[TrainingSequence]) -> dict[str, float]:
    """How much merging saved: compression = tokens trained / tokens if every call were its own sample."""
    unmerged = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    trained = sum(len(s.token_ids) for s in sequences)
    return {
        "calls": float(len(calls)),
        "sequences": float(len(sequences)),
        "tokens_trained": float(trained),
        "tokens_unmerged": float(unmerged),
        "loss_tokens": float(sum(sum(s.loss_mask) for s in sequences)),
        "compression": trained / unmerged if unmerged else 1.0,
    }
