"""The addon's hooks in process, on mitmproxy test flows: records are written before the answer goes out."""

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
from openforge.addons import options
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
        addon.responseheaders(f)
        assert callable(f.response.stream)
        f.response.stream(event + b"data: [DONE]\n\n")
        f.response.stream(b"")  # the end of the stream: its record is written here
    else:
        f.response = http.Response.make(200, json.dumps(ANSWER).encode(), {"content-type": "application/json"})
        addon.responseheaders(f)
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
