"""One proxied call in flight: what the client sent, what went upstream, every chunk back, and its record.

The stream callback lives here because it is the hottest code in the proxy: per network read it stores
the chunk with its arrival time and, only when needed, rewrites it. It never raises: mitmproxy would
silently corrupt the client's stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from openforge.protocols import errors
from openforge.protocols.sse import has_terminal_event

from . import flowfile, profiles, wire


class Exchange:
    __slots__ = (
        "id", "seq", "proxy", "t_start", "t_first_byte", "t_end", "episode", "episode_source", "role",
        "toolchain", "protocol", "model", "upstream_model", "engine_profile", "client_request",
        "upstream_request", "injected", "translated", "client_body", "chunks", "client_chunks", "streamed",
        "rewriter", "translator", "error", "path", "written", "on_end", "held", "policy_version",
        "restream", "restream_usage", "prompt_ids", "engine_prompt_ids", "engine_prompt_error",
    )

    def __init__(self, id: str, seq: int, proxy: str, t_start: float, protocol: str, path: str) -> None:
        self.id = id
        self.seq = seq
        self.proxy = proxy
        self.t_start = t_start
        self.t_first_byte: float | None = None
        self.t_end: float | None = None
        self.episode: str | None = None
        self.episode_source: str | None = None
        self.role = ""
        self.toolchain: str | None = None
        self.protocol = protocol
        self.path = path
        self.model: str | None = None
        self.upstream_model: str | None = None
        self.engine_profile = "generic"
        self.client_request = RequestParts("", "", (), None)
        self.upstream_request: RequestParts | None = None
        self.injected: list[str] = []
        self.translated: flowfile.Translation | None = None
        self.client_body: dict[str, Any] | None = None  # the client's parsed request, kept when translating
        self.chunks: list[list[Any]] = []
        self.client_chunks: list[list[Any]] | None = None
        self.streamed = False
        self.rewriter: profiles.SseStripper | None = None
        self.translator: Any = None
        self.error: str | None = None
        self.written = False
        # Called at the end of the stream, before what is held is released; never raises. Records the exchange
        # and returns None, or (not recorded) the bytes the client gets instead of what is held.
        self.on_end: Callable[[], bytes | None] | None = None
        self.held: list[bytes] = []  # the client's terminal event (and anything after it), until recorded
        self.policy_version = 0  # the proxy's policy version when the call went on to the engine
        self.restream = False  # sent unstreamed for the client's stream (`profiles.unstream`)
        self.restream_usage = False  # and the client asked for the usage event (`stream_options.include_usage`)
        self.prompt_ids: asyncio.Future[list[int]] | None = None  # the engine's prompt ids, asked for (`prompt_ids`)
        self.engine_prompt_ids: list[int] | None = None
        self.engine_prompt_error: str | None = None  # why the engine gave none when asked

    # -- streaming -----------------------------------------------------------------------------------
    def on_chunk(self, data: bytes) -> bytes | list[bytes]:
        """mitmproxy's stream callable: called per network read, then once with b"" at the end."""
        try:
            now = time.time()
            if data:
                self.chunks.append([now, data])
            if self.translator is not None:
                out = self.translator.feed(data) if data else self.translator.finish()
                if out:
                    self.client_chunks.append([now, out])  # type: ignore[union-attr]
            elif self.rewriter is not None:
                out = self.rewriter.feed(data)
            else:
                out = data
        except Exception as e:  # noqa: BLE001 - a raise here would corrupt the client's stream
            out = self._give_up(data, e)
        if data:
            if out and (self.held or has_terminal_event(out)):
                self.held.append(out)  # released once the record is written (`on_end`)
                return []
            # Never hand mitmproxy b"" mid-stream: with chunked encoding that ends the client's response.
            return out if out else []
        ending = self.held + [out] if out else self.held
        refusal = self.on_end() if self.on_end is not None else None
        if refusal is None:
            return ending
        return [refusal] if refusal else []

    def _give_up(self, data: bytes, e: Exception) -> bytes:
        self.error = f"stream rewrite failed, rest passed through unchanged: {type(e).__name__}: {e}"
        if self.translator is not None:
            client = self.translated["from"]  # type: ignore[index]
            event = errors.error_event(client, errors.error_body(client, 502, f"OpenForge translation failed: {e}"))
            self.client_chunks.append([time.time(), event])  # type: ignore[union-attr]
            self.translator = _Swallow()
            return event
        rewriter, self.rewriter = self.rewriter, None
        return (rewriter.drain() if rewriter is not None else b"") + data

    # -- the record --------------------------------------------------------------------------------------
    def record(self, response: ResponseParts | None, client_response: ResponseParts | None,
               complete: bool, has_token_ids: bool) -> flowfile.ExchangeRecord:
        record = self._record(response, client_response, complete, has_token_ids)
        if self.engine_prompt_ids is not None:
            record["engine_prompt_ids"] = self.engine_prompt_ids
        if self.engine_prompt_error is not None:
            record["engine_prompt_error"] = self.engine_prompt_error
        return record

    def _record(self, response: ResponseParts | None, client_response: ResponseParts | None,
                complete: bool, has_token_ids: bool) -> flowfile.ExchangeRecord:
        return {
            "type": "exchange",
            "id": self.id,
            "proxy": self.proxy,
            "seq": self.seq,
            "t_start": self.t_start,
            "t_first_byte": self.t_first_byte,
            "t_end": self.t_end,
            "complete": complete,
            "episode": self.episode,
            "episode_source": self.episode_source,
            "role": self.role,
            "toolchain": self.toolchain,
            "protocol": self.protocol,
            "model": self.model,
            "upstream_model": self.upstream_model,
            "engine_profile": self.engine_profile,
            "client_request": self.client_request.to_map(),
            "upstream_request": None if self.upstream_request is None else self.upstream_request.to_map(),
            "response": None if response is None else response.to_map(),
            "client_response": None if client_response is None else client_response.to_map(),
            "injected": self.injected,
            "translated": self.translated,
            "has_token_ids": has_token_ids,
            "error": self.error,
            "policy_version": self.policy_version,
        }


class _Swallow:
    """After a failed translation the client already got an error event; drop the rest of the stream."""

    def feed(self, data: bytes) -> bytes:
        return b""

    def finish(self) -> bytes:
        return b""


class RequestParts(NamedTuple):
    """A request as it stood when taken. mitmproxy's header fields (a tuple) and bodies (bytes) are
    immutable, so taking them costs nothing on the request path; decoding and masking wait for the
    record, which is written after the client has its answer."""

    method: str
    url: str
    fields: tuple[tuple[bytes, bytes], ...]
    body: bytes | None

    def to_map(self) -> flowfile.HttpRequest:
        return {"method": self.method, "url": wire.masked_url(self.url), "headers": wire.masked_fields(self.fields),
                "body": self.body}


class ResponseParts(NamedTuple):
    """A response as it stood when taken (see `RequestParts`); a streamed one holds its chunks instead."""

    status: int
    fields: tuple[tuple[bytes, bytes], ...]
    body: bytes | None
    chunks: list[list[Any]] | None = None

    def to_map(self) -> flowfile.HttpResponse:
        streamed = self.chunks is not None
        return {"status": self.status, "headers": wire.masked_fields(self.fields),
                "body": None if streamed else self.body, "chunks": self.chunks, "streamed": streamed}
