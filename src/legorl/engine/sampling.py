"""Sampling, and THE definition of a sampled token's logprob (the trainer imports it from here).

Logprob definition (sampler and trainer must agree;
docs/design.md, "Sampler/trainer mismatch and its bounds"):

- ``temperature == 0`` (greedy): the token is ``argmax(logits)`` and its logprob is
  ``log_softmax(logits)[token]`` (raw, unscaled logits; top_k and top_p are ignored).
- ``temperature > 0``: start from ``log_softmax(logits / temperature)``; then, in this order
  (the order vLLM and SGLang use):

  1. ``top_k > 0``: keep the ``top_k`` most likely tokens (ties broken by the sort) and
     renormalise over them;
  2. ``top_p < 1``: keep the nucleus of that distribution (the smallest set of most likely
     tokens whose probability reaches ``top_p``; the top token is always kept) and renormalise.

  The sampled token is drawn from the resulting distribution and its logprob is that
  distribution's value at the token (so a token outside top-k / the nucleus has ``-inf``).

``token_logprobs(logits, ids, temperature, top_p, top_k)`` computes exactly this for a whole
sequence, so a trainer recomputing logprobs from a full forward pass matches the engine up to
float noise. ``sampling_logprobs`` also accepts per-row tensors for the three parameters (the
engine samples a whole batch of requests with different parameters in one call).
"""

from __future__ import annotations

import torch

Param = float | int | torch.Tensor


def sampling_logprobs(
    logits: torch.Tensor, temperature: Param, top_p: Param = 1.0, top_k: Param = 0
) -> torch.Tensor:
    """Log-probabilities of the distribution actually sampled from; logits [..., vocab] (fp32).

    Scalars follow the definition above. Tensor parameters broadcast against ``logits[..., :1]``
    (e.g. shape [batch, 1]); a tensor ``temperature`` must be > 0 everywhere (pass 1.0, top_p 1 and
    top_k 0 for greedy rows: that is the raw log_softmax of the definition).
    """
    logits = logits.float()
    if not isinstance(temperature, torch.Tensor) and temperature <= 0:
        return torch.log_softmax(logits, dim=-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    vocab = logp.shape[-1]
    need_k = (
        bool(((top_k > 0) & (top_k < vocab)).any()) if isinstance(top_k, torch.Tensor) else 0 < top_k < vocab
    )
    need_p = bool((top_p < 1.0).any()) if isinstance(top_p, torch.Tensor) else top_p < 1.0
    if not (need_k or need_p):
        return logp
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True)
    if need_k:
        k = torch.as_tensor(top_k, device=logp.device)
        k = torch.where(k > 0, k, vocab)
        rank = torch.arange(vocab, device=logp.device)
        sorted_logp = sorted_logp.masked_fill(rank >= k, float("-inf"))
        sorted_logp = sorted_logp - torch.logsumexp(sorted_logp, dim=-1, keepdim=True)
    if need_p:
        p = torch.as_tensor(top_p, dtype=logp.dtype, device=logp.device)
        p = torch.where(p >= 1.0, float("inf"), p)  # rows without a nucleus never drop (cumsum noise)
        probs = sorted_logp.exp()
        # Mass strictly before each token: a token stays while the mass before it is < top_p, which
        # keeps the smallest prefix reaching top_p and always the most likely token.
        before = torch.cumsum(probs, dim=-1) - probs
        sorted_logp = sorted_logp.masked_fill(before >= p, float("-inf"))
        sorted_logp = sorted_logp - torch.logsumexp(sorted_logp, dim=-1, keepdim=True)
    return torch.empty_like(logp).scatter_(-1, order, sorted_logp)


def token_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0
) -> torch.Tensor:
    """Logprob of ``ids`` under the sampling distribution; logits [..., T, V], ids [..., T].

    ``logits[..., t, :]`` must be the prediction for ``ids[..., t]`` (i.e. already shifted).
    """
    logp = sampling_logprobs(logits, temperature, top_p, top_k)
    return logp.gather(-1, ids.unsqueeze(-1).long()).squeeze(-1)


def sample_token(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
) -> tuple[int, float]:
    """Sample one token from a [vocab] logits row; returns (token id, its logprob)."""
    logp = sampling_logprobs(logits, temperature, top_p, top_k)
    if temperature <= 0:
        tok = int(torch.argmax(logp))
    else:
        tok = int(torch.multinomial(logp.exp(), 1, generator=generator))
    return tok, float(logp[tok])


class BatchParams:
    """Per-row sampling parameters of a batch, as tensors (rebuilt only when rows change)."""

    def __init__(
        self, temperature: list[float], top_p: list[float], top_k: list[int], device: torch.device
    ) -> None:
        greedy = [t <= 0 for t in temperature]
        self.all_greedy = all(greedy)
        self.any_greedy = any(greedy)
        # No row truncates (top-k / nucleus): the distribution is log_softmax(logits / temperature).
        self.plain = all(g or (k <= 0 and p >= 1.0) for g, k, p in zip(greedy, top_k, top_p, strict=True))
        self.greedy = torch.tensor(greedy, device=device)
        self.temperature = torch.tensor(
            [1.0 if g else t for g, t in zip(greedy, temperature, strict=True)], device=device
        ).unsqueeze(1)
        self.top_p = torch.tensor(
            [1.0 if g else p for g, p in zip(greedy, top_p, strict=True)], device=device
        ).unsqueeze(1)
        self.top_k = torch.tensor(
            [0 if g else k for g, k in zip(greedy, top_k, strict=True)], device=device
        ).unsqueeze(1)


def sample_batch(
    logits: torch.Tensor, params: BatchParams, uniforms: list[float]
) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` [batch, vocab] with per-row parameters.

    Sampled rows use inverse-CDF sampling with the row's own uniform draw in [0, 1) (each request
    owns its random stream, so a seeded request samples the same tokens alone or in any batch);
    greedy rows take the argmax and ignore their draw. Logprobs follow the module's definition.
    """
    if params.all_greedy:
        logp = torch.log_softmax(logits.float(), dim=-1)
        tokens = torch.argmax(logp, dim=-1)
    else:
        if params.plain:  # the definition's first step is all there is (same ops as sampling_logprobs)
            logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
        else:
            logp = sampling_logprobs(logits, params.temperature, params.top_p, params.top_k)
        cdf = torch.cumsum(logp.double().exp(), dim=-1)
        u = torch.tensor(uniforms, dtype=torch.float64, device=logits.device).unsqueeze(1)
        # First index whose cumulative mass exceeds u * total: always a token with positive mass.
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=logp.shape[-1] - 1).squeeze(1)
        tokens = torch.where(params.greedy, torch.argmax(logp, dim=-1), drawn) if params.any_greedy else drawn
    lps = logp.gather(-1, tokens.unsqueeze(1)).squeeze(1)
    return tokens.tolist(), lps.tolist()
