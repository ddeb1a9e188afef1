"""Sampling, and THE definition of a sampled token's logprob (the trainer imports it from here).

Logprob definition (sampler and trainer must agree, see LESSONS "Sampler/trainer mismatch"):

- ``temperature == 0`` (greedy): the token is ``argmax(logits)`` and its logprob is
  ``log_softmax(logits)[token]`` (raw, unscaled logits).
- ``temperature > 0``: the distribution sampled from is ``log_softmax(logits / temperature)``;
  with ``top_p < 1`` it is restricted to the nucleus (the smallest set of most likely tokens whose
  probability reaches ``top_p``; the top token is always kept) and renormalised over it. The
  logprob is that distribution's value at the sampled token.

``token_logprobs(logits, ids, temperature, top_p)`` computes exactly this for a whole sequence,
so a trainer recomputing logprobs from a full forward pass matches the engine up to float noise.
"""

from __future__ import annotations

import torch


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from; logits [..., vocab] (fp32)."""
    logits = logits.float()
    if temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return logp
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    # Mass strictly before each token: a token stays while the mass before it is < top_p, which
    # keeps the smallest prefix reaching top_p and always the most likely token.
    before = torch.cumsum(sorted_logp.exp(), dim=-1) - sorted_logp.exp()
    drop_sorted = before >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    logp = logp.masked_fill(drop, float("-inf"))
    return logp - torch.logsumexp(logp, dim=-1, keepdim=True)


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, top_p: float = 1.0
) -> torch.Tensor:
    """Logprob of ``ids`` under the sampling distribution; logits [..., T, V], ids [..., T].

    ``logits[..., t, :]`` must be the prediction for ``ids[..., t]`` (i.e. already shifted).
    """
    logp = sampling_logprobs(logits, temperature, top_p)
    return logp.gather(-1, ids.unsqueeze(-1).long()).squeeze(-1)


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[int, float]:
    """Sample one token from a [vocab] logits row; returns (token id, its logprob)."""
    logp = sampling_logprobs(logits, temperature, top_p)
    if temperature <= 0:
        tok = int(torch.argmax(logp))
    else:
        tok = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return tok, float(logp[tok])
