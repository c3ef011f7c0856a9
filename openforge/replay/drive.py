"""`openforge replay drive`: re-send a trace's recorded requests to a live engine with bounded concurrency,
and report throughput, time to first token, total latency and how far the new completions diverge from the
recorded ones. httpx is imported only when driving.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from openforge.protocols import anthropic, chat, responses, sse
from openforge.protocols.endpoints import LLM_PROTOCOLS

from .trace import ReplayError, Side, common_prefix, json_body, protocol_of_path, request_of


@dataclass
class Completion:
    """What an engine generated in one answer: text (with tool-call arguments) and token ids if present."""

    text: str = ""
    token_ids: list[int] | None = None
    output_tokens: int | None = None

    def units(self) -> list[Any]:
        return list(self.token_ids) if self.token_ids is not None else list(self.text)


def _event_objects(events: list[sse.Event]) -> Iterator[Any]:
    """The JSON objects of SSE events (`[DONE]` and data that is not JSON left out)."""
    for _, data, _ in events:
        data = (data or "").strip()
        if data and data != "[DONE]":
            obj = json_body(data.encode())
            if obj is not None:
                yield obj


# What each protocol's answers say was generated (openforge.protocols).
_GENERATED = {"chat": chat.generated, "completions": chat.generated, "anthropic": anthropic.generated,
              "responses": responses.generated}


class CompletionParser:
    """Accumulates a completion from a response body or SSE events of any supported protocol."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.c = Completion()

    def feed_event(self, obj: Any) -> bool:
        """Add one (streamed or whole) JSON answer; True if it carried generated content."""
        if not isinstance(obj, dict):
            return False
        read = _GENERATED.get(self.protocol)
        if read is None:
            return False
        new = read(obj)
        self.c.text += new.text
        if new.token_ids is not None:
            self.c.token_ids = (self.c.token_ids or []) + new.token_ids
        if new.output_tokens is not None:
            self.c.output_tokens = new.output_tokens
        return bool(new.text or new.token_ids)

    def feed_body(self, body: bytes) -> None:
        self.feed_event(json_body(body))

    def feed_stream(self, data: bytes) -> None:
        """A whole recorded stream, an unterminated last event included."""
        for obj in _event_objects(sse.events(data, torn=True)):
            self.feed_event(obj)


def completion_of(protocol: str, response: dict[str, Any]) -> Completion:
    parser = CompletionParser(protocol)
    if response.get("streamed") and response.get("chunks") is not None:
        parser.feed_stream(b"".join(bytes(b) for _, b in response["chunks"]))
    else:
        parser.feed_body(bytes(response.get("body") or b""))
    return parser.c


def prefix_ratio(a: list[Any], b: list[Any]) -> float:
    """Common-prefix length over the longer length (1.0 for two empty completions)."""
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else common_prefix(a, b) / longest


# --------------------------------------------------------------------------------------------- drive

@dataclass
class CallResult:
    id: str | None
    status: int
    ttft: float | None
    latency: float
    output_tokens: int | None
    identical: bool
    prefix_ratio: float
    error: str | None = None


@dataclass
class DriveReport:
    results: list[CallResult]
    wall: float
    concurrency: int

    @staticmethod
    def _pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.error is None and 200 <= r.status < 300]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        lats = [r.latency for r in ok]
        toks = sum(r.output_tokens or 0 for r in ok)
        return {
            "calls": len(self.results),
            "ok": len(ok),
            "failed": len(self.results) - len(ok),
            "concurrency": self.concurrency,
            "wall_s": self.wall,
            "calls_per_s": len(ok) / self.wall if self.wall > 0 else None,
            "output_tokens_per_s": toks / self.wall if self.wall > 0 else None,
            "ttft_p50_s": self._pct(ttfts, 50),
            "ttft_p99_s": self._pct(ttfts, 99),
            "latency_p50_s": self._pct(lats, 50),
            "latency_p99_s": self._pct(lats, 99),
            "identical_fraction": sum(r.identical for r in ok) / len(ok) if ok else None,
            "mean_prefix_ratio": statistics.fmean(r.prefix_ratio for r in ok) if ok else None,
        }


DROP_REQUEST_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding",
                        "proxy-authorization", "cookie"}
MASKED_HEADERS = {"authorization", "x-api-key"}


def _drive_plan(exchanges: list[dict[str, Any]], side: Side) -> list[list[dict[str, Any]]]:
    """Groups of exchanges to send in order: one group per episode on the client side (a conversation
    only makes sense turn by turn), one group per call on the engine side (each request stands alone)."""
    usable = [
        ex for ex in exchanges
        if (req := request_of(ex, side)) and protocol_of_path(req["url"]) in LLM_PROTOCOLS
    ]
    if side == "engine":
        return [[ex] for ex in usable]
    groups: dict[str, list[dict[str, Any]]] = {}
    for ex in usable:
        groups.setdefault(ex.get("episode") or ex["id"], []).append(ex)
    return list(groups.values())


async def drive(
    exchanges: list[dict[str, Any]],
    upstream: str,
    concurrency: int = 8,
    side: Side = "engine",
    model: str | None = None,
    timeout: float = 300.0,
    api_key: str | None = None,
    on_done: Any = None,
) -> DriveReport:
    """Re-send recorded requests to `upstream` (origin + recorded path) and compare the answers."""
    import httpx

    groups = _drive_plan(exchanges, side)
    if not groups:
        raise ReplayError(f"the trace holds no LLM call with a recorded {side} request")
    base = upstream.rstrip("/")
    sem = asyncio.Semaphore(concurrency)
    results: list[CallResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, ex: dict[str, Any]) -> CallResult:
        req = request_of(ex, side)
        assert req is not None
        parts = urlsplit(req["url"])
        url = base + parts.path + (f"?{parts.query}" if parts.query else "")
        protocol = protocol_of_path(parts.path)
        body = bytes(req.get("body") or b"")
        if model is not None:
            obj = json.loads(body)
            obj["model"] = model
            body = json.dumps(obj).encode()
        headers: dict[bytes, bytes] = {}
        for k, v in req.get("headers") or []:
            if k.lower() in DROP_REQUEST_HEADERS:
                continue
            if k.lower() in MASKED_HEADERS:  # recorded masked ("sk-a…wxyz"): send the given key or a placeholder
                v = (f"Bearer {api_key or 'openforge-replay'}" if k.lower() == "authorization"
                     else api_key or "openforge-replay")
            headers[k.encode()] = v.encode() if isinstance(v, str) else v
        recorded = completion_of(protocol, ex["response"] if side == "engine" else _client_view(ex))
        parser = CompletionParser(protocol)
        t0 = time.perf_counter()
        ttft = None
        try:
            async with client.stream(req.get("method", "POST"), url, content=body, headers=headers) as r:
                if r.headers.get("content-type", "").startswith("text/event-stream"):
                    reader = sse.SseReader()
                    async for data in r.aiter_bytes():
                        for obj in _event_objects(reader.feed(data)):
                            if parser.feed_event(obj) and ttft is None:
                                ttft = time.perf_counter() - t0
                    for obj in _event_objects(reader.flush()):
                        parser.feed_event(obj)
                else:
                    parser.feed_body(await r.aread())
                status = r.status_code
            error = None if 200 <= status < 300 else f"HTTP {status}"
        except httpx.HTTPError as e:
            status, error = 0, f"{type(e).__name__}: {e}"
        latency = time.perf_counter() - t0
        new = parser.c
        a, b = (new.units(), recorded.units())
        if (new.token_ids is None) != (recorded.token_ids is None):
            a, b = list(new.text), list(recorded.text)
        return CallResult(ex.get("id"), status, ttft, latency, new.output_tokens, a == b, prefix_ratio(a, b), error)

    async def run_group(client: httpx.AsyncClient, group: list[dict[str, Any]]) -> None:
        for ex in group:
            async with sem:
                res = await one(client, ex)
            results.append(res)
            if on_done:
                on_done(res)

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        await asyncio.gather(*(run_group(client, g) for g in groups))
    return DriveReport(results, time.perf_counter() - t0, concurrency)


def _client_view(exchange: dict[str, Any]) -> dict[str, Any]:
    return exchange.get("client_response") or exchange["response"]


def count_calls(exchanges: list[dict[str, Any]], side: Side) -> int:
    return sum(len(g) for g in _drive_plan(exchanges, side))
