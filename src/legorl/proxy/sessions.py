"""Per-rollout proxy sessions: unguessable tokens, call history, what went wrong."""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from legorl.proxy.bridge import PastCall

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


@dataclass
class Session:
    token: str
    rollout_id: str
    history: list[PastCall] = field(default_factory=list)
    n_calls: int = 0
    # Answers already given, keyed by request-body hash: SDK retries get the
    # recorded answer instead of a second sample that would fork the rollout.
    answered: dict[str, Any] = field(default_factory=dict)
    # Responses API: canonical conversation of each response id, for previous_response_id.
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # "context_overflow" | "engine_error" | ...
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one call at a time keeps the chain ordered
    closed: bool = False
    segments: int = 0
    bridge_hits: int = 0
    drift_prevented: int = 0
    retries_answered: int = 0
    max_calls: int | None = None  # the harness's turn limit, where the harness has none of its own


def body_key(raw: bytes) -> str:
    """Identity of a request body: an SDK retry re-sends the same bytes."""
    return hashlib.sha256(raw).hexdigest()


class SessionRegistry:
    def __init__(self, accept_new: bool = False):
        self.accept_new = accept_new  # standalone proxy: a new id opens a session on first use
        self._by_token: dict[str, Session] = {}
        self.closed: list[Session] = []  # kept for run statistics (counters only matter)

    def open(self, rollout_id: str, max_calls: int | None = None) -> Session:
        token = secrets.token_urlsafe(24)
        s = Session(token=token, rollout_id=rollout_id, max_calls=max_calls)
        self._by_token[token] = s
        return s

    def get(self, token: str | None) -> Session | None:
        if not token:
            return None
        s = self._by_token.get(token)
        if s is None and self.accept_new and _SESSION_ID.match(token):
            s = Session(token=token, rollout_id=token)
            self._by_token[token] = s
        if s is not None and s.closed:
            return None
        return s

    def close(self, token: str) -> Session | None:
        s = self._by_token.pop(token, None)
        if s is not None:
            s.closed = True
            s.answered.clear()
            s.responses.clear()
            self.closed.append(_counters_only(s))
        return s

    def all(self) -> list[Session]:
        return [*self.closed, *self._by_token.values()]


def _counters_only(s: Session) -> Session:
    return Session(token=s.token, rollout_id=s.rollout_id, n_calls=s.n_calls, errors=list(s.errors),
                   closed=True, segments=s.segments, bridge_hits=s.bridge_hits,
                   drift_prevented=s.drift_prevented, retries_answered=s.retries_answered)
