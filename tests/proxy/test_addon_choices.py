"""`n > 1` through the real proxy: the vllm profile hides what it asked for from every choice, streamed or not,
and the record keeps every choice's token ids (reconstruct makes a call of each)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from openforge.addons.flowfile import expand_paths, open_flow_file

pytestmark = pytest.mark.addon

PROMPT_IDS = [1, 882, 198, 13, 2]
COMPLETIONS = {0: ([71, 72, 2], "Hi"), 1: ([81, 82, 83, 2], "Yes")}  # index -> (token ids, text)


def _choice(protocol: str, index: int, ids: list[int], text: str, finish: str | None, delta: bool) -> dict[str, Any]:
    """One choice as vLLM 0.32 answers `return_token_ids` + `logprobs`."""
    out: dict[str, Any] = {"index": index, "finish_reason": finish, "token_ids": ids}
    if protocol == "chat":
        out["logprobs"] = {"content": [{"token": str(i), "logprob": -0.5, "bytes": None, "top_logprobs": []}
                                       for i in ids]}
        out["delta" if delta else "message"] = {"role": "assistant", "content": text}
    else:
        out["text"], out["logprobs"] = text, {"tokens": [str(i) for i in ids], "token_logprobs": [-0.5] * len(ids),
                                              "top_logprobs": None, "text_offset": [0] * len(ids)}
        out["prompt_token_ids"] = PROMPT_IDS if not delta or ids[0] in (71, 81) else None
    return out


def _answer(protocol: str, n: int) -> dict[str, Any]:
    body: dict[str, Any] = {"id": "cmpl-1", "object": "chat.completion" if protocol == "chat" else "text_completion",
                            "choices": [_choice(protocol, i, *COMPLETIONS[i], "stop", False) for i in range(n)],
                            "usage": {"prompt_tokens": 5, "completion_tokens": 7}}
    if protocol == "chat":
        body["prompt_token_ids"] = PROMPT_IDS
    return body


def _events(protocol: str, n: int) -> list[dict[str, Any]]:
    """vLLM's stream: Chat sends each choice's role chunk (prompt ids on each), then the choices' tokens
    interleaved by index, one choice per chunk; here the last choice finishes first."""
    events: list[dict[str, Any]] = []
    if protocol == "chat":
        events += [{"id": "c", "object": "chat.completion.chunk", "prompt_token_ids": PROMPT_IDS,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]} for i in range(n)]
    for i in range(n):
        ids, text = COMPLETIONS[i]
        events.append({"id": "c", "choices": [_choice(protocol, i, ids[:1], text[:1], None, True)]})
    for i in reversed(range(n)):
        ids, text = COMPLETIONS[i]
        events.append({"id": "c", "choices": [_choice(protocol, i, ids[1:], text[1:], "stop", True)]})
    return events


class _Upstream(BaseHTTPRequestHandler):
    """Answers Chat and Completions with `n` choices, as vLLM does."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        protocol = "chat" if self.path.endswith("/chat/completions") else "completions"
        n = body.get("n") or 1
        if not body.get("stream"):
            data = json.dumps(_answer(protocol, n)).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for event in [*(json.dumps(e) for e in _events(protocol, n)), "[DONE]"]:
            data = f"data: {event}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _client_choices(protocol: str, stream: bool, answer: bytes) -> list[dict[str, Any]]:
    if not stream:
        return json.loads(answer)["choices"]
    events = [json.loads(line[5:]) for line in answer.split(b"\n")
              if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"]
    assert all("prompt_token_ids" not in e for e in events)
    return [c for e in events for c in e["choices"]]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("protocol", ["chat", "completions"])
def test_every_choice_is_stripped_and_recorded(upstream: str, start_proxy: Any, protocol: str,
                                               stream: bool) -> None:
    proxy = start_proxy(upstream, "openforge_engine_profile=vllm")
    path = "chat/completions" if protocol == "chat" else "completions"
    body: dict[str, Any] = {"model": "m", "n": 2, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if protocol == "chat" else {"prompt": "hi"})
    answer = httpx.post(f"{proxy.url}/e/ep/v1/{path}", json=body, timeout=30).content
    assert b"token_ids" not in answer
    choices = _client_choices(protocol, stream, answer)
    assert {c["index"] for c in choices} == {0, 1}
    assert all(c.get("logprobs") is None and "token_ids" not in c for c in choices)  # every choice, not just 0
    proxy.status()
    [rec] = [r for p in expand_paths([proxy.flow_dir]) for r in open_flow_file(p).records()]
    assert rec["has_token_ids"] and rec["complete"] and rec["injected"] == ["return_token_ids", "logprobs"]
    raw = b"".join(c[1] for c in rec["response"]["chunks"]) if stream else rec["response"]["body"]
    for ids, _ in COMPLETIONS.values():  # the record keeps every choice's ids
        assert json.dumps(ids[1:]).encode()[1:-1] in raw
