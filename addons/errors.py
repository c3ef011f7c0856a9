"""What the proxy answers itself when a call cannot go on: errors in the client's own protocol.

Every refusal, failure and unrecorded answer is shaped here (`error_body`, from `openforge.protocols.errors`), so a
client's SDK reads it as its vendor's error instead of choking on text or mitmproxy's HTML page.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from mitmproxy import http
from mitmproxy.net.http import http1
from mitmproxy.proxy.layers.http import _http1

from openforge.protocols import errors as protocol_errors

from .exchange import Exchange


class Refused(Exception):
    """A request the proxy answers itself with an error of the client's protocol (and records)."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def client_protocol(ex: Exchange) -> str:
    """The protocol the client spoke (the one translated from, when translated)."""
    return ex.translated["from"] if ex.translated is not None else ex.protocol


def protocol_error(protocol: str, status: int, message: str, kind: str) -> http.Response:
    """An error answer in `protocol`'s shape."""
    return http.Response.make(status, error_body(protocol, status, message, kind),
                              {"content-type": "application/json"})


def error_response(ex: Exchange | None, status: int, message: str, kind: str) -> http.Response:
    """An error answer in the client's own protocol shape (OpenAI's before the call is known)."""
    return protocol_error(client_protocol(ex) if ex is not None else "chat", status, message, kind)


def unrecorded_message(problem: str) -> str:
    return f"OpenForge: the answer was not delivered because it could not be recorded ({problem})"


def error_event(protocol: str, message: str) -> bytes:
    """An SSE error event in the client's protocol for an answer that could not be recorded."""
    return protocol_errors.error_event(
        protocol, protocol_errors.error_body(protocol, 503, message, "recording_failed", "recording_failed"))


def error_body(protocol: str, status: int, message: str, kind: str) -> bytes:
    """The proxy's own error answer in the client's protocol shape, `kind` its OpenAI type and code."""
    return json.dumps(protocol_errors.error_body(protocol, status, message, kind, kind)).encode()


def error_message(obj: dict[str, Any] | None) -> str | None:
    """The message of an engine's error object, whatever its shape (OpenAI, FastAPI `detail`, plain)."""
    return protocol_errors.engine_message(obj) if obj else None


class ErrorPages:
    """Replaces mitmproxy's text/html error page, for a flow whose `error` hook armed one, with an error
    object of the client's protocol.

    mitmproxy 11 and 12 send their own page after the `error` hook whatever the hook sets (letting
    `flow.response` override it is mitmproxy PR #7999, unmerged). `_http1.make_error_response(status, message)`
    builds that page from the very string the flow's `error.msg` holds, so an armed page is matched by that
    string's identity (oldest first when mitmproxy reuses one message for several flows). mitmproxy 12 runs
    the rest of the hook's event on a later pass of the event loop, so a page waits up to `PAGE_TTL` s; one
    never asked for (the client had gone) is dropped then. HTTP/2 clients still get mitmproxy's page (its
    HTTP/2 layer builds it inline).
    """

    PAGE_TTL = 5.0

    def __init__(self) -> None:
        self._pages: list[tuple[str, bytes, float]] = []  # (flow.error.msg, page, deadline)
        self._original: Callable[..., bytes] | None = None

    def install(self) -> None:
        if self._original is None:
            self._original = _http1.make_error_response
            _http1.make_error_response = self.make

    def uninstall(self) -> None:
        if self._original is not None and _http1.make_error_response == self.make:
            _http1.make_error_response = self._original
        self._original = None

    def arm(self, message: str, response: http.Response) -> None:
        now = time.monotonic()
        self._pages = [p for p in self._pages if p[2] > now]
        self._pages.append((message, http1.assemble_response(response), now + self.PAGE_TTL))

    def make(self, status_code: int, message: str = "") -> bytes:
        for i, (armed, page, _) in enumerate(self._pages):
            if armed is message:
                del self._pages[i]
                return page
        assert self._original is not None
        return self._original(status_code, message)
