"""openforge.protocols below the conversations: endpoints and prefixes, the one SSE reader, error bodies,
engine ids. Standard library only, so these run beside mitmproxy alone too."""

from __future__ import annotations

import json

import pytest

from openforge.addons import errors as addon_errors
from openforge.protocols import endpoints, engine_ids, errors, sse

pytestmark = pytest.mark.addon

STREAM = (b'event: message_start\r\ndata: {"a": 1}\r\n\r\n'
          b": keep-alive\n\n"
          b'data: {"b":\ndata: 2}\n\n'
          b'error: {"message": "boom"}\n\n'
          b"data: [DONE]\n\n"
          b'data: {"torn"')


def test_one_reader_whatever_the_network_split() -> None:
    whole = sse.events(STREAM)
    assert whole == [("message_start", '{"a": 1}', None), (None, '{"b":\n2}', None),
                     (None, None, '{"message": "boom"}'), (None, "[DONE]", None)]
    for size in (1, 2, 3, 7, 64):
        reader = sse.SseReader()
        got = [e for i in range(0, len(STREAM), size) for e in reader.feed(STREAM[i:i + size])]
        assert got == whole
        assert reader.flush() == [(None, '{"torn"', None)]
    assert sse.events(STREAM, torn=True) == [*whole, (None, '{"torn"', None)]


def test_bare_cr_ends_lines_and_a_split_crlf_is_one_line_end() -> None:
    assert sse.events(b"data: 1\r\rdata: 2\r\r") == [(None, "1", None), (None, "2", None)]
    reader = sse.SseReader()
    assert reader.feed(b"data: 1\r") == [] and reader.feed(b"\n\r") == [] and reader.feed(b"\n") == [(None, "1", None)]


def test_split_complete_keeps_the_bytes() -> None:
    assert sse.split_complete(b"data: 1\r\n\r\ndata: 2\n\ndata: 3") == (b"data: 1\r\n\r\ndata: 2\n\n", b"data: 3")
    assert sse.split_complete(b"data: 1") == (b"", b"data: 1")


def test_terminal_events_of_each_protocol() -> None:
    for ending in (b"data: [DONE]\n\n", b"event: message_stop\ndata: {}\n\n", b"event: response.failed\n"):
        assert sse.has_terminal_event(b"data: {}\n\n" + ending)
    assert not sse.has_terminal_event(b'data: {"text": "event: message_stop"}\n\n')


@pytest.mark.parametrize("method, path, name", [
    ("POST", "/v1/chat/completions?x=1", "chat"), ("POST", "/v1/completions/", "completions"),
    ("POST", "/v1/messages/count_tokens", "anthropic_count_tokens"), ("POST", "/v1/messages", "anthropic"),
    ("POST", "/v1/responses", "responses"), ("GET", "/v1/models", "models"), ("POST", "/v1/models", "models"),
    ("GET", "/v1/chat/completions", "other"), ("POST", "/v1/embeddings", "other"),
])
def test_protocol_name_of_a_recorded_request(method: str, path: str, name: str) -> None:
    assert endpoints.protocol_name(method, path) == name
    kind = endpoints.classify(method, path.partition("?")[0].rstrip("/"))
    assert (kind[0] if kind else "other") == name or (name, method) == ("models", "POST")


def test_one_prefix_parser_for_the_proxy_replay_and_mitmproxy_files() -> None:
    rest, found = endpoints.strip_prefixes("/k/sk%2Done/e/ep%201/r/judge/v1/messages")
    assert (rest, found.episode, found.role, found.token) == ("/v1/messages", "ep 1", "judge", "sk-one")
    assert endpoints.strip_prefixes("/e/ep")[0] == "/" and endpoints.strip_prefixes("/v1/e/x")[0] == "/v1/e/x"


def test_error_bodies_have_one_status_table() -> None:
    """Anthropic's documented types; 503 (the proxy's own refusals) stays `api_error`, which the proxy
    always sent and the translator's copy had as `overloaded_error` (Anthropic's type for 529 only)."""
    kinds = {s: errors.error_body("anthropic", s, "m")["error"]["type"] for s in (400, 404, 413, 422, 500, 503, 529)}
    assert kinds == {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
                     422: "invalid_request_error", 500: "api_error", 503: "api_error", 529: "overloaded_error"}
    assert errors.error_body("chat", 503, "m") == {
        "error": {"message": "m", "type": "server_error", "param": None, "code": None}}
    assert json.loads(addon_errors.error_body("responses", 503, "m", "recording_failed")) == {
        "error": {"message": "m", "type": "recording_failed", "param": None, "code": "recording_failed"}}
    anthropic = json.loads(addon_errors.error_body("anthropic_count_tokens", 401, "m", "x"))
    assert anthropic["error"]["type"] == "authentication_error"


def test_engine_ids_by_engine() -> None:
    choice = {"token_ids": [5, 6], "prompt_token_ids": [1]}
    assert engine_ids.vllm_prompt_ids({}, choice) == [1] and engine_ids.vllm_completion_ids(choice) == [5, 6]
    assert engine_ids.sglang_ids({"input_ids": [1], "output_ids": [2]}) == ([1], [2])
    values, ids = engine_ids.chat_logprobs({"content": [{"logprob": -0.5, "id": 7}, {"logprob": -1, "id": 8}]})
    assert (values, ids) == ([-0.5, -1.0], [7, 8])
    assert engine_ids.llamacpp_completion_ids(ids, {"completion_tokens": 2}) == [7, 8]
    assert engine_ids.llamacpp_completion_ids(ids, {"completion_tokens": 3}) == []  # merged entries: not the ids
    assert engine_ids.llamacpp_completion_ids([7, None], {}) == []
    assert engine_ids.has_token_ids({"choices": [{"logprobs": {"content": [{"id": 1}]}}]})


def test_vllm_responses_ids_from_response_messages() -> None:
    """vLLM 0.32's `enable_response_messages` answer: one raw entry each side is one generation's ids."""
    def raw(*tokens: int) -> list[dict]:
        return [{"message": "text", "tokens": list(tokens), "type": "raw_message_tokens"}]

    answer = {"output": [], "input_messages": raw(1, 2), "output_messages": raw(7, 2)}
    assert engine_ids.vllm_responses_ids(answer) == ([1, 2], [7, 2])
    assert engine_ids.has_token_ids({"type": "response.completed", "response": answer})
    assert engine_ids.body_has_token_ids(json.dumps(answer).encode())
    unasked = {"output": [], "input_messages": None, "output_messages": None}
    assert engine_ids.vllm_responses_ids(unasked) == (None, None) and not engine_ids.has_token_ids(unasked)
    assert not engine_ids.body_has_token_ids(json.dumps(unasked).encode())
    loop = dict(answer, output_messages=raw(7) + raw(3, 4))  # a server-side tool loop: two generations
    harmony = dict(answer, input_messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert engine_ids.vllm_responses_ids(loop) == engine_ids.vllm_responses_ids(harmony) == (None, None)


def test_generated_text_of_a_stream_is_that_of_the_whole_answer() -> None:
    from openforge.protocols import anthropic, chat, responses

    chunks = [{"choices": [{"delta": {"reasoning_content": "r"}, "token_ids": [1]}]},
              {"choices": [{"delta": {"content": "ok", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
                            "token_ids": [2]}], "usage": {"completion_tokens": 2}}]
    streamed = [chat.generated(c) for c in chunks]
    whole = chat.generated({"choices": [{"message": {"content": "ok", "reasoning_content": "r", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}, "token_ids": [1, 2]}], "usage": {"completion_tokens": 2}})
    assert sorted("".join(g.text for g in streamed)) == sorted(whole.text)
    assert [i for g in streamed for i in g.token_ids or []] == whole.token_ids and whole.output_tokens == 2
    events = [{"type": "content_block_start", "content_block": {"type": "tool_use", "name": "f"}},
              {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": '{"a": 1}'}},
              {"type": "message_delta", "usage": {"output_tokens": 3}}]
    assert "".join(anthropic.generated(e).text for e in events) == 'f{"a": 1}'
    assert anthropic.generated(events[-1]).output_tokens == 3
    assert anthropic.generated({"type": "message", "content": [
        {"type": "tool_use", "name": "f", "input": {"a": 1}}]}).text == 'f{"a": 1}'
    answer = {"output": [{"type": "function_call", "name": "f", "arguments": "{}"}], "usage": {"output_tokens": 4}}
    assert responses.generated(answer) == ("f{}", None, 4)
    assert responses.generated({"type": "response.completed", "response": answer}) == ("", None, 4)


def test_error_events_and_engine_messages() -> None:
    body = errors.error_body("responses", 502, "m")
    assert errors.error_event("responses", body) == b"event: error\ndata: " + json.dumps(body).encode() + b"\n\n"
    assert errors.error_event("chat", body) == b"data: " + json.dumps(body).encode() + b"\n\n"
    assert errors.engine_message({"error": {"message": "bad"}}) == "bad"
    assert errors.engine_message({"object": "error", "message": "gone"}) == "gone"
    assert errors.engine_message({"detail": "nope"}) == "nope" and errors.engine_message({}) is None
