"""The control API's client (`openforge.protocols.control`) against a tiny stdlib server: what it sends,
when it tries again, and what a failure says."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from openforge.protocols import control
from openforge.protocols.control import ControlClient, ControlError

pytestmark = pytest.mark.addon


class Server(ThreadingHTTPServer):
    """Answers each request with the next (status, body) of `answers` (the last one again once used up)."""

    def __init__(self, answers: list[tuple[int, Any]], port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.answers = answers
        self.seen: list[tuple[str, str, str | None, Any]] = []  # method, path, authorization, body

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Server

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.server.seen.append((self.command, self.path, self.headers.get("authorization"), body))
        status, answer = self.server.answers.pop(0) if len(self.server.answers) > 1 else self.server.answers[0]
        data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve() -> Iterator[Any]:
    """`serve(*answers, port=0)` -> a running Server."""
    started: list[Server] = []

    def start(*answers: tuple[int, Any], port: int = 0) -> Server:
        server = Server(list(answers), port)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_paths_encode_the_episode() -> None:
    assert control.reward_path("ep/1 x") == "/openforge/v1/episodes/ep%2F1%20x/reward"
    assert control.calls_path("e") == "/openforge/v1/episodes/e/calls"


def test_methods_send_their_body_and_token(serve: Any) -> None:
    server = serve((200, {"ok": True, "id": "r1", "episode": "ep/1"}), (200, {"ok": True, "version": 3}),
                   (200, {"ok": True, "paused": True, "was_paused": False, "held": 0, "timeout_s": 5}))
    client = ControlClient(server.url + "/", "TOKEN")
    assert client.reward("ep/1", 0.5, task_id="t", metadata={"k": 1})["id"] == "r1"
    assert client.policy()["version"] == 3
    assert client.pause(5)["paused"]
    client.resume()
    assert server.seen == [
        ("POST", "/openforge/v1/episodes/ep%2F1/reward", "Bearer TOKEN", {"reward": 0.5, "task_id": "t",
                                                                          "metadata": {"k": 1}}),
        ("GET", "/openforge/v1/policy", "Bearer TOKEN", None),
        ("POST", "/openforge/v1/pause", "Bearer TOKEN", {"timeout_s": 5}),
        ("POST", "/openforge/v1/resume", "Bearer TOKEN", {}),
    ]


def test_no_token_sends_no_authorization(serve: Any) -> None:
    server = serve((200, {"ok": True}))
    ControlClient(server.url).status()
    assert server.seen[0][2] is None


def test_an_error_answer_is_final_and_says_why(serve: Any) -> None:
    server = serve((403, {"error": "posting a reward needs a reward token"}), (200, {"ok": True}))
    with pytest.raises(ControlError) as e:
        ControlClient(server.url, "client", backoff=0).reward("e", 1.0)
    assert e.value.status == 403 and e.value.message == "posting a reward needs a reward token"
    assert str(e.value) == (f"POST {server.url}/openforge/v1/episodes/e/reward: HTTP 403: "
                            "posting a reward needs a reward token")
    assert len(server.seen) == 1  # never tried again


def test_a_body_that_is_not_json_is_an_error(serve: Any) -> None:
    server = serve((503, b"<html>busy</html>"), (200, b"[1]"))
    client = ControlClient(server.url, backoff=0)
    with pytest.raises(ControlError, match="HTTP 503: <html>busy</html>"):
        client.status()
    with pytest.raises(ControlError, match="HTTP 200: not a JSON object"):
        client.status()


def test_no_answer_is_tried_again_a_bounded_number_of_times() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ControlError) as e:
        ControlClient(url, tries=3, backoff=0).status()
    assert e.value.status is None and "refused" in e.value.message.lower()
    assert "no answer" in str(e.value)


class Silent(ThreadingHTTPServer):
    """Takes each request and never answers: what a proxy that recorded a reward and then stalled looks like."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), SilentHandler)
        self.requests = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class SilentHandler(BaseHTTPRequestHandler):
    server: Silent

    def _take(self) -> None:
        self.server.requests += 1
        self.rfile.read(int(self.headers.get("content-length") or 0))
        threading.Event().wait(2)

    do_GET = do_POST = _take

    def log_message(self, *args: object) -> None:
        pass


def test_a_post_that_reached_the_proxy_is_never_sent_twice() -> None:
    """A reward the proxy took but did not answer in time may be recorded: posting it again could be
    refused (reward_policy = first) or counted twice. A GET is safe to repeat."""
    server = Silent()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = ControlClient(server.url, timeout=0.3, tries=3, backoff=0)
        with pytest.raises(ControlError) as posted:
            client.reward("ep1", 1.0)
        assert server.requests == 1 and posted.value.status is None
        with pytest.raises(ControlError):
            client.status()
        assert server.requests == 1 + 3
    finally:
        server.shutdown()
        server.server_close()


def test_a_proxy_that_comes_up_late_is_reached(serve: Any) -> None:
    port = free_port()
    timer = threading.Timer(0.3, serve, args=[(200, {"ok": True})], kwargs={"port": port})
    timer.start()
    try:
        assert ControlClient(f"http://127.0.0.1:{port}", tries=10, backoff=0.1).status()["ok"]
    finally:
        timer.join()


def test_the_environment_proxy_is_never_used(serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = serve((200, {"ok": True}))
    dead = f"http://127.0.0.1:{free_port()}"  # every request through it would fail
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, dead)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert ControlClient(server.url, tries=1).status()["ok"]
    assert len(server.seen) == 1


def test_the_episode_entrypoint_posts_through_it_with_the_standard_library_only() -> None:
    code = ("import sys; before = set(sys.modules); import openforge.rollout.episode as e; "
            "print(e.ControlClient.__module__); "
            "print(' '.join({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["openforge.protocols.control", "openforge"]
