"""The official `anthropic` and `openai` SDKs consume our translated answers, streamed and not.

A stdlib HTTP server plays the translating proxy: it feeds an engine's Chat Completions stream through
`stream_translator` in small network-sized pieces and writes whatever comes out, as the addon will.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import openai
import pytest

from openforge.addons.translate import error_body, request_to_chat, response_from_chat, stream_translator
from openforge.testing.translate_engine import sse, tool_call_deltas, vllm_chunks

pytestmark = pytest.mark.addon

ARGS = '{"command": "ls -la", "description": "Liste — ✓"}'
ENGINE_DELTAS = [{"reasoning_content": "Need a listing."}, {"content": "Listing "}, {"content": "now."},
                 *tool_call_deltas(0, "call_k1", "Bash", ARGS),
                 *tool_call_deltas(1, "call_k2", "Bash", '{"command": "pwd"}')]
CHAT_ANSWER = {"id": "chatcmpl-ns", "created": 1760000000, "model": "engine",
               "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                   "role": "assistant", "content": "Listing now.", "reasoning_content": "Need a listing.",
                   "tool_calls": [{"id": "call_k1", "type": "function",
                                   "function": {"name": "Bash", "arguments": ARGS}}]}}],
               "usage": {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39,
                         "prompt_tokens_details": {"cached_tokens": 8}}}


class _Proxy(BaseHTTPRequestHandler):
    """Answers /v1/messages and /v1/responses by translating a canned engine answer."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        protocol = "anthropic" if self.path.startswith("/v1/messages") else "responses"
        chat, _ = request_to_chat(protocol, body)
        assert chat["messages"], "translated request lost its messages"
        if self.server.fail:  # type: ignore[attr-defined]
            refusal = error_body(protocol, 400, "tool type 'web_search' is not supported")
            self._send(400, "application/json", json.dumps(refusal).encode())
            return
        if not body.get("stream"):
            self._send(200, "application/json", json.dumps(response_from_chat(protocol, CHAT_ANSWER, body)).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        translator = stream_translator(protocol, body)
        data = sse(vllm_chunks(ENGINE_DELTAS, "tool_calls", prompt_tokens=30, cached=8))
        for i in range(0, len(data), 97):  # odd-sized reads cut events and characters
            self.wfile.write(translator.feed(data[i:i + 97]))
        self.wfile.write(translator.finish())

    def _send(self, status: int, ctype: str, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Proxy)
    srv.fail = False  # type: ignore[attr-defined]
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_anthropic_sdk_stream_accumulates_our_events(server):
    client = anthropic.Anthropic(base_url=_url(server), api_key="dummy", max_retries=0)
    with client.messages.stream(model="local-model", max_tokens=256, messages=[{"role": "user", "content": "ls"}],
                                tools=[{"name": "Bash", "input_schema": {"type": "object"}}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Listing now."
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == "Need a listing." and final.content[0].signature
    assert final.content[2].id == "call_k1" and final.content[2].input == json.loads(ARGS)
    assert final.content[3].input == {"command": "pwd"}
    assert final.stop_reason == "tool_use"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (22, 8)
    assert final.usage.output_tokens > 0


def test_openai_sdk_responses_stream_final_response(server):
    client = openai.OpenAI(base_url=_url(server) + "/v1", api_key="dummy", max_retries=0)
    tools = [{"type": "function", "name": "Bash", "parameters": {"type": "object"}, "strict": False}]
    with client.responses.stream(model="local-model", input="ls", tools=tools) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == "Listing now."
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call", "function_call"]
    call = final.output[2]
    assert (call.call_id, call.name, call.arguments) == ("call_k1", "Bash", ARGS)
    assert final.output[0].content[0].text == "Need a listing."
    assert final.usage.input_tokens == 30 and final.usage.input_tokens_details.cached_tokens == 8


def test_sdks_parse_non_streaming_answers(server):
    message = anthropic.Anthropic(base_url=_url(server), api_key="dummy", max_retries=0).messages.create(
        model="local-model", max_tokens=64, messages=[{"role": "user", "content": "ls"}])
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == json.loads(ARGS) and message.stop_reason == "tool_use"
    assert message.usage.cache_read_input_tokens == 8
    response = openai.OpenAI(base_url=_url(server) + "/v1", api_key="dummy", max_retries=0).responses.create(
        model="local-model", input="ls")
    assert response.output_text == "Listing now." and response.output[2].arguments == ARGS


def test_sdks_raise_their_own_error_types_on_our_error_bodies(server):
    server.fail = True
    try:
        with pytest.raises(anthropic.BadRequestError) as err:
            anthropic.Anthropic(base_url=_url(server), api_key="dummy", max_retries=0).messages.create(
                model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert err.value.body["error"]["type"] == "invalid_request_error"
        with pytest.raises(openai.BadRequestError) as err2:
            openai.OpenAI(base_url=_url(server) + "/v1", api_key="dummy", max_retries=0).responses.create(
                model="m", input="hi")
        assert "web_search" in err2.value.message
    finally:
        server.fail = False
