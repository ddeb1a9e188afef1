"""Proxy errors, independent of wire format: each format renders them in its own error shape."""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal[
    "invalid_request", "authentication", "not_found", "too_large", "context_overflow", "engine_error",
]

STATUS: dict[str, int] = {
    "invalid_request": 400, "authentication": 401, "not_found": 404, "too_large": 413,
    "context_overflow": 400, "engine_error": 500,
}


class ProxyError(Exception):
    """A request the proxy answers with a 4xx/5xx error in the caller's wire format."""

    def __init__(self, message: str, kind: ErrorKind = "invalid_request", *, param: str | None = None,
                 status: int | None = None):
        super().__init__(message)
        self.message = message
        self.kind: ErrorKind = kind
        self.param = param
        self.status = status or STATUS[kind]


def openai_error_body(e: ProxyError) -> dict:
    """OpenAI's error shape (Chat Completions and Responses)."""
    type_, code = {
        "invalid_request": ("invalid_request_error", None),
        "authentication": ("invalid_request_error", "invalid_api_key"),
        "not_found": ("invalid_request_error", "not_found"),
        "too_large": ("invalid_request_error", "request_too_large"),
        "context_overflow": ("invalid_request_error", "context_length_exceeded"),
        "engine_error": ("server_error", None),
    }[e.kind]
    return {"error": {"message": e.message, "type": type_, "param": e.param, "code": code}}


def anthropic_error_body(e: ProxyError) -> dict:
    """Anthropic's error shape: {"type": "error", "error": {"type": ..., "message": ...}}."""
    type_ = {
        "invalid_request": "invalid_request_error", "authentication": "authentication_error",
        "not_found": "not_found_error", "too_large": "request_too_large",
        "context_overflow": "invalid_request_error", "engine_error": "api_error",
    }[e.kind]
    return {"type": "error", "error": {"type": type_, "message": e.message}}


GOOGLE_STATUS = {
    "invalid_request": "INVALID_ARGUMENT", "authentication": "UNAUTHENTICATED", "not_found": "NOT_FOUND",
    "too_large": "INVALID_ARGUMENT", "context_overflow": "INVALID_ARGUMENT", "engine_error": "INTERNAL",
}


def gemini_error_body(e: ProxyError) -> dict:
    """Google's error shape: {"error": {"code", "message", "status"}}, the field at fault in `details`."""
    err: dict = {"code": e.status, "message": e.message, "status": GOOGLE_STATUS[e.kind]}
    if e.param:
        err["details"] = [{"@type": "type.googleapis.com/google.rpc.BadRequest",
                           "fieldViolations": [{"field": e.param, "description": e.message}]}]
    return {"error": err}
