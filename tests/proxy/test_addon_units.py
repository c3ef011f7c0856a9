"""Pure pieces of the addon: option parsing, request classification, masking, SSE stripping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openforge.addons import options, profiles, wire
from openforge.protocols import endpoints, engine_ids

pytestmark = pytest.mark.addon


def settings(tmp_path: Path, **values: str):
    return options.parse({"openforge_upstream_url": "http://127.0.0.1:8000/v1",
                          "openforge_flow_dir": str(tmp_path), **values})


def test_defaults_and_upstream_prefix(tmp_path: Path) -> None:
    s = settings(tmp_path)
    assert (s.upstream_host, s.upstream_port, s.upstream_prefix) == ("127.0.0.1", 8000, "")
    assert s.engine_profile == "auto" and s.translate == "auto" and s.default_role == "agent"
    assert settings(tmp_path, openforge_upstream_url="https://gw/llm/v1").upstream_prefix == "/llm"


def test_env_supplies_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENFORGE_UPSTREAM_KEY", "sk-from-env-123456789")
    assert settings(tmp_path).upstream_key == "sk-from-env-123456789"
    assert next(s for s in options.SPECS if s.secret).default() == ""  # never copied into mitmproxy defaults


def test_models_routing_inline_and_toml(tmp_path: Path) -> None:
    s = settings(tmp_path, openforge_models=json.dumps(
        {"agent": {"models": {"claude-*": "qwen", "gpt-4o": "qwen-big"}, "sampling": {"temperature": 1.0}}}))
    route = s.route("agent")
    assert route.upstream_model("claude-sonnet") == "qwen" and route.upstream_model("gpt-4o") == "qwen-big"
    assert route.upstream_model("other") == "other" and s.route("validator") is None
    toml = tmp_path / "models.toml"
    toml.write_text('["*".models]\n"*" = "one-model"\n')
    assert settings(tmp_path, openforge_models=str(toml)).route("anything").upstream_model("x") == "one-model"


@pytest.mark.parametrize(("values", "message"), [
    ({"openforge_models": '{"agent": {"model": {}}}'}, "only 'models' and 'sampling'"),
    ({"openforge_models": "/nope/models.json"}, "cannot read"),
    ({"openforge_fsync_interval": "-1"}, "must be a number >= 0"),
    ({"openforge_record_other": "maybe"}, "must be true or false"),
    ({"openforge_engine_profile": "tgi"}, "must be one of auto, vllm"),
    ({"openforge_upstream_url": ""}, "is not set"),
])
def test_bad_values_have_clear_messages(tmp_path: Path, values: dict[str, str], message: str) -> None:
    with pytest.raises(options.BadOption, match=message):
        settings(tmp_path, **values)


def test_classify_and_prefixes() -> None:
    assert endpoints.classify("POST", "/v1/chat/completions") == ("chat", "/v1/chat/completions")
    assert endpoints.classify("POST", "/backend-api/codex/responses") == ("responses", "/v1/responses")
    assert endpoints.classify("POST", "/v1/messages/count_tokens")[0] == "anthropic_count_tokens"
    assert endpoints.classify("GET", "/v1/models")[0] == "models"
    assert endpoints.classify("GET", "/v1/chat/completions") is None and endpoints.classify("POST", "/health") is None
    assert endpoints.strip_prefixes("/e/ep%201/r/vl/v1/messages") == ("/v1/messages", endpoints.Prefixes("ep 1", "vl"))
    assert endpoints.strip_prefixes("/r/a/k/tok%2Fen/e/b/v1/x") == ("/v1/x", endpoints.Prefixes("b", "a", "tok/en"))


def test_mask_and_toolchain() -> None:
    assert wire.mask("Bearer sk-abcdefghijklmnop") == "Bearer sk-a…mnop"
    assert wire.mask("sk-abcdefghijklmnop") == "sk-a…mnop" and wire.mask("short") == "…"
    headers = wire.masked_fields([(b"X-Api-Key", b"sk-abcdefghijklmnop"), (b"accept", b"*/*")])
    assert headers == [["X-Api-Key", "sk-a…mnop"], ["accept", "*/*"]]
    assert wire.toolchain("claude-cli/2.0.1 (external, cli)") == "claude-code"
    assert wire.toolchain("codex_cli_rs/0.40.0") == "codex"
    assert wire.proxy_auth_user("Basic ZXAtYXV0aDp4") == "ep-auth" and wire.proxy_auth_user("Bearer x") is None


def test_inject_per_profile() -> None:
    body: dict = {"messages": []}
    assert profiles.inject("vllm", "chat", body) == ["return_token_ids", "logprobs"]
    assert profiles.inject("llamacpp", "chat", {"logprobs": True}) == []
    assert profiles.inject("generic", "completions", {}) == ["logprobs"]
    assert profiles.inject("vllm", "anthropic", {}) == []
    body = {"input": "hi"}
    assert profiles.inject("vllm", "responses", body) == ["enable_response_messages"]
    assert body["enable_response_messages"] is True
    assert profiles.inject("vllm", "responses", {"enable_response_messages": True}) == []  # the client's own
    assert profiles.inject("sglang", "responses", {}) == profiles.inject("generic", "responses", {}) == []


# (arguments as a client sends them back, as llama.cpp 2026.10's template engine renders them: measured through
# its /apply-template); None: left as sent (not an object or array, or not a fixed point of its parse and render)
LLAMACPP_ARGUMENTS = [
    ('{"expression": "12 \\u00d7 7"}', '{"expression": "12 × 7"}'),
    ('{"expression" : "12 × 7"}', '{"expression": "12 × 7"}'),
    ('{"x":"a\\nb\\t\\u0001/\\\\"}', '{"x": "a\\nb\\t\\u0001/\\\\"}'),
    ('{"x": "\\ud83d\\ude00", "y": "say \\"hi\\""}', '{"x": "😀", "y": "say \\"hi\\""}'),
    ('{"x": 1.0, "y": 100.0, "z": 1.5e10, "w": 3.14159265358979, "v": 1e-7}',
     '{"x": 1, "y": 100, "z": 1.5e+10, "w": 3.14159, "v": 1e-07}'),
    ('{"big": 12345678901234567890123, "n": [1, {"a": null}, true]}',
     '{"big": 1.23457e+22, "n": [1, {"a": null}, true]}'),
    ('{"a":1,"a":2}', '{"a": 2}'),
    ("[1,2]", "[1, 2]"),
    ('{"x": -0.0}', None),
    ('"a string"', None),
    ("not json", None),
    ('{"x": 1e400}', None),
]


@pytest.mark.parametrize(("sent", "rendered"), LLAMACPP_ARGUMENTS)
def test_llamacpp_tool_call_arguments_are_sent_as_it_renders_them(sent: str, rendered: str | None) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": sent}}]}]}
    changed = profiles.normalize("llamacpp", "chat", body)
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == (rendered or sent)
    assert changed == (["messages"] if rendered not in (None, sent) else [])
    assert profiles.normalize("vllm", "chat", json.loads(json.dumps(body))) == []


# vLLM 0.32's Responses stream with `enable_response_messages` (a 3-token answer, events shortened): the ids
# come on the final event only; unasked, vLLM answers both fields null on every event.
RAW = [{"message": "<|im_start|>user\nSay hi<|im_end|>\n", "tokens": [1, 4093, 198, 2], "type": "raw_message_tokens"}]
VLLM_RESPONSES_EVENTS = [
    {"response": {"id": "resp_1", "output": [], "status": "in_progress", "top_logprobs": None,
                  "input_messages": None, "output_messages": None}, "sequence_number": 0, "type": "response.created"},
    {"content_index": 0, "delta": "I", "item_id": "msg_1", "logprobs": [], "output_index": 0,
     "sequence_number": 1, "type": "response.output_text.delta"},
    {"response": {"id": "resp_1", "status": "incomplete", "top_logprobs": None, "output": [
        {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
         "content": [{"annotations": [], "text": "I'm glad", "type": "output_text", "logprobs": None}]}],
        "input_messages": RAW, "output_messages": [{"message": "I'm glad", "tokens": [57, 5248, 18948],
                                                    "type": "raw_message_tokens"}]},
     "sequence_number": 2, "type": "response.completed"},
]


def test_sse_stripper_gives_a_vllm_responses_stream_as_unasked() -> None:
    stream = b"".join(f"event: {e['type']}\ndata: {json.dumps(e, separators=(',', ':'))}\n\n".encode()
                      for e in VLLM_RESPONSES_EVENTS)
    whole = profiles.SseStripper(["enable_response_messages"])
    out = whole.feed(stream) + whole.feed(b"")
    assert whole.saw_ids
    unasked = json.loads(json.dumps(VLLM_RESPONSES_EVENTS))
    unasked[2]["response"].update(input_messages=None, output_messages=None)
    assert [json.loads(line[5:]) for line in out.split(b"\n") if line.startswith(b"data:")] == unasked
    assert out.split(b"\n\n")[:2] == stream.split(b"\n\n")[:2]  # events without ids pass byte for byte
    for cut in range(1, len(stream), 7):
        s = profiles.SseStripper(["enable_response_messages"])
        assert s.feed(stream[:cut]) + s.feed(stream[cut:]) + s.feed(b"") == out
    answer = json.loads(json.dumps(VLLM_RESPONSES_EVENTS[2]["response"]))
    assert profiles.strip(answer, ["enable_response_messages"]) and answer == unasked[2]["response"]
    assert not profiles.strip(answer, ["enable_response_messages"])  # nothing left: the bytes stay as they are


@pytest.mark.parametrize("body, found", [
    (b'{"choices": [], "prompt_token_ids": [1, 2, 3]}', b"[1, 2, 3]"),
    (b'{"prompt_token_ids" :\n[4,5], "x": "say \\"prompt_token_ids\\": [9]"}', b"[4,5]"),  # escaped: a string
    (b'{"prompt_token_ids": [1], "choices": [{"prompt_token_ids": [1]}]}', None),  # twice: not cut
    (b'{"prompt_token_ids": [[1], [2]]}', None),
    (b'{"prompt_token_ids": []}', None),
    (b'{"prompt_token_ids": null}', None),
    (b'{"content": "prompt_token_ids"}', None),
])
def test_prompt_ids_are_cut_unparsed_only_when_unambiguous(body: bytes, found: bytes | None) -> None:
    span = engine_ids.prompt_ids_span(body)
    assert (body[span[0]:span[1]] if span else None) == found
    expected = json.loads(body)
    if found:
        expected["prompt_token_ids"] = []
    assert profiles.loads_without_prompt_ids(body) == (expected, found is not None)


def test_encode_json_is_ascii_and_keeps_lone_surrogates() -> None:
    obj = json.loads(b'{"content": "caf\\u00e9 \\ud800 \xe2\x80\x94"}')  # a client may send a lone surrogate
    out = profiles.encode_json(obj).encode()  # an ensure_ascii=False encoder fails here (UnicodeEncodeError)
    assert out.isascii() and json.loads(out) == obj


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
def test_sse_stripper_any_split_gives_the_same_bytes(sep: bytes) -> None:
    events = [
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "hé"}, "logprobs": {"content": [{"id": 5}]},
                                 "token_ids": [5, 6]}], "prompt_token_ids": [1, 2]},
        {"id": "c", "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]},
    ]
    stream = b"".join(b"data: " + json.dumps(e).encode() + sep for e in events) + b"data: [DONE]" + sep
    whole = profiles.SseStripper(["return_token_ids", "logprobs"])
    expected = whole.feed(stream) + whole.feed(b"")
    assert whole.saw_ids
    got = [json.loads(line[6:]) for line in expected.split(sep) if line.startswith(b"data: {")]
    assert got[0] == {"id": "c", "choices": [{"index": 0, "delta": {"content": "hé"}, "logprobs": None}]}
    assert expected.endswith(b"data: [DONE]" + sep)
    for cut in range(1, len(stream)):
        s = profiles.SseStripper(["return_token_ids", "logprobs"])
        assert s.feed(stream[:cut]) + s.feed(stream[cut:]) + s.feed(b"") == expected


def test_credentials_in_headers_and_query_are_recognised_and_masked() -> None:
    assert all(wire.is_secret_header(n) for n in (b"Authorization", b"api-key", b"X-Goog-Api-Key", b"x-auth-token"))
    assert not any(wire.is_secret_header(n) for n in (b"content-type", b"session-id", b"x-openforge-episode"))
    assert wire.public_query("key=AIza-1&keep=1&API_KEY=x&access_token=t") == "keep=1"
    url = "http://h/k/of-client-token-0123456789/e/x/v1/chat?key=AIzaSECRET-0123456789&keep=1"
    assert wire.masked_url(url) == "http://h/k/of-c…6789/e/x/v1/chat?key=AIza…6789&keep=1"
    assert wire.masked_url("http://h/v1/chat") == "http://h/v1/chat"


def test_printable_escapes_control_characters() -> None:
    assert wire.printable("ep\n[12:00:00.000] forged\x1b[2J\u2028") == "ep\\x0a[12:00:00.000] forged\\x1b[2J\\u2028"
    assert wire.printable("plain café") == "plain café"


def test_printable_escapes_bidi_and_invisible_characters() -> None:
    """A right-to-left override (U+202E) shows `ep-gnp.exe` as `ep-exe.png`; isolates, zero-width characters
    and the byte-order mark hide or reorder text the same way."""
    assert wire.printable("ep-\u202egnp.exe") == "ep-\\u202egnp.exe"
    assert wire.printable("a\u2066b\u2069c\u200bd\u200fe\ufefff\u061c") == (
        "a\\u2066b\\u2069c\\u200bd\\u200fe\\ufefff\\u061c")


def test_sse_stripper_strips_an_event_that_is_not_utf8() -> None:
    event = b'data: {"choices": [{"delta": {"content": "caf\xff"}, "token_ids": [5], "logprobs": {"content": []}}]}\n\n'
    s = profiles.SseStripper(["return_token_ids", "logprobs"])
    out = s.feed(event) + s.feed(b"")
    assert b"token_ids" not in out and json.loads(out[6:])["choices"][0]["logprobs"] is None and s.saw_ids


def test_routes_are_described_in_one_line(tmp_path: Path) -> None:
    s = settings(tmp_path, openforge_models=json.dumps({"agent": {"models": {"claude-*": "qwen"},
                                                                  "sampling": {"temperature": 1.0}},
                                                        "judge": {"sampling": {"top_p": 0.9}}}))
    assert options.describe_routes(s.routes) == ("agent: claude-*->qwen sampling temperature=1.0; "
                                                 "judge: models unchanged sampling top_p=0.9")
    assert options.describe_routes({}).startswith("none")
