"""`openforge replay serve`: real SDK clients answered from hand-made traces, divergence errors, CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from typer.testing import CliRunner

from openforge.replay.serve import ReplayIndex, ReplayServer, conversation
from openforge.replay.trace import load_exchanges
from openforge.testing.toolchain_flows import chat_stream_events, exchange, sse, write_trace

SYSTEM = {"role": "system", "content": "You are a shell agent."}
USER = {"role": "user", "content": "List the files."}
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}}}}]
CALL = {"id": "call_1", "name": "bash", "arguments": '{"command": "ls"}'}
ASSISTANT = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "marker.txt"}


def chat_trace(tmp_path: Path) -> Path:
    turn1 = {"model": "m", "messages": [SYSTEM, USER], "tools": TOOLS, "stream": True}
    turn2 = {"model": "m", "messages": [SYSTEM, USER, ASSISTANT, TOOL_RESULT], "tools": TOOLS, "stream": True}
    anth = {"model": "m", "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    anth_resp = {"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                 "content": [{"type": "text", "text": "hello there"}], "stop_reason": "end_turn",
                 "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 2}}
    records = [
        exchange(turn1, chunks=sse(chat_stream_events("", [5, 6, 7], tool=CALL)), injected=["return_token_ids"]),
        exchange(turn2, chunks=sse(chat_stream_events("I see marker.txt", [8, 9, 10])),
                 injected=["return_token_ids"], t_start=1001.0),
        exchange(anth, path="/v1/messages", response_body=anth_resp, protocol="anthropic", t_start=1002.0),
    ]
    return write_trace(tmp_path / "trace", records)


@pytest.fixture
def server(tmp_path: Path):
    index = ReplayIndex.build(load_exchanges([chat_trace(tmp_path)]), side="client")
    with ReplayServer(index, speed=None) as srv:
        yield srv


def test_replay_serves_streamed_conversation_to_openai_sdk(server: ReplayServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=[SYSTEM, USER], tools=TOOLS, stream=True)
    calls = [tc for ch in stream for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert calls[0].function.name == "bash" and json.loads(calls[0].function.arguments) == {"command": "ls"}
    # turn 2: the client re-serialises the tool arguments compactly and sends string content as a list
    assistant = json.loads(json.dumps(ASSISTANT))
    assistant["tool_calls"][0]["function"]["arguments"] = '{"command":"ls"}'
    tool_result = dict(TOOL_RESULT, content=[{"type": "text", "text": "marker.txt"}])
    stream = client.chat.completions.create(
        model="m", messages=[SYSTEM, USER, assistant, tool_result], tools=TOOLS, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "I see marker.txt"
    assert server.served == 2 and not server.diverged


def test_replay_client_side_strips_injected_token_ids(server: ReplayServer) -> None:
    body = {"model": "m", "messages": [SYSTEM, USER], "tools": TOOLS, "stream": True}
    raw = httpx.post(server.url + "/e/ep9/v1/chat/completions", json=body).content
    assert b"token_ids" not in raw and b"tool_calls" in raw and raw.endswith(b"data: [DONE]\n\n")


def test_replay_engine_side_serves_recorded_engine_bytes(tmp_path: Path) -> None:
    exchanges = load_exchanges([chat_trace(tmp_path)])
    with ReplayServer(ReplayIndex.build(exchanges, side="engine"), speed=None) as srv:
        up = exchanges[0]["upstream_request"]
        raw = httpx.post(srv.url + "/v1/chat/completions", content=up["body"]).content
    assert raw == b"".join(c for _, c in exchanges[0]["response"]["chunks"])
    assert b'"token_ids": [5, 6, 7]' in raw


def test_replay_divergence_names_message_and_field(server: ReplayServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    other = dict(TOOL_RESULT, content="something else")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[SYSTEM, USER, ASSISTANT, other], stream=True)
    msg = err.value.body["message"]
    assert "diverges at message 3" in msg and "content[0].text" in msg and "marker.txt" in msg
    assert server.diverged == [msg]


def test_replay_anthropic_matches_despite_cache_control_and_errors_in_its_protocol(server: ReplayServer) -> None:
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    msg = client.messages.create(model="m", max_tokens=50, system="sys", messages=[{"role": "user", "content": "hi"}])
    assert msg.content[0].text == "hello there"
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=50, system="sys", messages=[{"role": "user", "content": "bye"}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "message 1" in err.value.body["error"]["message"]


def test_replay_repeated_conversation_served_in_recorded_order(tmp_path: Path) -> None:
    body = {"model": "m", "messages": [USER]}
    answers = [{"choices": [{"index": 0, "message": {"role": "assistant", "content": t}}]} for t in ("a", "b")]
    trace = write_trace(tmp_path / "t",
                        [exchange(body, response_body=a, t_start=1000.0 + i) for i, a in enumerate(answers)])
    with ReplayServer(ReplayIndex.build(load_exchanges([trace])), speed=None) as srv:
        got = [httpx.post(srv.url + "/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
               for _ in range(3)]
    assert got == ["a", "b", "a"]


def test_replay_conversation_normalisation() -> None:
    a = conversation("anthropic", {"system": "s", "messages": [{"role": "user", "content": "x"}]})
    b = conversation("anthropic", {"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
                                   "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    assert a == b
    r1 = conversation("responses", {"input": [{"type": "function_call", "arguments": '{"a": 1}'}]})
    r2 = conversation("responses", {"input": [{"type": "function_call", "arguments": '{"a":1}'}]})
    assert r1 == r2


def test_replay_cli_errors_are_messages_not_tracebacks(tmp_path: Path) -> None:
    from openforge.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["replay", "serve", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output
    bad = tmp_path / "bad.flows"
    bad.write_bytes(b"not msgpack at all")
    res = runner.invoke(app, ["replay", "drive", str(bad), "--upstream", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "error:" in res.output


def test_replay_serve_command_runs_until_interrupted(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    trace = chat_trace(tmp_path)
    proc = subprocess.Popen([sys.executable, "-u", "-m", "openforge.cli", "replay", "serve", str(trace), "--port", "0",
                             "--fast"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("replaying 3 recorded calls"), first
        url = first.split(" on ")[1].split()[0]
        body = {"model": "m", "messages": [SYSTEM, USER, ASSISTANT, TOOL_RESULT], "tools": TOOLS, "stream": True}
        assert b"marker.txt" in httpx.post(url + "/v1/chat/completions", json=body).content
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and "served 1 calls, 0 diverged" in out
