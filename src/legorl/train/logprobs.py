"""Per-token log-probabilities of a sequence under the trainer's model.

MUST match the engine's definition (legorl/engine/sampling.py: token_logprobs):
logprob = log_softmax(logits / temperature)[id], and temperature 0 (greedy) means
the raw log_softmax(logits). If the two disagree, the PPO ratio and the IS weights
compare different distributions and every mismatch metric lies (LESSONS.md,
"Sampler/trainer mismatch": temperature).
"""

from __future__ import annotations

import torch
from torch import Tensor


def scale_logits(logits: Tensor, temperature: float) -> Tensor:
    """Logits of the sampled distribution, in fp32 (bf16 log_softmax loses ~0.01 nats)."""
    logits = logits.float()
    if temperature and temperature != 1.0:
        logits = logits / temperature
    return logits


def token_logprobs_and_entropy(logits: Tensor, ids: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """logprob of ``ids`` under softmax(logits / T) and the (detached) entropy at each position."""
    logp_all = torch.log_softmax(scale_logits(logits, temperature), dim=-1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float,
    **forward_kwargs: object,
) -> tuple[Tensor, Tensor]:
    """Logprobs of input_ids[:, 1:] given their prefixes, and the entropy at those positions.

    Returns (logp, entropy), both [batch, seq_len - 1] fp32; logp carries gradients.
    Padding must be on the right (positions then need no adjustment).
    """
    out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **forward_kwargs)
    logits = out.logits[:, :-1, :]
    return token_logprobs_and_entropy(logits, input_ids[:, 1:], temperature)
