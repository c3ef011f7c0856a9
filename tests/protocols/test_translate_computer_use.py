"""Anthropic computer-use tools through the translation: each version becomes a Chat function tool with the
documented actions, the model's call comes back as a `tool_use`, a `tool_result` screenshot reaches the
engine as a user image; an unknown version is refused in Anthropic's error shape. End to end: the official
`anthropic` SDK through a real mitmdump to the scripted engine, which clicks the cell the screenshot shows
(that test needs PIL, which the light proxy environment lacks)."""

from __future__ import annotations

import base64
import json
from typing import Any

import anthropic
import pytest

from openforge.addons.flowfile import open_flow_file
from openforge.addons.translate import TranslationError, request_to_chat, response_from_chat, stream_translator
from openforge.testing.translate_engine import parse_sse, sse, tool_call_deltas, translate_all, vllm_chunks

pytestmark = pytest.mark.addon

CLICKS = ["key", "type", "mouse_move", "left_click", "left_click_drag", "right_click", "middle_click",
          "double_click", "screenshot", "cursor_position"]
MORE = ["scroll", "hold_key", "wait", "triple_click", "left_mouse_down", "left_mouse_up"]
POINTS = ["coordinate", "text"]
SCROLLS = ["start_coordinate", "scroll_direction", "scroll_amount", "duration"]
PNG_B64 = base64.b64encode(b"\x89PNG\r\n\x1a\n screenshot").decode()


def computer(version: str, **extra: Any) -> dict[str, Any]:
    return {"type": version, "name": "computer", "display_width_px": 1024, "display_height_px": 768, **extra}


def body_with(*tools: dict[str, Any], messages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 32, "tools": list(tools),
            "messages": messages or [{"role": "user", "content": "Open the menu."}]}


@pytest.mark.parametrize(("tool", "actions", "props"), [
    (computer("computer_20241022"), CLICKS, POINTS),
    (computer("computer_20250124"), CLICKS + MORE, POINTS + SCROLLS),
    (computer("computer_20251124"), CLICKS + MORE, POINTS + SCROLLS),
    (computer("computer_20251124", enable_zoom=True), [*CLICKS, *MORE, "zoom"], [*POINTS, *SCROLLS, "region"]),
], ids=["20241022", "20250124", "20251124", "20251124-zoom"])
def test_each_computer_version_becomes_a_function_tool(tool: dict, actions: list[str], props: list[str]) -> None:
    chat, dropped = request_to_chat("anthropic", body_with({**tool, "cache_control": {"type": "ephemeral"}}))
    [fn_tool] = chat["tools"]
    assert fn_tool["type"] == "function" and set(fn_tool["function"]) == {"name", "description", "parameters"}
    fn = fn_tool["function"]
    assert fn["name"] == "computer" and "1024x768 pixels" in fn["description"]
    params = fn["parameters"]
    assert params["type"] == "object" and params["required"] == ["action"]
    assert params["properties"]["action"]["enum"] == actions
    assert list(params["properties"]) == ["action", *props]
    assert params["properties"]["coordinate"]["items"] == {"type": "integer"}
    assert params["properties"]["coordinate"]["minItems"] == params["properties"]["coordinate"]["maxItems"] == 2
    assert dropped == ["cache_control"]


def test_display_number_is_in_the_description_and_a_missing_display_size_is_refused() -> None:
    chat, _ = request_to_chat("anthropic", body_with(computer("computer_20250124", display_number=1)))
    assert "X11 display :1" in chat["tools"][0]["function"]["description"]
    with pytest.raises(TranslationError) as err:
        request_to_chat("anthropic", body_with({"type": "computer_20250124", "name": "computer"}))
    assert err.value.status == 400 and "display_width_px" in err.value.message


@pytest.mark.parametrize("tool", [computer("computer_20990101"), {"type": "bash_20250124", "name": "bash"},
                                  {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}])
def test_unknown_versions_and_other_typed_tools_are_refused(tool: dict) -> None:
    with pytest.raises(TranslationError) as err:
        request_to_chat("anthropic", body_with(tool))
    assert err.value.status == 400 and tool["type"] in err.value.message


ACTION = {"action": "left_click", "coordinate": [500, 300]}
CHAT_CALL = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
    "role": "assistant", "content": None,
    "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "computer", "arguments": json.dumps(ACTION)}}]}}],
    "usage": {"prompt_tokens": 9, "completion_tokens": 4}}


def test_a_computer_call_round_trips_as_tool_use() -> None:
    """The engine's call becomes a `tool_use` (answer and stream alike); sent back in the history it is the
    same Chat tool call again."""
    request = body_with(computer("computer_20250124"))
    answer = response_from_chat("anthropic", CHAT_CALL, request)
    [use] = answer["content"]
    assert use == {"type": "tool_use", "id": "call_1", "name": "computer", "input": ACTION}
    assert answer["stop_reason"] == "tool_use"
    chunks = vllm_chunks(tool_call_deltas(0, "call_1", "computer", json.dumps(ACTION)), "tool_calls")
    events = parse_sse(translate_all(stream_translator("anthropic", request), sse(chunks)))
    starts = [e["content_block"] for kind, e in events if kind == "content_block_start"]
    assert starts == [{"type": "tool_use", "id": "call_1", "name": "computer", "input": {}}]
    streamed = "".join(e["delta"]["partial_json"] for kind, e in events if kind == "content_block_delta")
    assert json.loads(streamed) == ACTION
    assert [e["delta"]["stop_reason"] for kind, e in events if kind == "message_delta"] == ["tool_use"]
    history = [{"role": "user", "content": "Open the menu."}, {"role": "assistant", "content": [use]}]
    chat, _ = request_to_chat("anthropic", body_with(computer("computer_20250124"), messages=history))
    assert chat["messages"][1]["tool_calls"] == CHAT_CALL["choices"][0]["message"]["tool_calls"]


def test_a_tool_result_screenshot_follows_the_tool_message_as_a_user_image() -> None:
    """Chat `tool` messages take text only: the result's text stays there ("" when it has none), its images
    go, in order, into one user message after the turn's tool messages, before the turn's own blocks."""
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
    history = [
        {"role": "user", "content": "Open the menu."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "computer", "input": ACTION},
                                          {"type": "tool_use", "id": "t2", "name": "computer",
                                           "input": {"action": "screenshot"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "clicked"}, shot]},
            {"type": "tool_result", "tool_use_id": "t2", "content": [shot], "is_error": False},
            {"type": "text", "text": "Go on."}]},
    ]
    chat, dropped = request_to_chat("anthropic", body_with(computer("computer_20250124"), messages=history))
    url = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}}
    assert chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "clicked"},
        {"role": "tool", "tool_call_id": "t2", "content": ""},
        {"role": "user", "content": [url, url, {"type": "text", "text": "Go on."}]},
    ]
    assert dropped == ["is_error"]


def test_computer_use_through_mitmdump_with_the_anthropic_sdk(start_proxy: Any) -> None:
    """A computer tool and a screenshot from the official SDK: the engine gets the function tool and the image,
    clicks the red cell, the SDK gets a `computer` tool_use; the screenshot after the click comes back in a
    tool_result (streamed this time) and the engine answers. A version Anthropic never had is a 400
    `invalid_request_error` the SDK raises as such. The flow file holds the client's base64 and the
    engine's data URL."""
    from openforge.examples.gui import GuiTask
    from openforge.testing.gui_engine import FINAL, GuiEngine

    task = GuiTask(0)
    png_b64 = base64.b64encode(task.screenshot()).decode()
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64}}
    tool = {"type": "computer_20250124", "name": "computer", "display_width_px": 112, "display_height_px": 112}
    with GuiEngine() as engine:
        proxy = start_proxy(engine.url, "openforge_engine_profile=vllm")
        client = anthropic.Anthropic(base_url=f"{proxy.url}/e/cu-1", api_key="k", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": task.instruction}, shot]}]
        first = client.beta.messages.create(model="m", max_tokens=256, tools=[tool], messages=messages,
                                            betas=["computer-use-2025-01-24"])
        [use] = first.content
        assert use.type == "tool_use" and use.name == "computer" and first.stop_reason == "tool_use"
        assert use.input["action"] == "left_click"
        x, y = use.input["coordinate"]
        x0, y0, x1, y1 = task.box()
        assert x0 <= x < x1 and y0 <= y < y1
        upstream = engine.requests[-1].body
        assert upstream["tools"][0]["function"]["name"] == "computer"
        assert upstream["messages"][-1]["content"][1] == {
            "type": "image_url", "image_url": {"url": f"data:image/png;base64,{png_b64}"}}

        messages += [{"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": [{"type": "text", "text": "clicked"}, shot]}]}]
        with client.beta.messages.stream(model="m", max_tokens=256, tools=[tool], messages=messages,
                                         betas=["computer-use-2025-01-24"]) as stream:
            final = stream.get_final_message()
        assert [b.text for b in final.content if b.type == "text"] == [FINAL]
        assert engine.requests[-1].body["messages"][-2:] == [
            {"role": "tool", "tool_call_id": use.id, "content": "clicked"},
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": f"data:image/png;base64,{png_b64}"}}]}]

        n = len(engine.requests)
        with pytest.raises(anthropic.BadRequestError) as err:
            client.beta.messages.create(model="m", max_tokens=8, messages=messages[:1],
                                        tools=[{**tool, "type": "computer_20990101"}])
        assert err.value.status_code == 400 and "computer_20990101" in err.value.message
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert len(engine.requests) == n  # refused at the proxy
        client.close()
        proxy.status()
        records = [r for path in proxy.flow_files() for r in open_flow_file(path).records()
                   if r.get("type") == "exchange"]
    assert len(records) >= 2
    for rec in records[:2]:
        assert png_b64 in rec["client_request"]["body"].decode()
        assert f"data:image/png;base64,{png_b64}" in rec["upstream_request"]["body"].decode()
