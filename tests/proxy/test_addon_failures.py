"""Engine failures reach the client as errors of its own protocol, and the record says what the client got."""

from __future__ import annotations

import json
import signal
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

MESSAGES = [{"role": "user", "content": "list the files here"}]
# An answer that is not valid UTF-8 (a \xff byte in its text) and carries the token ids the proxy asked for.
NOT_UTF8 = (b'{"id": "c1", "object": "chat.completion", "model": "latin1", "prompt_token_ids": [1, 2, 3], '
            b'"choices": [{"index": 0, "message": {"role": "assistant", "content": "caf\xff"}, '
            b'"token_ids": [7, 8], "logprobs": {"content": []}, "finish_reason": "stop"}]}')


class RawEngine:
    """An upstream that misbehaves at the socket level; the request's `model` picks how:
    `close` (no answer), `reset` (TCP RST), `garbage` (no HTTP status line), `short` (body cut short),
    `latin1` (a well-formed answer whose body is not UTF-8)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_request(conn: socket.socket) -> dict[str, Any] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None  # a reachability probe: connect and close
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return json.loads(body) if body else {}

    def _one(self, conn: socket.socket) -> None:
        with conn:
            request = self._read_request(conn)
            if request is None:
                return
            how = request.get("model")
            if how == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif how == "garbage":
                conn.sendall(b"HELLO THERE, NOT HTTP\r\n\r\n")
            elif how == "short":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n"
                             b'{"id": "c1", "choices": [')
            elif how == "latin1":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(NOT_UTF8), NOT_UTF8))

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def raw_engine() -> Iterator[RawEngine]:
    eng = RawEngine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def proxy(raw_engine: RawEngine, start_module_proxy: Any) -> Any:
    return start_module_proxy(raw_engine.url, "openforge_engine_profile=vllm")


def records(proxy: Any) -> list[dict[str, Any]]:
    proxy.status()
    return [r for path in expand_paths([proxy.flow_dir]) for r in open_flow_file(path).records()]


def by_episode(proxy: Any, episode: str) -> list[dict[str, Any]]:
    return [r for r in records(proxy) if r.get("episode") == episode]


@pytest.mark.parametrize("how", ["close", "reset", "garbage", "short"])
def test_engine_failure_is_an_openai_error_object(proxy: Any, how: str) -> None:
    r = httpx.post(f"{proxy.url}/e/oa-{how}/v1/chat/completions", json={"model": how, "messages": MESSAGES},
                   timeout=30)
    assert r.status_code == 502 and r.headers["content-type"] == "application/json", r.text
    assert "OpenForge: upstream" in r.json()["error"]["message"]
    (rec,) = by_episode(proxy, f"oa-{how}")
    assert rec["response"]["status"] == 502 and rec["error"] and not rec["complete"]


@pytest.mark.parametrize("how", ["close", "short"])
def test_engine_failure_on_a_translated_call_is_an_anthropic_error_object(proxy: Any, how: str) -> None:
    r = httpx.post(f"{proxy.url}/e/an-{how}/v1/messages", timeout=30,
                   json={"model": how, "max_tokens": 10, "messages": MESSAGES})
    assert r.status_code == 502 and r.headers["content-type"] == "application/json", r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    (rec,) = by_episode(proxy, f"an-{how}")
    assert rec["response"]["status"] == 502


def test_injected_ids_are_stripped_from_an_answer_that_is_not_utf8(proxy: Any) -> None:
    r = httpx.post(f"{proxy.url}/e/latin1/v1/chat/completions", json={"model": "latin1", "messages": MESSAGES},
                   timeout=30)
    assert r.status_code == 200
    assert b"token_ids" not in r.content and r.json()["choices"][0]["logprobs"] is None
    (rec,) = by_episode(proxy, "latin1")
    assert rec["response"]["body"] == NOT_UTF8 and rec["has_token_ids"]  # the record keeps the engine's bytes


def test_engine_gone_right_after_an_answer_is_a_protocol_error(start_proxy: Any) -> None:
    """Within 2 s of an answer the proxy skips its reachability probe: mitmproxy's own connect fails."""
    eng = ScriptedEngine().start()
    p = start_proxy(eng.url, "openforge_engine_profile=vllm")
    assert httpx.post(f"{p.url}/v1/messages", json={"model": "m", "max_tokens": 5, "messages": MESSAGES}).is_success
    eng.stop()
    r = httpx.post(f"{p.url}/e/gone/v1/messages", json={"model": "m", "max_tokens": 5, "messages": MESSAGES})
    assert r.status_code == 502 and r.json()["type"] == "error", r.text
    (rec,) = by_episode(p, "gone")
    assert rec["response"]["status"] == 502


def test_deeply_nested_body_is_refused_recorded_and_released(start_proxy: Any) -> None:
    with ScriptedEngine() as eng:
        p = start_proxy(eng.url, "openforge_engine_profile=vllm")
        deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        for protocol, path in (("openai", "/v1/chat/completions"), ("anthropic", "/v1/messages")):
            r = httpx.post(f"{p.url}/e/deep-{protocol}{path}", content=deep,
                           headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 400, r.text
            assert (r.json().get("type") == "error") == (protocol == "anthropic")
        assert p.status()["in_flight"] == 0  # nothing held after the answer
        recs = {r["episode"]: r for r in records(p)}
        assert recs["deep-openai"]["response"]["status"] == 400 and "nested" in recs["deep-openai"]["error"]
        assert recs["deep-anthropic"]["upstream_request"] is None
        assert not eng.requests  # nothing went upstream
        assert p.stop(signal.SIGTERM) == 0
        assert "Traceback" not in p.log() and "KeyError" not in p.log()


def test_startup_line_shows_routes_and_an_unrouted_role_is_warned_once(start_proxy: Any) -> None:
    routes = {"agent": {"models": {"claude-*": "qwen-8b"}, "sampling": {"temperature": 1.0}}}
    with ScriptedEngine() as eng:
        p = start_proxy(eng.url, "openforge_engine_profile=vllm", f"openforge_models={json.dumps(routes)}")
        for _ in range(2):
            httpx.post(f"{p.url}/r/agent-policy/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
        p.status()
        log = p.log()
    assert "agent: claude-*->qwen-8b sampling temperature=1.0" in log
    assert log.count("role 'agent-policy' has no route") == 1
