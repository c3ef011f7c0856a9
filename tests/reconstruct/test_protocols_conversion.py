"""The proxy's conversion of Anthropic / Responses conversations is reconstruct's: a call the proxy translated
to Chat Completions and one it forwarded as it came train on the same messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from openforge.addons import translate
from openforge.protocols import anthropic, responses
from openforge.reconstruct import calls as reconstruct_calls
from openforge.reconstruct.calls import parse_record

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
ANTHROPIC = {
    "model": "m", "max_tokens": 64,
    "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Use tools."}],
    "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}, "cache_control": {}},
              {"name": "Read", "input_schema": {"type": "object"}, "strict": True},
              {"type": "computer_20250124", "name": "computer", "display_width_px": 112, "display_height_px": 112}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, IMAGE]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "first ", "signature": "s"},
            {"type": "thinking", "thinking": "second", "signature": "s"},
            {"type": "text", "text": "I will list."},
            {"type": "text", "text": "Then read."},
            {"type": "tool_use", "id": "t0", "name": "Bash", "input": {"command": "ls ü"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t0", "content": [{"type": "text", "text": "a"},
                                                                     {"type": "text", "text": "b"}, IMAGE]},
            {"type": "text", "text": "go on"}]},
    ],
}
RESPONSES = {
    "model": "m", "instructions": "Be brief.",
    "tools": [{"type": "function", "name": "sh", "parameters": {"type": "object"}, "strict": False},
              {"type": "function", "name": "noop", "description": "nothing"}],
    "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "base"}]},
        {"role": "user", "content": "list"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "one "},
                                                                       {"type": "reasoning_text", "text": "two"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "three"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running."}]},
        {"type": "function_call", "call_id": "c1", "name": "sh", "arguments": '{"cmd": "ls"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
    ],
}
CHAT_ANSWER = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}
NATIVE_ANSWER = {
    "anthropic": {"type": "message", "content": [{"type": "text", "text": "ok"}], "stop_reason": "end_turn",
                  "usage": {}},
    "responses": {"status": "completed", "usage": {}, "output": [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]},
}


def record(protocol: str, upstream: dict[str, Any], answer: dict[str, Any], translated: bool) -> dict[str, Any]:
    req = {"method": "POST", "url": "http://x/v1", "headers": [], "body": json.dumps(upstream).encode()}
    return {"type": "exchange", "id": "r1", "protocol": protocol, "complete": True, "error": None,
            "client_request": req, "upstream_request": req,
            "translated": {"from": protocol, "to": "chat"} if translated else None,
            "response": {"status": 200, "headers": [], "body": json.dumps(answer).encode(), "chunks": None,
                         "streamed": False}}


@pytest.mark.parametrize("protocol, body", [("anthropic", ANTHROPIC), ("responses", RESPONSES)])
def test_a_translated_call_and_a_forwarded_one_train_on_the_same_messages(protocol: str, body: dict) -> None:
    chat, _ = translate.request_to_chat(protocol, body)
    forwarded = parse_record(record(protocol, body, NATIVE_ANSWER[protocol], translated=False))
    sent = parse_record(record(protocol, chat, CHAT_ANSWER, translated=True))
    assert (forwarded.messages, forwarded.tools) == (sent.messages, sent.tools)
    assert [(i.mime, i.data) for i in forwarded.images] == [(i.mime, i.data) for i in sent.images]
    assert len(sent.images) == (2 if protocol == "anthropic" else 0)  # the user's and the tool result's


def test_assistant_blocks_join_as_the_engine_is_sent_them() -> None:
    """Text blocks join with "\\n", thinking blocks with ""; a Responses reasoning item gives its `content`
    texts joined by "", else its summary (the one kept choice where the two copies disagreed)."""
    call = parse_record(record("anthropic", ANTHROPIC, NATIVE_ANSWER["anthropic"], translated=False))
    assistant = call.messages[2]
    assert (assistant["content"], assistant["reasoning_content"]) == ("I will list.\nThen read.", "first second")
    call = parse_record(record("responses", RESPONSES, NATIVE_ANSWER["responses"], translated=False))
    assistant = next(m for m in call.messages if m["role"] == "assistant")
    assert (assistant["content"], assistant["reasoning_content"]) == ("Running.", "one twothree")


def test_an_answer_reads_as_the_next_call_echoes_it() -> None:
    """A forwarded answer's completion is the assistant message the next call's conversation converts to."""
    content = ANTHROPIC["messages"][1]["content"]
    answer = {"type": "message", "content": content, "stop_reason": "tool_use", "usage": {}}
    completion = parse_record(record("anthropic", ANTHROPIC, answer, translated=False)).completion
    echoed = {**ANTHROPIC, "messages": [*ANTHROPIC["messages"], {"role": "assistant", "content": content}]}
    assert parse_record(record("anthropic", echoed, answer, translated=False)).messages[-1] == completion


def test_the_proxy_and_reconstruct_call_one_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    for module in (anthropic, responses):
        real = module.messages
        monkeypatch.setattr(module, "messages", lambda body, drops, real=real, name=module.__name__: (
            calls.append(name), real(body, drops))[1])
    for protocol, body in (("anthropic", ANTHROPIC), ("responses", RESPONSES)):
        translate.request_to_chat(protocol, body)
        parse_record(record(protocol, body, NATIVE_ANSWER[protocol], translated=False))
    assert calls.count("openforge.protocols.anthropic") == 3  # the proxy, the prompt, the answer
    assert calls.count("openforge.protocols.responses") == 3


@pytest.mark.parametrize("patch, named", [
    ({"messages": [{"role": "user", "content": [{"type": "search_result", "source": "s"}]}]}, "search_result"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
])
def test_what_the_engine_cannot_take_is_skipped_not_dropped(patch: dict, named: str) -> None:
    with pytest.raises(reconstruct_calls.Skip) as skip:
        parse_record(record("anthropic", {**ANTHROPIC, **patch}, NATIVE_ANSWER["anthropic"], translated=False))
    assert skip.value.reason == "unsupported_request" and named in skip.value.detail
