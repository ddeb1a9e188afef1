"""Per-token log-probabilities of a sequence under the trainer's model.

MUST match the engine's definition (legorl/engine/sampling.py): logprob =
log_softmax(logits / temperature)[id], restricted and renormalised to the top-p nucleus
when top_p < 1; temperature 0 (greedy) means the raw log_softmax(logits). The
distribution itself is imported from the engine, so there is one definition only. If
sampler and trainer disagreed, the PPO ratio and the IS weights would compare different
distributions and every mismatch metric would lie (LESSONS.md, "Sampler/trainer mismatch").
"""

from __future__ import annotations

import torch
from torch import Tensor

from legorl.engine.sampling import sampling_logprobs

# A sampled token that falls outside the trainer's nucleus has logprob -inf there; floor it so
# ratios and IS weights stay finite (the mismatch metrics then show the disagreement loudly).
LOGP_FLOOR = -1e4


def token_logprobs_and_entropy(
    logits: Tensor, ids: Tensor, temperature: float, top_p: float = 1.0, entropy_grad: bool = False
) -> tuple[Tensor, Tensor]:
    """Logprob of ``ids`` (already shifted to align with ``logits``) and the entropy of the
    sampling distribution (detached unless ``entropy_grad``, for an entropy bonus)."""
    logp_all = sampling_logprobs(logits, temperature, top_p)
    logp = logp_all.gather(-1, ids.unsqueeze(-1).long()).squeeze(-1)
    if top_p < 1.0:
        logp = logp.clamp(min=LOGP_FLOOR)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        p = logp_all.exp()
        # where(): tokens outside the nucleus have p = 0 and logp = -inf (0 * -inf = nan)
        entropy = -torch.where(p > 0, p * logp_all.clamp(min=LOGP_FLOOR), torch.zeros_like(p)).sum(-1)
    return logp, entropy


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float,
    top_p: float = 1.0,
    entropy_grad: bool = False,
    **forward_kwargs: object,
) -> tuple[Tensor, Tensor]:
    """Logprobs of input_ids[:, 1:] given their prefixes, and the entropy at those positions.

    Returns (logp, entropy), both [batch, seq_len - 1] fp32; logp carries gradients.
    Padding must be on the right (positions then need no adjustment).
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **forward_kwargs)
    return token_logprobs_and_entropy(
        out.logits[:, :-1, :], input_ids[:, 1:], temperature, top_p, entropy_grad=entropy_grad
    )
