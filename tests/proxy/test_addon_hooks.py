"""The addon in process: its hooks on mitmproxy test flows (records are written before the answer goes out), and
the pure route planner they use, without any flow."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from mitmproxy import http
from mitmproxy.proxy.mode_specs import ReverseMode
from mitmproxy.test import taddons, tflow

import openforge.addons.recorder
from openforge.addons import options, routes
from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.addons.proxy import OpenForge

pytestmark = pytest.mark.addon

ANSWER = {"id": "c1", "object": "chat.completion", "model": "m", "prompt_token_ids": [1, 2, 3],
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "token_ids": [7],
                       "logprobs": {"content": [{"token": "hi", "logprob": -0.5, "bytes": [104, 105],
                                                 "top_logprobs": []}]}, "finish_reason": "stop"}]}


def new_flow(episode: str, stream: bool) -> http.HTTPFlow:
    """A chat call; the streamed one asks for token ids itself, so its record looks for them in the chunks."""
    f = tflow.tflow()
    asked = {"return_token_ids": True, "logprobs": True} if stream else {}
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream,
                       **asked}).encode()
    f.request = http.Request.make("POST", f"http://127.0.0.1:8080/e/{episode}/v1/chat/completions", body,
                                  {"content-type": "application/json", "authorization": "Bearer sk-client-123456"})
    f.request.timestamp_start = time.time()
    f.live, f.response, f.error = True, None, None
    f.client_conn.proxy_mode = ReverseMode.parse("reverse:http://127.0.0.1:9")
    return f


async def answer(addon: OpenForge, f: http.HTTPFlow, stream: bool) -> None:
    await addon.request(f)
    if stream:
        event = b"data: " + json.dumps({**ANSWER, "object": "chat.completion.chunk"}).encode() + b"\n\n"
        f.response = http.Response.make(200, b"", {"content-type": "text/event-stream"})
        await addon.responseheaders(f)
        assert callable(f.response.stream)
        f.response.stream(event + b"data: [DONE]\n\n")
        f.response.stream(b"")  # the end of the stream: its record is written here
    else:
        f.response = http.Response.make(200, json.dumps(ANSWER).encode(), {"content-type": "application/json"})
        await addon.responseheaders(f)
    addon.response(f)


def test_records_precede_the_answer_and_a_failing_one_spares_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(chunks: Any) -> bool:
        raise RuntimeError("boom")

    monkeypatch.setattr(openforge.addons.recorder, "stream_has_token_ids", broken)

    async def run() -> list[dict[str, Any]]:
        addon = OpenForge()
        with taddons.context(addon):
            addon._apply(options.parse({"openforge_upstream_url": "http://127.0.0.1:9/v1",
                                        "openforge_flow_dir": str(tmp_path), "openforge_engine_profile": "vllm"}))
            addon.engine.ok_at = float("inf")  # no reachability probe: nothing listens on port 9
            plain, streamed = new_flow("plain", False), new_flow("streamed", True)
            await answer(addon, plain, stream=False)
            await answer(addon, streamed, stream=True)
            assert b"prompt_token_ids" not in plain.response.content
            assert addon.recorder.records == 2 and not addon.recorder.inflight  # written before the answers went out
            addon.done()
        return [r for p in expand_paths([tmp_path]) for r in open_flow_file(p).records()]

    recs = {r["episode"]: r for r in asyncio.run(run())}
    assert recs["plain"]["complete"] and recs["plain"]["has_token_ids"] and recs["plain"]["error"] is None
    assert b"prompt_token_ids" in recs["plain"]["response"]["body"]  # the engine's answer, as received
    assert ["authorization", "Bearer sk-c…3456"] in recs["plain"]["client_request"]["headers"]  # masked
    assert not recs["streamed"]["complete"] and "while recording: RuntimeError: boom" in recs["streamed"]["error"]


# -- the route planner, pure -------------------------------------------------------------------------------------
def test_route_plan_for_an_llm_call(tmp_path: Path) -> None:
    table = '{"agent": {"models": {"claude-*": "Qwen/Q"}, "sampling": {"temperature": 1.0}}}'
    s = options.parse({"openforge_upstream_url": "http://engine:8000/base/v1", "openforge_flow_dir": str(tmp_path),
                       "openforge_upstream_key": "sk-upstream-0123456789", "openforge_models": table})
    assert routes.upstream_path(s, "/v1/chat/completions", "api_key=sk-x&keep=1") == "/base/v1/chat/completions?keep=1"
    fields = ((b"Host", b"127.0.0.1:8080"), (b"Authorization", b"Bearer sk-client"), (b"x-goog-api-key", b"g"),
              (b"X-OpenForge-Episode", b"e"), (b"Accept-Encoding", b"gzip"), (b"content-type", b"application/json"))
    assert routes.upstream_headers(fields, s, llm=True, h2=False) == (
        (b"Host", b"engine:8000"), (b"content-type", b"application/json"), (b"accept-encoding", b"identity"),
        (b"authorization", b"Bearer sk-upstream-0123456789"))
    assert routes.upstream_headers(fields[2:], s, llm=False, h2=True) == (
        (b"Accept-Encoding", b"gzip"), (b"content-type", b"application/json"),
        (b"authorization", b"Bearer sk-upstream-0123456789"))
    body = {"model": "claude-x", "temperature": 0.2, "messages": []}
    route = s.route("agent")
    assert route is not None and s.route("validator") is None
    assert routes.apply_route(route, body) == ["temperature"]
    assert body == {"model": "Qwen/Q", "temperature": 1.0, "messages": []}
    assert routes.apply_route(route, body) == []  # already as forced: nothing injected


@pytest.mark.parametrize(("from_path", "headers", "user", "expected"), [
    ("p", {"x-openforge-episode": "h", "session_id": "s"}, "u", ("p", "path")),
    (None, {"x-openforge-episode": "h", "session_id": "s"}, "u", ("h", "header")),
    (None, {"x-claude-code-session-id": "c", "session_id": "s"}, "u", ("u", "proxy_auth")),
    (None, {"session-id": "codex", "session_id": "s"}, None, ("codex", "session_header")),
    (None, {"session_id": "s"}, "", ("s", "session_header")),
    (None, {}, None, (None, None)),
])
def test_episode_sources_in_order(from_path: str | None, headers: dict[str, str], user: str | None,
                                  expected: tuple[str | None, str | None]) -> None:
    assert routes.episode(from_path, headers, user) == expected
