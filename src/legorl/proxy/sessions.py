"""Per-rollout proxy sessions: unguessable tokens, call history, what went wrong.

A rollout's session is its main agent's. A request the harness names as a side call (`call_kind`: a
title, a next-speaker check, a sub-agent) goes to a side session of that name under the same token:
its own history and token chain, its own counters, so it neither forks the agent's sequence nor
counts against its turn limit. Every session of a rollout draws call indices from one counter.

A session is opened with the engine that serves it (the policy, a frozen checkpoint, a teacher, a
fault-injecting wrapper); its side sessions are served by the same engine. Nothing swaps it.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from legorl.engine.base import Engine
from legorl.proxy.bridge import PastCall
from legorl.records import MAIN_SESSION

_SESSION_ID = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")


@dataclass
class CallIndex:
    """The next call index of a rollout, shared by its main and side sessions."""

    next: int = 0  # a call recorded takes it; an abandoned attempt leaves it to its retry


# Names a request's session from its body, as the harness sent it: MAIN_SESSION or a side session's name.
CallKind = Callable[[dict[str, Any]], str]


@dataclass
class Session:
    token: str
    rollout_id: str
    engine: Engine  # serves every call of this session (and of its side sessions)
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
    malformed_tool_calls: int = 0  # completions that attempted a tool call that did not parse (answered as text)
    reasoning_dropped: int = 0  # calls that started a new segment because past reasoning was not rendered again
    max_calls: int | None = None  # the harness's turn limit, where the harness has none of its own
    kind: str = MAIN_SESSION
    call_kind: CallKind | None = None  # main session: which session each request belongs to (None: all main)
    sides: dict[str, Session] = field(default_factory=dict)  # main session: its side sessions by name
    index: CallIndex = field(default_factory=CallIndex)

    def route(self, body: dict[str, Any]) -> Session:
        """The session a request belongs to: this one, or the side session `call_kind` names (opened on first use)."""
        kind = self.call_kind(body) if self.call_kind is not None else MAIN_SESSION
        if kind == MAIN_SESSION:
            return self
        side = self.sides.get(kind)
        if side is None:
            side = self.sides[kind] = Session(token=self.token, rollout_id=self.rollout_id, engine=self.engine,
                                              kind=kind, index=self.index)
        return side


def body_key(raw: bytes) -> str:
    """Identity of a request body: an SDK retry re-sends the same bytes."""
    return hashlib.sha256(raw).hexdigest()


class SessionRegistry:
    def __init__(self, new_sessions: Engine | None = None):
        self.new_sessions = new_sessions  # standalone proxy: a new id opens a session served by it, on first use
        self._by_token: dict[str, Session] = {}
        self.closed: list[Session] = []  # kept for run statistics (counters only matter)

    def open(self, rollout_id: str, engine: Engine, max_calls: int | None = None,
             call_kind: CallKind | None = None) -> Session:
        token = secrets.token_urlsafe(24)
        s = Session(token=token, rollout_id=rollout_id, engine=engine, max_calls=max_calls, call_kind=call_kind)
        self._by_token[token] = s
        return s

    def get(self, token: str | None) -> Session | None:
        if not token:
            return None
        s = self._by_token.get(token)
        if s is None and self.new_sessions is not None and _SESSION_ID.match(token):
            s = Session(token=token, rollout_id=token, engine=self.new_sessions)
            self._by_token[token] = s
        if s is not None and s.closed:
            return None
        return s

    def find(self, token: str | None) -> Session | None:
        """An open session, never one opened on first use (a models listing opens none)."""
        s = self._by_token.get(token or "")
        return s if s is not None and not s.closed else None

    def close(self, token: str) -> Session | None:
        s = self._by_token.pop(token, None)
        if s is not None:
            for x in (s, *s.sides.values()):
                x.closed = True
                x.answered.clear()
                x.responses.clear()
            self.closed.append(_counters_only(s))
        return s

    def all(self) -> list[Session]:
        return [*self.closed, *self._by_token.values()]


def _counters_only(s: Session) -> Session:
    return Session(token=s.token, rollout_id=s.rollout_id, engine=s.engine, n_calls=s.n_calls, errors=list(s.errors),
                   closed=True, segments=s.segments, bridge_hits=s.bridge_hits,
                   drift_prevented=s.drift_prevented, retries_answered=s.retries_answered, kind=s.kind,
                   malformed_tool_calls=s.malformed_tool_calls, reasoning_dropped=s.reasoning_dropped,
                   sides={k: _counters_only(x) for k, x in s.sides.items()})
