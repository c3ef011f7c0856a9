"""Replay on the committed real-CLI traces: every recorded call is found again by its conversation, and a
client that re-sends it over HTTP gets back exactly what the CLI received."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from openforge.replay.serve import ReplayIndex, ReplayServer, recorded_answer
from openforge.replay.trace import load_exchanges, protocol_of_path

TRACES = Path(__file__).resolve().parents[2] / "traces"
TOOLCHAINS = ("claude-code", "codex", "qwen-code", "mini-swe-agent")


@pytest.mark.parametrize("name", TOOLCHAINS)
def test_replay_matches_every_recorded_call_of_real_traces(name: str) -> None:
    exchanges = load_exchanges([TRACES / name])
    assert len(exchanges) >= 4, "each committed trace holds two episodes of at least two calls"
    for side in ("client", "engine"):
        index = ReplayIndex.build(exchanges, side=side)
        for ex in exchanges:
            req = ex["client_request"] if side == "client" else ex["upstream_request"]
            found, div = index.match(protocol_of_path(req["url"]), json.loads(req["body"]))
            assert div is None and found is not None
            # two episodes share their first prompt; the conversation (not the episode) is what must match
            assert found["client_request"]["body"] == ex["client_request"]["body"] or found["episode"] != ex["episode"]


def test_replay_serves_real_claude_code_stream_byte_exact() -> None:
    exchanges = load_exchanges([TRACES / "claude-code"])
    last = exchanges[-1]  # a final answer after a tool result: unique conversation
    with ReplayServer(ReplayIndex.build(exchanges, side="client"), speed=None) as srv:
        req = last["client_request"]
        got = httpx.post(srv.url + "/v1/messages?beta=true", content=req["body"],
                         headers={"content-type": "application/json"}).content
    answer = recorded_answer(last, "client")
    assert got == b"".join(c for _, c in answer.chunks) and b"message_stop" in got
