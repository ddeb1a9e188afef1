"""Per-token logprob entries in the OpenAI shape ({token, logprob, bytes, top_logprobs}).

Engines return the logprob of each sampled token only, so `top_logprobs` holds the sampled
token as its single entry (documented in docs/proxy.md).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE token characters -> bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenTexts:
    """Token id -> (text, bytes), cached."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def get(self, tid: int) -> tuple[str, list[int]]:
        hit = self._cache.get(tid)
        if hit is not None:
            return hit
        piece = self.tok.convert_ids_to_tokens(tid)
        dec = _byte_decoder()
        if isinstance(piece, str) and tid not in self._special and all(ch in dec for ch in piece):
            raw = bytes(dec[ch] for ch in piece)
        else:
            raw = self.tok.decode([tid], skip_special_tokens=False).encode()
        out = (raw.decode("utf-8", errors="replace"), list(raw))
        self._cache[tid] = out
        return out

    def entries(self, ids: list[int], logprobs: list[float], top: int) -> list[dict[str, Any]]:
        out = []
        for tid, lp in zip(ids, logprobs):
            text, raw = self.get(tid)
            entry: dict[str, Any] = {"token": text, "logprob": lp, "bytes": raw}
            entry["top_logprobs"] = [{"token": text, "logprob": lp, "bytes": raw}] if top > 0 else []
            out.append(entry)
        return out
