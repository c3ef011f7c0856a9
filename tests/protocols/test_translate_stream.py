"""Answer translation (Chat Completions -> Anthropic Messages / Responses), streamed and not.

Every emitted event is validated against the official SDKs' pydantic event types, so a wrong field name
or a missing required field fails here.
"""

from __future__ import annotations

import json

import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.responses import Response, ResponseStreamEvent

from openforge.addons.translate import TranslationError, request_to_chat, response_from_chat, stream_translator
from openforge.testing.translate_engine import (
    ENGINE_ONLY_FIELDS,
    llamacpp_chunks,
    load_request,
    parse_sse,
    sse,
    tool_call_deltas,
    translate_all,
    vllm_chunks,
)

pytestmark = pytest.mark.addon

ANTHROPIC_EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
RESPONSES_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)
ARGS_A = '{"command": "ls -la", "description": "List files — ünïcode"}'
ARGS_B = '{"file_path": "/tmp/ä.txt"}'
MIXED = [{"reasoning_content": "Let me look "}, {"reasoning_content": "at the files."},
         {"content": "I'll run "}, {"content": "two tools ✓."},
         *tool_call_deltas(0, "call_a1", "Bash", ARGS_A), *tool_call_deltas(1, "call_b2", "Read", ARGS_B)]


def run(protocol: str, chunks: list[dict], request: dict | None = None, done: bool = True,
        sizes: list[int] | None = None) -> list[tuple[str, dict]]:
    raw = translate_all(stream_translator(protocol, request or {"model": "local-model"}), sse(chunks, done), sizes)
    events = parse_sse(raw)
    adapter = ANTHROPIC_EVENT if protocol == "anthropic" else RESPONSES_EVENT
    for name, payload in events:
        assert name == payload["type"]
        if name != "error" or protocol == "responses":
            adapter.validate_python(payload)
    text = raw.decode()
    assert not any(field in text for field in ENGINE_ONLY_FIELDS), "engine-only field leaked to the client"
    return events


def anthropic_message(events: list[tuple[str, dict]]) -> dict:
    """Fold Anthropic stream events into the final message, checking block bookkeeping on the way."""
    message, open_index = None, None
    for name, ev in events:
        if name == "message_start":
            message = json.loads(json.dumps(ev["message"]))
        elif name == "content_block_start":
            assert open_index is None and ev["index"] == len(message["content"])
            message["content"].append(dict(ev["content_block"], _json=""))
            open_index = ev["index"]
        elif name == "content_block_delta":
            assert ev["index"] == open_index
            block, delta = message["content"][ev["index"]], ev["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature",
                   "input_json_delta": "_json"}[delta["type"]]
            field = {"text": "text", "thinking": "thinking", "signature": "signature", "_json": "partial_json"}[key]
            block[key] = (block[key] if key != "signature" else "") + delta[field]
        elif name == "content_block_stop":
            assert ev["index"] == open_index
            open_index = None
        elif name == "message_delta":
            message.update(ev["delta"])
            message["usage"].update(ev["usage"])
    assert open_index is None
    for block in message["content"]:
        raw = block.pop("_json")
        if block["type"] == "tool_use":
            block["input"] = json.loads(raw) if raw else {}
    return message


def test_anthropic_stream_every_block_type_and_parallel_tools():
    events = run("anthropic", vllm_chunks(MIXED, "tool_calls"))
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 4
    message = anthropic_message(events)
    thinking, text, call_a, call_b = message["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] == "Let me look at the files."
    assert thinking["signature"]  # a signature_delta closes every thinking block
    assert text == {"type": "text", "text": "I'll run two tools ✓."}
    assert (call_a["id"], call_a["name"], call_a["input"]) == ("call_a1", "Bash", json.loads(ARGS_A))
    assert (call_b["id"], call_b["name"], call_b["input"]) == ("call_b2", "Read", json.loads(ARGS_B))
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["id"] == "msg_chatcmpl-7f3a" and message["model"] == "local-model"
    assert message["usage"]["input_tokens"] == 40 - 16 and message["usage"]["cache_read_input_tokens"] == 16
    assert message["usage"]["output_tokens"] > 0
    assert events[0][1]["message"]["usage"]["input_tokens"] == 40  # prompt_token_ids of the first chunk


def test_responses_stream_every_item_type_and_parallel_tools():
    request = load_request("codex")
    events = run("responses", vllm_chunks(MIXED, "tool_calls"), request)
    assert [ev["sequence_number"] for _, ev in events] == list(range(len(events)))
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"] and names[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.output_item.done"):
        assert names.count(kind) == 4
    assert {"response.reasoning_text.delta", "response.output_text.delta", "response.output_text.done",
            "response.content_part.added", "response.content_part.done",
            "response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(names)
    final = events[-1][1]["response"]
    assert final["status"] == "completed"
    reasoning, message, call_a, call_b = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "Let me look at the files."
    assert message["content"][0]["text"] == "I'll run two tools ✓."
    assert (call_a["call_id"], call_a["name"], call_a["arguments"]) == ("call_a1", "Bash", ARGS_A)
    assert (call_b["call_id"], call_b["arguments"]) == ("call_b2", ARGS_B)
    assert final["usage"] == {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 16},
                              "output_tokens": final["usage"]["output_tokens"],
                              "output_tokens_details": {"reasoning_tokens": 0},
                              "total_tokens": 40 + final["usage"]["output_tokens"]}
    deltas = "".join(ev["delta"] for n, ev in events if n == "response.function_call_arguments.delta"
                     and ev["item_id"] == call_a["id"])
    assert deltas == ARGS_A
    done_items = [ev["item"] for n, ev in events if n == "response.output_item.done"]
    assert done_items == final["output"]
    assert final["tools"] == request["tools"] and final["model"] == "local-model"


@pytest.mark.parametrize("protocol", ["anthropic", "responses"])
def test_every_byte_split_gives_identical_output(protocol):
    """SSE events and UTF-8 characters cut anywhere by network reads must not change a single byte."""
    deltas = [{"reasoning_content": "ü"}, {"content": "héllo ✓"}, *tool_call_deltas(0, "call_x", "Bash",
                                                                                    '{"c":"ß"}', pieces=2)]
    data = sse(vllm_chunks(deltas, "tool_calls", prompt_tokens=3, logprobs=False))
    whole = translate_all(stream_translator(protocol, {"model": "m"}), data)
    for cut in range(1, len(data)):
        translator = stream_translator(protocol, {"model": "m"})
        assert translator.feed(data[:cut]) + translator.feed(data[cut:]) + translator.finish() == whole, cut
    assert translate_all(stream_translator(protocol, {"model": "m"}), data, sizes=[1]) == whole
    crlf = data.replace(b"\n", b"\r\n")
    assert translate_all(stream_translator(protocol, {"model": "m"}), crlf, sizes=[1, 2, 3]) == whole


@pytest.mark.parametrize("finish,stop_reason,anthropic,responses", [
    ("stop", None, "end_turn", ("response.completed", None)),
    ("length", None, "max_tokens", ("response.incomplete", "max_output_tokens")),
    ("stop", "END", "stop_sequence", ("response.completed", None)),
    ("content_filter", None, "refusal", ("response.incomplete", "content_filter")),
])
def test_stop_reasons_round_trip(finish, stop_reason, anthropic, responses):
    request = {"model": "m", "stop_sequences": ["END"], "max_tokens": 5}
    chunks = vllm_chunks([{"content": "abc"}], finish, stop_reason=stop_reason)
    message = anthropic_message(run("anthropic", chunks, request))
    assert message["stop_reason"] == anthropic
    assert message["stop_sequence"] == ("END" if anthropic == "stop_sequence" else None)
    name, ev = run("responses", chunks)[-1]
    assert name == responses[0]
    assert (ev["response"]["incomplete_details"] or {}).get("reason") == responses[1]


@pytest.mark.parametrize("protocol", ["anthropic", "responses"])
def test_done_without_usage_counts_streamed_token_ids(protocol):
    chunks = vllm_chunks([{"content": "hello"}, {"content": " world"}], "stop", prompt_tokens=7, usage=False)
    events = run(protocol, chunks)
    if protocol == "anthropic":
        usage = anthropic_message(events)["usage"]
        assert (usage["input_tokens"], usage["output_tokens"]) == (7, 3 + 3 + 1)
    else:
        usage = events[-1][1]["response"]["usage"]
        assert (usage["input_tokens"], usage["output_tokens"]) == (7, 7)


@pytest.mark.parametrize("protocol", ["anthropic", "responses"])
def test_llamacpp_stream_keeps_its_extras_out(protocol):
    events = run(protocol, llamacpp_chunks("the files are README and src"))
    if protocol == "anthropic":
        message = anthropic_message(events)
        assert message["content"] == [{"type": "text", "text": "the files are README and src"}]
        assert message["usage"]["input_tokens"] == 12 and message["usage"]["output_tokens"] == 6
    else:
        assert events[-1][1]["response"]["output"][0]["content"][0]["text"] == "the files are README and src"


@pytest.mark.parametrize("error_chunk", [
    {"error": {"message": "CUDA out of memory", "type": "InternalServerError", "code": 500}},
    {"object": "error", "message": "CUDA out of memory", "type": "InternalServerError", "code": 500},
])
def test_engine_error_mid_stream(error_chunk):
    chunks = vllm_chunks([{"content": "partial"}], "stop")[:2] + [error_chunk]
    events = run("anthropic", chunks, done=False)
    assert [n for n, _ in events] == ["message_start", "content_block_start", "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "CUDA out of memory"}}
    events = run("responses", chunks, done=False)
    assert events[-1][0] == "response.failed"
    assert events[-1][1]["response"]["error"]["message"] == "CUDA out of memory"


def test_engine_error_as_first_event_and_llamacpp_error_field():
    data = b'error: {"code": 500, "message": "model not loaded", "type": "server_error"}\n\n'
    out = parse_sse(translate_all(stream_translator("anthropic", {"model": "m"}), data))
    assert out == [("error", {"type": "error", "error": {"type": "api_error", "message": "model not loaded"}})]
    out = parse_sse(translate_all(stream_translator("responses", {"model": "m"}), data))
    assert [n for n, _ in out] == ["response.created", "response.in_progress", "response.failed"]
    RESPONSES_EVENT.validate_python(out[-1][1])


def test_stream_cut_short_closes_blocks_and_reports_an_error():
    chunks = vllm_chunks([{"content": "hal"}, *tool_call_deltas(0, "call_z", "Bash", '{"comm', 1)], "stop")
    events = run("anthropic", chunks[:-2], done=False)  # no finish_reason, no usage, no [DONE]
    names = [n for n, _ in events]
    assert names.count("content_block_start") == names.count("content_block_stop") == 2
    assert names[-1] == "error" and "message_stop" not in names
    events = run("responses", chunks[:-2], done=False)
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.failed" and final["status"] == "failed"
    assert [i["status"] for i in final["output"]] == ["completed", "incomplete"]
    assert final["output"][1]["arguments"] == '{"comm'


def test_finish_reason_without_done_still_ends_the_message():
    events = run("anthropic", vllm_chunks([{"content": "ok"}], "stop"), done=False)
    assert [n for n, _ in events][-2:] == ["message_delta", "message_stop"]
    events = run("responses", vllm_chunks([{"content": "ok"}], "stop", usage=False), done=False)
    assert events[-1][0] == "response.completed"


def test_empty_engine_stream_is_an_error_not_a_hang():
    assert [n for n, _ in parse_sse(stream_translator("anthropic", {}).finish())] == ["error"]
    assert parse_sse(stream_translator("responses", {}).finish())[-1][0] == "response.failed"


def test_tool_call_whose_name_arrives_after_arguments_and_interleaved_text():
    deltas = [{"tool_calls": [{"index": 0, "id": "call_q", "function": {"arguments": '{"a"'}}]},
              {"tool_calls": [{"index": 0, "function": {"name": "Bash", "arguments": ": 1}"}}]},
              {"content": "done"}]
    message = anthropic_message(run("anthropic", vllm_chunks(deltas, "tool_calls")))
    assert [b["type"] for b in message["content"]] == ["tool_use", "text"]
    assert message["content"][0]["input"] == {"a": 1} and message["content"][0]["name"] == "Bash"


# --- non-streaming ---------------------------------------------------------------------------------

CHAT_RESPONSE = {
    "id": "chatcmpl-9", "object": "chat.completion", "created": 1760000001, "model": "engine-model",
    "prompt_token_ids": [1, 2, 3],
    "choices": [{"index": 0, "finish_reason": "tool_calls", "stop_reason": None, "token_ids": [5, 6],
                 "logprobs": {"content": [{"token": "token_id:5", "logprob": -0.1}]},
                 "message": {"role": "assistant", "content": "Two calls.", "reasoning_content": "think",
                             "tool_calls": [
                                 {"id": "call_1", "type": "function",
                                  "function": {"name": "Bash", "arguments": ARGS_A}},
                                 {"id": "call_2", "type": "function",
                                  "function": {"name": "Read", "arguments": ARGS_B}}]}}],
    "usage": {"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70,
              "prompt_tokens_details": {"cached_tokens": 32}, "completion_tokens_details": {"reasoning_tokens": 4}},
}


def test_non_streaming_anthropic_message():
    message = response_from_chat("anthropic", CHAT_RESPONSE, {"model": "local-model"})
    Message.model_validate(message)
    assert "token_ids" not in json.dumps(message) and "logprob" not in json.dumps(message)
    assert [b["type"] for b in message["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert [(b["id"], b["input"]) for b in message["content"][2:]] == [("call_1", json.loads(ARGS_A)),
                                                                      ("call_2", json.loads(ARGS_B))]
    assert message["stop_reason"] == "tool_use" and message["model"] == "local-model"
    assert message["usage"] == {"input_tokens": 18, "output_tokens": 20, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 32}


def test_non_streaming_responses_object():
    response = response_from_chat("responses", CHAT_RESPONSE, load_request("codex"))
    Response.model_validate(response)
    assert "token_ids" not in json.dumps(response)
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert [(i["call_id"], i["arguments"]) for i in response["output"][2:]] == [("call_1", ARGS_A), ("call_2", ARGS_B)]
    assert response["status"] == "completed"
    assert response["usage"] == {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 32},
                                 "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 4},
                                 "total_tokens": 70}
    truncated = {**CHAT_RESPONSE, "choices": [{**CHAT_RESPONSE["choices"][0], "finish_reason": "length"}]}
    response = response_from_chat("responses", truncated, {"model": "m"})
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response_from_chat("anthropic", truncated, {"model": "m"})["stop_reason"] == "max_tokens"


def test_non_streaming_without_choices_is_a_gateway_error():
    with pytest.raises(TranslationError) as err:
        response_from_chat("anthropic", {"error": {"message": "boom"}}, {})
    assert err.value.status == 502 and "boom" in err.value.message


# --- round trips: the client's next request carries our answer back --------------------------------

def test_anthropic_round_trip_preserves_ids_and_arguments():
    message = anthropic_message(run("anthropic", vllm_chunks(MIXED, "tool_calls")))
    body = load_request("claude_code")
    body["messages"] += [{"role": "assistant", "content": message["content"]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
                                                      for b in message["content"] if b["type"] == "tool_use"]}]
    chat, _ = request_to_chat("anthropic", body)
    assistant = chat["messages"][-3]
    assert assistant["reasoning_content"] == "Let me look at the files."
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in assistant["tool_calls"]] == [
        ("call_a1", json.loads(ARGS_A)), ("call_b2", json.loads(ARGS_B))]
    assert [m["tool_call_id"] for m in chat["messages"][-2:]] == ["call_a1", "call_b2"]


def test_responses_round_trip_preserves_ids_and_argument_bytes():
    events = run("responses", vllm_chunks(MIXED, "tool_calls"))
    output = events[-1][1]["response"]["output"]
    body = load_request("codex")
    body["input"] += output + [{"type": "function_call_output", "call_id": i["call_id"], "output": "ok"}
                               for i in output if i["type"] == "function_call"]
    chat, _ = request_to_chat("responses", body)
    assistant = chat["messages"][-3]
    assert assistant["content"] == "I'll run two tools ✓." and assistant["reasoning_content"].startswith("Let me")
    assert [(c["id"], c["function"]["arguments"]) for c in assistant["tool_calls"]] == [
        ("call_a1", ARGS_A), ("call_b2", ARGS_B)]
