"""Every recorded protocol parses to the same canonical call; mitmproxy `-w` files and the CLI work."""

from __future__ import annotations

import json

import typer
from typer.testing import CliRunner

from openforge.reconstruct.calls import parse_record


def sse(events: list[tuple[str, dict]]) -> list[list]:
    raw = b"".join(f"event: {n}\ndata: {json.dumps(e)}\n\n".encode() for n, e in events)
    return [[0.0, raw[:7]], [0.0, raw[7:]]]


def record(protocol: str, request: dict, chunks: list) -> dict:
    req = {"method": "POST", "url": "http://x/v1", "headers": [], "body": json.dumps(request).encode()}
    return {"type": "exchange", "id": "r1", "protocol": protocol, "complete": True, "error": None,
            "client_request": req, "upstream_request": req, "translated": None,
            "response": {"status": 200, "headers": [], "body": None, "chunks": chunks, "streamed": True}}


EXPECTED_TOOL_CALL = {"id": "t1", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}}


def test_reconstruct_anthropic_stream_claude_code_shape():
    request = {
        "system": [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "Bash", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "list"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm"},
                {"type": "tool_use", "id": "t0", "name": "Bash", "input": {"command": "pwd"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t0", "content": [{"type": "text", "text": "/w"}]},
                {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}]},
        ],
    }
    events = [
        ("message_start", {"type": "message_start", "message": {"usage": {"input_tokens": 12}}}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "thinking", "thinking": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                 "delta": {"type": "thinking_delta", "thinking": "why"}}),
        ("content_block_start", {"type": "content_block_start", "index": 1,
                                 "content_block": {"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "input_json_delta", "partial_json": '{"comm'}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "input_json_delta", "partial_json": 'and": "ls"}'}}),
        ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                           "usage": {"output_tokens": 9}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    call = parse_record(record("anthropic", request, sse(events)))
    assert call.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "list"},
        {"role": "assistant", "content": "", "reasoning_content": "hm",
         "tool_calls": [{"id": "t0", "type": "function",
                         "function": {"name": "Bash", "arguments": '{"command": "pwd"}'}}]},
        {"role": "tool", "tool_call_id": "t0", "content": "/w"},
        {"role": "user", "content": "go on"},
    ]
    assert call.completion == {"role": "assistant", "content": "", "reasoning_content": "why",
                               "tool_calls": [EXPECTED_TOOL_CALL]}
    assert (call.finish_reason, call.prompt_tokens, call.completion_tokens) == ("tool_use", 12, 9)
    assert call.tools[0]["function"]["parameters"] == {"type": "object"}


def test_reconstruct_responses_stream_codex_shape():
    request = {
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "base"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list"}]},
            {"type": "function_call", "call_id": "t0", "name": "Bash", "arguments": '{"command": "pwd"}'},
            {"type": "function_call_output", "call_id": "t0", "output": "/w"},
        ],
        "tools": [{"type": "function", "name": "Bash", "parameters": {"type": "object"}}],
    }
    final = {"status": "completed", "usage": {"input_tokens": 5, "output_tokens": 3},
             "output": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "why"}]},
                        {"type": "function_call", "call_id": "t1", "name": "Bash", "arguments": '{"command": "ls"}'}]}
    events = [("response.created", {"type": "response.created"}),
              ("response.completed", {"type": "response.completed", "response": final})]
    call = parse_record(record("responses", request, sse(events)))
    assert [m["role"] for m in call.messages] == ["system", "user", "assistant", "tool"]
    assert call.completion == {"role": "assistant", "content": "", "reasoning_content": "why",
                               "tool_calls": [EXPECTED_TOOL_CALL]}
    cut = record("responses", request, sse(events[:1]))
    try:
        parse_record(cut)
        raise AssertionError("a stream without response.completed must be skipped")
    except Exception as e:  # noqa: BLE001
        assert getattr(e, "reason", None) == "truncated_stream"


def test_reconstruct_reads_mitmproxy_w_files(tmp_path):
    """A capture made with plain `mitmdump -w` (no addon) reconstructs too, retokenised."""
    from mitmproxy import io
    from mitmproxy.test import tflow

    from openforge.reconstruct import reconstruct
    from openforge.testing.reconstruct_flows import db_rows, qwen_retokenizer

    messages = [{"role": "user", "content": "hi"}]
    with open(tmp_path / "capture.mitm", "wb") as fh:
        w = io.FlowWriter(fh)
        for i in range(2):
            fl = tflow.tflow(resp=True)
            fl.request.method, fl.request.path = "POST", "/v1/chat/completions"
            fl.request.timestamp_start = 1000.0 + i
            fl.request.headers["X-OpenForge-Episode"] = "mitm-ep"
            fl.request.content = json.dumps({"model": "m", "messages": messages}).encode()
            answer = {"role": "assistant", "content": f"hello {i}"}
            fl.response.content = json.dumps(
                {"choices": [{"index": 0, "message": answer, "finish_reason": "stop"}]}).encode()
            fl.response.headers["content-type"] = "application/json"
            w.add(fl)
            messages = messages + [answer, {"role": "user", "content": "more"}]
    s = reconstruct([tmp_path / "capture.mitm"], tmp_path / "db.duckdb", qwen_retokenizer(), missing_reward="fill:0")
    # Qwen3 renders the first answer with an empty <think> block as the last turn, without it in history
    assert (s.calls, s.calls_retokenized, s.episodes, s.samples, s.drift) == (2, 2, 1, 2, {"template": 1})
    rows = db_rows(tmp_path / "db.duckdb", "SELECT token_source, n_calls FROM samples")
    assert rows == [{"token_source": "retokenized", "n_calls": 1}] * 2
    assert reconstruct([tmp_path / "capture.mitm"], tmp_path / "db.duckdb", qwen_retokenizer(),
                       missing_reward="fill:0").calls == 0


def test_reconstruct_cli_and_stats(tmp_path):
    from openforge.commands import reconstruct as reconstruct_cmd
    from openforge.commands import stats as stats_cmd
    from openforge.testing.reconstruct_flows import FlowFactory, qwen_path

    app = typer.Typer()
    reconstruct_cmd.register(app)
    stats_cmd.register(app)
    f = FlowFactory(tmp_path / "flows", seed=11)
    f.tool_loop("e1", turns=1, new_user_turns=True)
    f.close()
    (tmp_path / "r.csv").write_text("episode_id,reward,task_id\ne1,1.0,t\n")
    runner = CliRunner()
    db = str(tmp_path / "x.duckdb")
    res = runner.invoke(app, ["reconstruct", str(tmp_path / "flows"), "--db", db, "--tokenizer", qwen_path(),
                              "--rewards", str(tmp_path / "r.csv"), "--advantage", "rloo"])
    assert res.exit_code == 0, res.output
    assert "samples" in res.output and "template 1" in res.output
    res = runner.invoke(app, ["stats", "--db", db])
    assert res.exit_code == 0 and "merge ratio" in res.output and "template 1" in res.output
    bad = runner.invoke(app, ["reconstruct", str(tmp_path / "flows"), "--db", db, "--tokenizer", qwen_path(),
                              "--missing-reward", "zero"])
    assert bad.exit_code != 0 and "fill:<number>" in bad.output
    assert runner.invoke(app, ["stats", "--db", str(tmp_path / "none.duckdb")]).exit_code == 2


def test_llamacpp_logprob_ids_trusted_only_when_one_per_token():
    """llama.cpp merges the logprobs entries of tokens that end mid-character: then they are not the ids."""
    from openforge.reconstruct.calls import _parse_chat

    def answer(n_tokens: int) -> bytes:
        lp = [{"id": 5, "token": "a", "logprob": -0.1}, {"id": 249, "token": "🌟", "logprob": -0.2}]
        return json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "a🌟"},
                                        "finish_reason": "stop", "logprobs": {"content": lp}}],
                           "usage": {"prompt_tokens": 4, "completion_tokens": n_tokens}}).encode()

    request = {"messages": [{"role": "user", "content": "hi"}]}
    assert _parse_chat({"id": "x"}, request, answer(2), False, [])[0].engine_completion_ids == [5, 249]
    assert _parse_chat({"id": "x"}, request, answer(3), False, [])[0].engine_completion_ids is None


def test_a_record_with_a_map_as_a_map_key_skips_that_record_not_the_rest_of_its_file(tmp_path):
    """msgpack allows a map as a map key and Python's unpacker cannot build one: that record is skipped with
    its reason, and the episodes after it in the same file are built."""
    from openforge.addons.flowfile import pack, read_header
    from openforge.reconstruct import reconstruct
    from openforge.testing.reconstruct_flows import FlowFactory, db_rows, qwen_retokenizer

    before, after = FlowFactory(tmp_path / "flows", seed=16), FlowFactory(tmp_path / "after", seed=16)
    before.tool_loop("before", turns=1)
    after.tool_loop("after", turns=1)
    (path,), (later,) = before.close(), after.close()
    map_key = b"\x82\x81\xa1k\x01\x02\xa4type\xa8exchange"  # {{"k": 1}: 2, "type": "exchange"}
    records = later.read_bytes()[len(pack(read_header(later))):]
    path.write_bytes(path.read_bytes() + map_key + records)
    s = reconstruct([tmp_path / "flows"], tmp_path / "db.duckdb", qwen_retokenizer(), missing_reward="keep")
    assert s.skipped["undecodable_record"] == 1 and s.skipped["corrupt_file"] == 0
    episodes = db_rows(tmp_path / "db.duckdb", "SELECT episode_id FROM episodes ORDER BY 1")
    assert [e["episode_id"] for e in episodes] == ["after", "before"]
    [skip] = db_rows(tmp_path / "db.duckdb", "SELECT reason, detail FROM skipped")
    assert "TypeError" in skip["detail"]


def test_reconstruct_cli_flow_key_file(tmp_path):
    """`--flow-key-file`: a signed file counts, an unsigned one and a mitmproxy file are unauthenticated_file;
    a key file that cannot be one is one error line."""
    from mitmproxy import io
    from mitmproxy.test import tflow

    from openforge.commands import reconstruct as reconstruct_cmd
    from openforge.commands import stats as stats_cmd
    from openforge.testing.reconstruct_flows import FlowFactory, qwen_path

    app = typer.Typer()
    reconstruct_cmd.register(app)
    stats_cmd.register(app)  # two commands keep the command name an argument of the group
    key = tmp_path / "flow.key"
    key.write_text("k" * 40 + "\n")
    signed = FlowFactory(tmp_path / "flows", seed=17)
    signed.writer.key = b"k" * 40
    signed.tool_loop("signed", turns=1)
    signed.close()
    unsigned = FlowFactory(tmp_path / "flows", seed=18)
    unsigned.tool_loop("unsigned", turns=1)
    unsigned.close()
    with open(tmp_path / "flows" / "capture.flows", "wb") as fh:  # mitmproxy's format under a flow name
        io.FlowWriter(fh).add(tflow.tflow(resp=True))
    runner = CliRunner()
    base = ["reconstruct", str(tmp_path / "flows"), "--db", str(tmp_path / "x.duckdb"), "--tokenizer", qwen_path(),
            "--missing-reward", "keep"]
    res = runner.invoke(app, base + ["--flow-key-file", str(key)])
    assert res.exit_code == 0, res.output
    assert "unauthenticated_file 2" in res.output and "agent 2" in res.output  # the signed episode's two calls
    short = tmp_path / "short.key"
    short.write_text("short")
    bad = runner.invoke(app, base + ["--flow-key-file", str(short)])
    assert bad.exit_code != 0 and "at least 32" in bad.output and "Traceback" not in bad.output
