"""Prefix cache: the KV of finished sequences, reused by prompts that start with the same tokens.

An agent turn's prompt is the previous turn's prompt + completion + the new messages (the
proxy's token bridge guarantees it token for token), and the samples of a GRPO group share their
first prompt. The engine stores each finished sequence's KV here; a new request takes the entry
with the longest common token prefix and only prefills the rest.

Entries are immutable tensors owned by the cache. An entry whose tokens are a prefix of a newer
entry's tokens is dropped (the newer one serves every request it could). Memory is bounded in
bytes; least recently used entries go first. The cache is cleared on every weight update, so KV
computed under one weight version never serves another.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(eq=False)
class PrefixEntry:
    tokens: torch.Tensor  # [n] int64, on CPU
    k: Any  # backend-specific KV block covering exactly these tokens
    v: Any
    routes: torch.Tensor | None
    nbytes: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D int tensors."""
    n = min(int(a.shape[0]), int(b.shape[0]))
    if n == 0 or int(a[0]) != int(b[0]):
        return 0
    neq = (a[:n] != b[:n]).nonzero()
    return n if neq.numel() == 0 else int(neq[0, 0])


class PrefixCache:
    """LRU of PrefixEntry, bounded by ``max_bytes`` (0 disables the cache)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[int, PrefixEntry] = collections.OrderedDict()
        self._next = 0
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def match(self, prompt: torch.Tensor, limit: int) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` (at most ``limit`` tokens) and that length.

        The entry found becomes the most recently used."""
        best_key, best_n = None, 0
        for key, entry in self._entries.items():
            n = min(common_prefix(entry.tokens, prompt), limit)
            if n > best_n:
                best_key, best_n = key, n
        if best_key is None:
            return None, 0
        self._entries.move_to_end(best_key)
        return self._entries[best_key], best_n

    def would_store(self, tokens: torch.Tensor, nbytes: int) -> bool:
        """False when storing is pointless: too big, or an existing entry already covers ``tokens``."""
        if self.max_bytes <= 0 or nbytes > self.max_bytes or tokens.shape[0] == 0:
            return False
        n = int(tokens.shape[0])
        return not any(len(e) >= n and common_prefix(e.tokens, tokens) == n for e in self._entries.values())

    def add(self, entry: PrefixEntry) -> None:
        for key in [
            k
            for k, e in self._entries.items()
            if len(e) <= len(entry) and common_prefix(e.tokens, entry.tokens) == len(e)
        ]:
            self.nbytes -= self._entries.pop(key).nbytes
        self._entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
