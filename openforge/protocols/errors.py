"""Errors in each client's own shape, and the one exception a request the engine cannot take raises."""

from __future__ import annotations

import json
from typing import Any

from .endpoints import ANTHROPIC_PROTOCOLS

# Anthropic's documented error types; any other status is `api_error` (5xx) or `invalid_request_error` (4xx).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    529: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                 404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class ProtocolError(Exception):
    """A request the engine cannot take (e.g. a non-function tool); `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_body(protocol: str, status: int, message: str, kind: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """An error object in the client protocol's shape: Anthropic's for Messages, OpenAI's for the rest.

    OpenAI's `type` is `kind` when given, else the status's; its `code` is `code`. Anthropic's type always
    follows the status, as its clients decide on retries by it.
    """
    if protocol in ANTHROPIC_PROTOCOLS:
        atype = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": atype, "message": message}}
    otype = kind or _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": otype, "param": None, "code": code}}


def error_event(protocol: str, body: dict[str, Any]) -> bytes:
    """An error body as an SSE event: Anthropic and Responses name it `error`, Chat sends bare data."""
    named = protocol in ANTHROPIC_PROTOCOLS or protocol == "responses"
    return (b"event: error\n" if named else b"") + b"data: " + json.dumps(body).encode() + b"\n\n"


def engine_message(obj: dict[str, Any]) -> str | None:
    """The message of an engine's error answer or event (`error.message`, `error`, `message`, `detail`)."""
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or obj.get("message") or obj.get("detail") or "") or None
