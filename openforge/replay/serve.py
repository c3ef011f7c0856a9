"""`openforge replay serve`: answer a toolchain from a trace, standing where an engine (or the whole proxy)
would be.

Each incoming LLM call is matched to a recorded exchange by its *conversation* (messages / input normalised so
that cosmetic differences such as moved `cache_control` markers, string-vs-text-list content or re-serialised
tool arguments do not count), and the recorded answer is sent back, streamed chunk by chunk with the recorded
pacing unless `fast`. A call that matches nothing is answered with an error in the client's own protocol that
names the message index and field where it left the closest recorded conversation.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from openforge.addons import profiles
from openforge.protocols import errors
from openforge.protocols.endpoints import strip_prefixes

from .trace import ReplayError, Side, common_prefix, json_body, protocol_of_path, request_of

HOP_BY_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding", "date", "server"}


# ------------------------------------------------------------------------------------ normalisation

def _norm_content(content: Any) -> Any:
    """String content and a one-element text list are the same thing to every server."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return [_norm_value(part) for part in content]
    return _norm_value(content)


def _maybe_json(value: Any) -> Any:
    """Tool-call arguments are JSON text that some clients re-serialise: compare them parsed."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _norm_value(value: Any) -> Any:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "cache_control":
                continue
            if k in ("content", "output") and not isinstance(v, dict):
                out[k] = _norm_content(v)
            elif k == "arguments":
                out[k] = _maybe_json(v)
            else:
                out[k] = _norm_value(v)
        return out
    if isinstance(value, list):
        return [_norm_value(v) for v in value]
    return value


def conversation(protocol: str, body: Any) -> list[Any]:
    """The normalised conversation of a request: system/instructions first, then each message or item."""
    if not isinstance(body, dict):
        return []
    if protocol in ("anthropic", "anthropic_count_tokens"):
        items = [{"system": _norm_content(body["system"])}] if body.get("system") else []
        return items + [_norm_value(m) for m in body.get("messages") or []]
    if protocol == "chat":
        return [_norm_value(m) for m in body.get("messages") or []]
    if protocol == "responses":
        items = [{"instructions": body["instructions"]}] if body.get("instructions") else []
        inp = body.get("input")
        if isinstance(inp, str):
            inp = [{"role": "user", "content": inp}]
        return items + [_norm_value(m) for m in inp or []]
    if protocol == "completions":
        return [{"prompt": body.get("prompt")}]
    return [_norm_value(body)]


def conversation_key(items: list[Any]) -> str:
    return json.dumps(items, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    """Dotted path of the first place two JSON values differ (None if equal)."""
    if type(a) is not type(b):
        return path or "(value)"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}" if path else k
            d = _first_difference(a[k], b[k], f"{path}.{k}" if path else k)
            if d:
                return d
        return None
    if isinstance(a, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None if len(a) == len(b) else f"{path} (length {len(a)} vs recorded {len(b)})"
    return None if a == b else (path or "(value)")


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Divergence:
    """Where an incoming conversation leaves the closest recorded one."""

    index: int  # message index (0 = system/instructions when the protocol has one)
    field: str
    got: Any
    expected: Any
    recorded_id: str | None

    def message(self) -> str:
        return (
            f"replay: no recorded call matches this conversation; closest recorded call {self.recorded_id} "
            f"diverges at message {self.index}, field {self.field!r}: got {_short(self.got)}, "
            f"recorded {_short(self.expected)}"
        )


def diverge(incoming: list[Any], recorded: list[Any], recorded_id: str | None) -> Divergence:
    n = min(len(incoming), len(recorded))
    for i in range(n):
        if incoming[i] != recorded[i]:
            where = _first_difference(incoming[i], recorded[i], "") or "(message)"
            return Divergence(i, where, incoming[i], recorded[i], recorded_id)
    if len(incoming) > len(recorded):
        return Divergence(n, "(extra message)", incoming[n], None, recorded_id)
    return Divergence(n, "(missing message)", None, recorded[n], recorded_id)




@dataclass
class ReplayIndex:
    """Recorded exchanges keyed by (protocol, conversation); repeated keys are served in recorded order."""

    side: Side = "client"
    _by_key: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    _next: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    _convs: list[tuple[str, list[Any], dict[str, Any]]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def build(cls, exchanges: list[dict[str, Any]], side: Side = "client") -> ReplayIndex:
        index = cls(side=side)
        for ex in exchanges:
            req = request_of(ex, side)
            if not req:
                continue
            proto = protocol_of_path(req.get("url", ""))
            conv = conversation(proto, json_body(req.get("body")))
            index._by_key[(proto, conversation_key(conv))].append(ex)
            index._convs.append((proto, conv, ex))
        if not index._convs:
            raise ReplayError(f"the trace holds no exchange with a recorded {side} request")
        return index

    def __len__(self) -> int:
        return len(self._convs)

    def match(self, protocol: str, body: Any) -> tuple[dict[str, Any] | None, Divergence | None]:
        """The next recorded exchange for this conversation, or the divergence from the closest one."""
        conv = conversation(protocol, body)
        key = (protocol, conversation_key(conv))
        with self._lock:
            candidates = self._by_key.get(key)
            if candidates:
                i = self._next[key]
                self._next[key] = i + 1
                return candidates[i % len(candidates)], None
        same_proto = [(c, ex) for p, c, ex in self._convs if p == protocol]
        if not same_proto:
            return None, Divergence(0, "(protocol)", protocol, sorted({p for p, _, _ in self._convs}), None)
        best, ex = max(same_proto, key=lambda ce: (common_prefix(conv, ce[0]), -abs(len(ce[0]) - len(conv))))
        return None, diverge(conv, best, ex.get("id"))

    def models(self) -> list[str]:
        names = {ex.get("model") or "" for _, _, ex in self._convs} | {
            ex.get("upstream_model") or "" for _, _, ex in self._convs
        }
        return sorted(n for n in names if n)

    def engine_profile(self) -> str:
        """The recorded engine profile, announced as `owned_by` so a proxy in front detects the same one."""
        seen = [ex.get("engine_profile") for _, _, ex in self._convs]
        known = [p for p in seen if p in ("vllm", "sglang", "llamacpp")]
        return max(set(known), key=known.count) if known else "openforge-replay"


# -------------------------------------------------------------------------------- recorded answers

@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes | None  # non-streamed
    chunks: list[tuple[float, bytes]] | None  # streamed: (seconds after request start, bytes)
    first_delay: float = 0.0  # non-streamed: recorded time to the answer


def _strip_body(body: bytes, injected: list[str]) -> bytes:
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    profiles.strip(obj, injected)
    return json.dumps(obj, ensure_ascii=False).encode()


def recorded_answer(exchange: dict[str, Any], side: Side) -> Answer:
    """What the given side received: the engine's `response`, or for the client `client_response` when the
    proxy translated, else `response` with the effect of the proxy's injected fields removed."""
    resp = exchange.get("client_response") if side == "client" else None
    injected: list[str] = []
    if resp is None:
        resp = exchange["response"]
        if side == "client":
            injected = list(exchange.get("injected") or [])
    t0 = exchange.get("t_start") or 0.0
    headers = [(k, v) for k, v in resp.get("headers") or [] if k.lower() not in HOP_BY_HOP]
    status = int(resp.get("status") or 200)
    if resp.get("streamed") and resp.get("chunks") is not None:
        chunks = [(max(0.0, t - t0), bytes(b)) for t, b in resp["chunks"]]
        if injected:  # what the proxy did to the stream on its way to the client
            stripper = profiles.SseStripper(injected)
            chunks = [(t, stripper.feed(b)) for t, b in chunks if b]
            chunks.append((chunks[-1][0] if chunks else 0.0, stripper.feed(b"")))
        return Answer(status, headers, None, chunks)
    body = bytes(resp.get("body") or b"")
    if injected:
        body = _strip_body(body, injected)
    t_end = exchange.get("t_end") or exchange.get("t_first_byte") or t0
    return Answer(status, headers, body, None, max(0.0, t_end - t0))


def error_answer(protocol: str, message: str, status: int = 400) -> Answer:
    """An error in the client's protocol, so the CLI prints the message instead of retrying blindly."""
    payload = errors.error_body(protocol, status, message, code="replay_divergence")
    return Answer(status, [("content-type", "application/json")], json.dumps(payload).encode(), None)


# ------------------------------------------------------------------------------------------ server

class ReplayServer:
    """A threaded HTTP server on 127.0.0.1 answering from a ReplayIndex (`with ReplayServer(...) as s: s.url`)."""

    def __init__(
        self, index: ReplayIndex, host: str = "127.0.0.1", port: int = 0, speed: float | None = 1.0
    ) -> None:
        self.index = index
        self.speed = speed  # None or 0: as fast as possible; 2.0: twice the recorded pace
        self.served = 0
        self.diverged: list[str] = []
        handler = type("Handler", (_Handler,), {"replay": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ReplayServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> ReplayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait(self, seconds: float) -> None:
        if self.speed and seconds > 0:
            time.sleep(seconds / self.speed)

    def answer(self, method: str, path: str, body: bytes) -> Answer:
        path = strip_prefixes(path)[0]
        protocol = protocol_of_path(path)
        if protocol == "models" and method == "GET":
            owner = self.index.engine_profile()
            data = [{"id": m, "object": "model", "owned_by": owner} for m in self.index.models()]
            listing = json.dumps({"object": "list", "data": data}).encode()
            return Answer(200, [("content-type", "application/json")], listing, None)
        if method != "POST" or protocol in ("other", "models"):
            return error_answer(protocol, f"replay: {method} {path} is not an LLM call", 404)
        parsed = json_body(body)
        if parsed is None:
            return error_answer(protocol, "replay: request body is not JSON")
        exchange, div = self.index.match(protocol, parsed)
        if exchange is None:
            if protocol == "anthropic_count_tokens":  # not always recorded; an estimate keeps the CLI going
                est = {"input_tokens": max(1, len(body) // 4)}
                return Answer(200, [("content-type", "application/json")], json.dumps(est).encode(), None)
            assert div is not None
            self.diverged.append(div.message())
            return error_answer(protocol, div.message())
        self.served += 1
        return recorded_answer(exchange, self.index.side)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    replay: ReplayServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the CLI prints a summary instead
        pass

    def do_GET(self) -> None:
        self._handle()

    def do_POST(self) -> None:
        self._handle()

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def _handle(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        ans = self.replay.answer(self.command, self.path, body)
        self.send_response(ans.status)
        for k, v in ans.headers:
            self.send_header(k, v)
        try:
            if ans.chunks is None:
                self.replay.wait(ans.first_delay)
                data = ans.body or b""
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("transfer-encoding", "chunked")
            self.send_header("cache-control", "no-cache")
            self.end_headers()
            last = 0.0
            for t, data in ans.chunks:
                self.replay.wait(t - last)
                last = max(last, t)
                if data:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
