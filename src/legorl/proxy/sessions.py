"""Per-rollout proxy sessions: unguessable tokens, call history, what went wrong."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from legorl.proxy.bridge import PastCall


@dataclass
class Session:
    token: str
    rollout_id: str
    history: list[PastCall] = field(default_factory=list)
    n_calls: int = 0
    # Answers already given, keyed by request-body hash: SDK retries get the
    # recorded answer instead of a second sample that would fork the rollout.
    answered: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # "context_overflow" | "engine_error" | ...
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time keeps the chain ordered
    closed: bool = False


def body_key(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


class SessionRegistry:
    def __init__(self, accept_new: bool = False):
        self.accept_new = accept_new  # standalone proxy: a new id opens a session on first use
        self._by_token: dict[str, Session] = {}

    def open(self, rollout_id: str) -> Session:
        token = secrets.token_urlsafe(24)
        s = Session(token=token, rollout_id=rollout_id)
        self._by_token[token] = s
        return s

    def get(self, token: str | None) -> Session | None:
        if not token:
            return None
        s = self._by_token.get(token)
        if s is None and self.accept_new:
            s = Session(token=token, rollout_id=token)
            self._by_token[token] = s
        if s is not None and s.closed:
            return None
        return s

    def close(self, token: str) -> Session | None:
        s = self._by_token.pop(token, None)
        if s is not None:
            s.closed = True
        return s
