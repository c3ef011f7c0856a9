"""Request translation (Anthropic Messages / Responses -> Chat Completions) on recorded real client requests,
plus error bodies, count_tokens and the translate-mode decision."""

from __future__ import annotations

import copy
import json

import pytest

from openforge.addons.translate import (
    TranslationError,
    count_tokens_request,
    count_tokens_response,
    error_body,
    needs_translation,
    request_to_chat,
)
from openforge.testing.translate_engine import load_request

pytestmark = pytest.mark.addon


def test_claude_code_request_maps_every_part_and_records_drops():
    body = load_request("claude_code")
    chat, dropped = request_to_chat("anthropic", body)

    system, user, inline_system, assistant, tool = chat["messages"]
    assert system["role"] == "system"
    assert system["content"] == "\n".join(b["text"] for b in body["system"])
    assert user == {"role": "user", "content": "\n".join(b["text"] for b in body["messages"][0]["content"])}
    assert inline_system == {"role": "system", "content": body["messages"][1]["content"]}  # stays in place
    assert assistant["content"] == "I'll list the files in the current directory."
    assert assistant["reasoning_content"].startswith("The user wants the files listed.")
    [call] = assistant["tool_calls"]
    assert call["id"] == "toolu_01A2b3C4d5E6f7G8h9J0kLmN" and call["function"]["name"] == "Bash"
    assert json.loads(call["function"]["arguments"]) == body["messages"][2]["content"][2]["input"]
    assert tool == {"role": "tool", "tool_call_id": call["id"], "content": "README.md\nsetup.py\nsrc"}

    assert [t["function"]["name"] for t in chat["tools"]] == ["Bash", "Read", "WebFetch", "TodoWrite"]
    assert chat["tools"][0]["function"]["parameters"] == body["tools"][0]["input_schema"]
    assert all(set(t) == {"type", "function"} and t["type"] == "function" for t in chat["tools"])
    assert chat["max_tokens"] == 32000 and chat["temperature"] == 1
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert "chat_template_kwargs" not in chat  # adaptive thinking: the template's default decides
    assert set(dropped) == {"cache_control", "signature", "is_error", "defer_loading", "thinking",
                            "output_config", "metadata", "context_management"}
    json.dumps(chat)  # plain JSON, nothing the engine cannot read


def test_codex_request_maps_every_item_and_records_drops():
    body = load_request("codex")
    chat, dropped = request_to_chat("responses", body)

    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "system", "user", "user", "assistant", "tool"]
    assert chat["messages"][0]["content"].startswith("You are Codex")
    assistant, tool = chat["messages"][4:]
    assert assistant["content"] is None and assistant["reasoning_content"] == "I should run ls first."
    assert assistant["tool_calls"] == [{"id": "call_9f8e7d6c5b4a39281706f5e4", "type": "function",
                                        "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}}]
    assert tool["tool_call_id"] == "call_9f8e7d6c5b4a39281706f5e4" and tool["content"].endswith("src\n")
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command", "write_stdin", "update_plan",
                                                              "view_image"]
    assert chat["tools"][0]["function"]["strict"] is False
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is True
    assert chat["reasoning_effort"] == "medium" and chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert chat["stream_options"] == {"include_usage": True}
    assert set(dropped) == {"summary", "encrypted_content", "store", "include", "prompt_cache_key",
                            "client_metadata"}


def test_string_and_one_element_list_content_give_the_same_prompt():
    """Claude Code flips a message between a string and a one-element text list from turn to turn."""
    body = load_request("claude_code")
    flipped = copy.deepcopy(body)
    flipped["messages"][1]["content"] = [{"type": "text", "text": body["messages"][1]["content"]}]
    flipped["messages"][3]["content"][0]["content"] = [{"type": "text", "text": "README.md\nsetup.py\nsrc"}]
    assert request_to_chat("anthropic", flipped)[0] == request_to_chat("anthropic", body)[0]


def test_anthropic_images_tool_choice_thinking_stop_and_sampling():
    body = {
        "model": "m", "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
        "stop_sequences": ["END"], "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tool_choice": {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True},
        "tools": [{"type": "custom", "name": "Bash", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0K"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "text", "text": "What is shown?"}]}],
    }
    chat, dropped = request_to_chat("anthropic", body)
    assert chat["messages"] == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0K"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "text", "text": "What is shown?"}]}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "Bash"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and dropped == ["budget_tokens"]
    assert (chat["stop"], chat["top_k"], chat["top_p"], chat["temperature"]) == (["END"], 20, 0.9, 0.5)
    assert "stream" not in chat
    for kind, expected in (("auto", "auto"), ("any", "required"), ("none", "none")):
        body["tool_choice"] = {"type": kind}
        assert request_to_chat("anthropic", body)[0]["tool_choice"] == expected
    body["thinking"] = {"type": "disabled"}
    assert request_to_chat("anthropic", body)[0]["chat_template_kwargs"] == {"enable_thinking": False}


def test_anthropic_tool_result_with_image_and_text_then_user_text():
    body = {"model": "m", "max_tokens": 8, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Shot", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "text", "text": "screenshot:"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "AAAA"}}]},
            {"type": "text", "text": "Now describe it."}]}]}
    chat, _ = request_to_chat("anthropic", body)
    assert chat["messages"][0] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "Shot", "arguments": "{}"}}]}
    assert chat["messages"][1] == {"role": "tool", "tool_call_id": "toolu_1", "content": "screenshot:"}
    assert chat["messages"][2] == {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}},
        {"type": "text", "text": "Now describe it."}]}


@pytest.mark.parametrize("tool", [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    {"type": "computer_20990101", "name": "computer", "display_width_px": 1024, "display_height_px": 768},
    {"type": "bash_20250124", "name": "bash"},
    {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
    {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
])
def test_anthropic_server_tools_are_refused_not_dropped(tool):
    body = load_request("claude_code")
    body["tools"].append(tool)
    with pytest.raises(TranslationError) as err:
        request_to_chat("anthropic", body)
    assert err.value.status == 400 and tool["type"] in err.value.message


@pytest.mark.parametrize("tool", [
    {"type": "web_search", "search_context_size": "medium"},
    {"type": "namespace", "name": "collab", "tools": []},
    {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "linux"},
    {"type": "local_shell"},
])
def test_responses_non_function_tools_are_refused(tool):
    body = load_request("codex")
    body["tools"].append(tool)
    with pytest.raises(TranslationError) as err:
        request_to_chat("responses", body)
    assert err.value.status == 400 and repr(tool["type"]) in err.value.message


def test_responses_string_input_instructions_images_and_settings():
    body = {"model": "m", "instructions": "Be brief.", "input": "hi", "max_output_tokens": 99,
            "temperature": 0.2, "top_p": 0.8, "top_logprobs": 3, "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_schema", "name": "answer", "schema": {"type": "object"},
                                "strict": True}, "verbosity": "low"},
            "metadata": {"k": "v"}, "user": "u1", "truncation": "disabled", "service_tier": "auto"}
    chat, dropped = request_to_chat("responses", body)
    assert chat["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (chat["max_tokens"], chat["temperature"], chat["top_p"]) == (99, 0.2, 0.8)
    assert chat["logprobs"] is True and chat["top_logprobs"] == 3
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and "reasoning_effort" not in chat
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": {"type": "object"}, "strict": True}}
    assert set(dropped) == {"verbosity", "metadata", "user", "truncation", "service_tier"}

    body = {"model": "m", "reasoning": {"effort": "xhigh"}, "tool_choice": {"type": "function", "name": "f"},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "look"},
                {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "high"}]}]}
    chat, _ = request_to_chat("responses", body)
    assert chat["reasoning_effort"] == "high"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["messages"][0]["content"][1] == {"type": "image_url",
                                                 "image_url": {"url": "data:image/png;base64,AA", "detail": "high"}}


def test_responses_assistant_text_and_parallel_calls_form_one_turn():
    body = {"model": "m", "input": [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "plan"}],
         "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Running two.", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "call_id": "call_a", "name": "sh", "arguments": '{"cmd":"ls"}'},
        {"type": "function_call", "call_id": "call_b", "name": "sh", "arguments": '{"cmd":"pwd"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "x"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "/"}]},
    ]}
    chat, _ = request_to_chat("responses", body)
    user, assistant, out_a, out_b = chat["messages"]
    assert assistant["content"] == "Running two." and assistant["reasoning_content"] == "think"
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_a", "call_b"]
    assert (out_a["tool_call_id"], out_b["tool_call_id"], out_b["content"]) == ("call_a", "call_b", "/")


@pytest.mark.parametrize("patch", [{"previous_response_id": "resp_1"}, {"background": True},
                                   {"input": [{"type": "item_reference", "id": "msg_1"}]},
                                   {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}])
def test_responses_requests_needing_server_state_are_refused(patch):
    with pytest.raises(TranslationError) as err:
        request_to_chat("responses", {"model": "m", "input": "hi", **patch})
    assert err.value.status == 400


def test_unknown_protocol_is_a_programming_error():
    with pytest.raises(ValueError):
        request_to_chat("chat", {"messages": []})


def test_error_bodies_have_each_protocols_shape():
    assert error_body("anthropic", 400, "bad tool") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad tool"}}
    assert error_body("anthropic", 502, "down")["error"]["type"] == "api_error"
    assert error_body("anthropic", 529, "busy")["error"]["type"] == "overloaded_error"
    for protocol in ("chat", "completions", "responses"):
        body = error_body(protocol, 400, "bad tool")
        assert body["error"]["message"] == "bad tool" and body["error"]["type"] == "invalid_request_error"
        assert set(body["error"]) >= {"message", "type", "code"}
    assert error_body("responses", 503, "down")["error"]["type"] == "server_error"


def test_count_tokens_asks_the_engine_for_a_one_token_completion():
    body = load_request("claude_code")
    for key in ("max_tokens", "stream", "temperature"):
        body.pop(key)
    chat = count_tokens_request(body)
    assert chat["max_tokens"] == 1 and "stream" not in chat
    assert chat["messages"] == request_to_chat("anthropic", body)[0]["messages"]
    assert count_tokens_response({"usage": {"prompt_tokens": 1234, "completion_tokens": 1}}) == {"input_tokens": 1234}
    assert count_tokens_response({"prompt_token_ids": [1, 2, 3], "choices": []}) == {"input_tokens": 3}
    with pytest.raises(TranslationError):
        count_tokens_response({"choices": []})


def test_needs_translation_by_mode_and_profile():
    for profile in ("vllm", "sglang", "llamacpp", "generic", "unknown-engine"):
        for protocol in ("anthropic", "responses"):
            assert needs_translation(protocol, profile, "auto")
            assert needs_translation(protocol, profile, "always")
            assert not needs_translation(protocol, profile, "never")
        for protocol in ("chat", "completions"):
            assert not needs_translation(protocol, profile, "always")
    with pytest.raises(ValueError):
        needs_translation("anthropic", "vllm", "sometimes")
