"""Per-token log-probabilities of a sequence under the trainer's model.

MUST match the engine's definition (legorl/engine/sampling.py): logprob =
log_softmax(logits / temperature)[id], restricted and renormalised to the top-k / top-p
nucleus when set; temperature 0 (greedy) means the raw log_softmax(logits). The
distribution itself is imported from the engine, so there is one definition only. If
sampler and trainer disagreed, the PPO ratio and the IS weights would compare different
distributions and every mismatch metric would lie (docs/design.md, "Sampler/trainer mismatch and its bounds").
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from legorl.engine.sampling import sampling_logprobs
from legorl.train import fast_forward

# A sampled token that falls outside the trainer's nucleus has logprob -inf there; floor it so
# ratios and IS weights stay finite (the mismatch metrics then show the disagreement loudly).
LOGP_FLOOR = -1e4


def token_logprobs_and_entropy(
    logits: Tensor,
    ids: Tensor,
    temperature: float,
    top_p: float = 1.0,
    entropy_grad: bool = False,
    top_k: int = 0,
) -> tuple[Tensor, Tensor]:
    """Logprob of ``ids`` (already shifted to align with ``logits``) and the entropy of the
    sampling distribution (detached unless ``entropy_grad``, for an entropy bonus)."""
    no_nucleus = top_p >= 1.0 and not 0 < top_k < logits.shape[-1]
    if no_nucleus and not (entropy_grad and torch.is_grad_enabled()):
        # sampling_logprobs without a nucleus is log_softmax(logits / temperature) (x / 1.0 is x)
        z = logits.float()
        z = z / temperature if temperature > 0 and temperature != 1.0 else z
        return _TokenLogprob.apply(z, ids.long())
    logp_all = sampling_logprobs(logits, temperature, top_p, top_k)
    logp = logp_all.gather(-1, ids.unsqueeze(-1).long()).squeeze(-1)
    if top_p < 1.0 or top_k > 0:
        logp = logp.clamp(min=LOGP_FLOOR)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        p = logp_all.exp()
        # where(): tokens outside the nucleus have p = 0 and logp = -inf (0 * -inf = nan)
        entropy = -torch.where(p > 0, p * logp_all.clamp(min=LOGP_FLOOR), torch.zeros_like(p)).sum(-1)
    return logp, entropy


class _TokenLogprob(torch.autograd.Function):
    """log_softmax(z)[ids] and the (detached) entropy of softmax(z) in one pass over the vocabulary.

    The same numbers as the autograd path above (gather, exp, where, clamp, sum; then the
    log_softmax and scatter backward), with a third of the vocabulary-sized ops: the softmax is
    kept from the forward and the backward is ``-p * g`` plus ``g`` at each target.
    """

    @staticmethod
    def forward(ctx, z: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        logp_all = torch.log_softmax(z, dim=-1)
        p = logp_all.exp()
        # Finite logits give finite log-probabilities, so this is the where()/clamp() form's value.
        entropy = -(p * logp_all).sum(-1)
        ctx.save_for_backward(p, ids)
        ctx.mark_non_differentiable(entropy)
        return logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1), entropy

    @staticmethod
    def backward(ctx, g: Tensor, _g_entropy: Tensor | None) -> tuple[Tensor, None]:  # type: ignore[override]
        p, ids = ctx.saved_tensors
        dz = p * -g.unsqueeze(-1)
        return dz.scatter_add_(-1, ids.unsqueeze(-1), g.unsqueeze(-1)), None


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float,
    top_p: float = 1.0,
    entropy_grad: bool = False,
    top_k: int = 0,
    loss_mask: Tensor | None = None,
    fast: bool = False,
    **forward_kwargs: object,
) -> tuple[Tensor, Tensor]:
    """Logprobs of input_ids[:, 1:] given their prefixes, and the entropy at those positions.

    Returns (logp, entropy), both [batch, seq_len - 1] fp32; logp carries gradients.
    Padding must be on the right (positions then need no adjustment).

    With ``loss_mask`` ([batch, seq_len - 1], aligned with the result), the lm_head, softmax and
    entropy run only where it is true (HF ``logits_to_keep`` with a boolean mask): prompt and tool
    output tokens, usually most of an agent's sequence, cost no vocabulary-sized work. Elsewhere
    both outputs are 0. ``fast`` (with ``loss_mask``, no ``forward_kwargs``, a model that
    train/fast_forward.py covers): the same logits from fewer tensor ops than the model's modules.
    """
    if loss_mask is not None and _accepts_logits_to_keep(model):
        keep = torch.zeros_like(input_ids, dtype=torch.bool)
        keep[:, :-1] = loss_mask.bool()
        if fast and not forward_kwargs:
            logits = fast_forward.logits_at(model, input_ids, keep)  # [n_kept, vocab]
        else:
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=False,
                logits_to_keep=keep,
                **forward_kwargs,
            )
            logits = out.logits.reshape(-1, out.logits.shape[-1])  # [n_kept, vocab]
        targets = input_ids[:, 1:][loss_mask.bool()]
        lp, ent = token_logprobs_and_entropy(logits, targets, temperature, top_p, entropy_grad, top_k)
        logp = torch.zeros(loss_mask.shape, dtype=lp.dtype, device=lp.device).masked_scatter(
            loss_mask.bool(), lp
        )
        entropy = torch.zeros_like(logp).masked_scatter(loss_mask.bool(), ent)
        return logp, entropy
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **forward_kwargs)
    return token_logprobs_and_entropy(
        out.logits[:, :-1, :], input_ids[:, 1:], temperature, top_p, entropy_grad, top_k
    )
