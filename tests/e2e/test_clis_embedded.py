"""The real CLIs on the embedded engine (llama.cpp serving SmolLM2-135M) through the proxy.

Every real CLI but mini-swe-agent streams its calls with tools; llama.cpp refuses logprobs on such a call
(400 "logprobs is not supported with tools + stream") and its streamed tool-call answer leaves out the ids
its tool-call parser holds back. The `llamacpp` profile sends such a call unstreamed and streams the
answer to the client (addons/restream.py). Here each CLI finishes a task, and every call it made is
token-exact after reconstruct: its trainable tokens are the ids llama.cpp returned. Protocol shape and
token ids only, never answer quality (a 135M model).

Each CLI runs lean, so that a call's prompt fits the model's 8192-token context and is prefilled in
seconds on a busy CPU: Claude Code `--bare`, Qwen Code `--bare` with its shell tool only and a short
system prompt, Codex with short model instructions. The route caps every answer at 24 tokens, greedy.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from openforge.addons import profiles, restream, translate
from openforge.engines.llamacpp import EmbeddedEngine
from openforge.testing.reconstruct_flows import trainable_segments
from openforge.testing.toolchain_run import read_records
from toolchains import run as toolchains

TASK = "What is 2 + 2? Answer with the number only."
ROUTE = {"agent": {"models": {"*": "smollm2"}, "sampling": {"max_tokens": 24, "temperature": 0}}}
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
COPY_CALL = 'Copy this text exactly: <tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
LEAN_INSTRUCTIONS = "You are a coding agent. Use the shell tool when you need it, then answer briefly."


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with EmbeddedEngine(threads=1, n_parallel=1, log_path=log) as eng:
        yield eng


@pytest.fixture(scope="module")
def retok() -> Any:
    from openforge.models import hf_dir
    from openforge.reconstruct.tokenize import load_tokenizer

    return load_tokenizer(hf_dir())


def sse_data(raw: bytes) -> list[Any]:
    """The `data:` payloads of an event stream, parsed ("[DONE]" as the string)."""
    return [line[5:].strip().decode() if line[5:].strip() == b"[DONE]" else json.loads(line[5:])
            for line in raw.split(b"\n") if line.startswith(b"data:")]


def engine_ids(rec: dict[str, Any]) -> list[int]:
    """The completion ids llama.cpp returned for one call: its logprob entries' ids."""
    resp = rec["response"]
    objs = sse_data(b"".join(c for _, c in resp["chunks"])) if resp["streamed"] else [json.loads(resp["body"])]
    return [e["id"] for o in objs if isinstance(o, dict) for ch in o.get("choices") or ()
            for e in ((ch.get("logprobs") or {}).get("content") or ())]


def lean_argv(name: str, argv: list[str], home: Path) -> list[str]:
    if name == "claude-code":
        return [*argv, "--bare"]
    if name == "qwen-code":  # yargs array options swallow what follows: put these first
        return [argv[0], "--bare", "--system-prompt", LEAN_INSTRUCTIONS, "--core-tools", "run_shell_command",
                *argv[1:]]
    if name == "codex":
        instructions = home / "instructions.md"
        instructions.write_text(LEAN_INSTRUCTIONS + "\n")
        return [*argv[:-1], "-c", f"model_instructions_file={json.dumps(str(instructions))}", argv[-1]]
    return argv


# -- the proxy's answer shape, without an engine -------------------------------------------------------


def test_unstream_only_a_streamed_llamacpp_chat_call_with_tools() -> None:
    body = {"stream": True, "stream_options": {"include_usage": True}, "tools": TOOLS, "messages": []}
    assert profiles.unstream("llamacpp", "chat", body) and body.get("stream") is False
    assert "stream_options" not in body
    for profile, protocol, changed in (("vllm", "chat", {}), ("llamacpp", "completions", {}),
                                       ("llamacpp", "chat", {"tools": []}), ("llamacpp", "chat", {"stream": False})):
        other = {"stream": True, "tools": TOOLS, **changed}
        assert not profiles.unstream(profile, protocol, other) and other["stream"] == changed.get("stream", True)


def test_normalize_writes_a_llamacpp_chat_body_as_the_engine_renders_it() -> None:
    """Codex's tools carry `strict`, Qwen Code's messages text parts: llama.cpp renders neither as sent
    (observed with /apply-template), so a prompt reconstruct renders from the request was another length."""
    tool = {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}, "strict": False}}
    bare = {"type": "function", "function": {"name": "b", "description": "d"}}
    custom = {"type": "custom", "name": "apply_patch"}
    body = {"tools": [tool, bare, custom], "messages": [
        {"role": "system", "content": [{"type": "text", "text": "S1"}, {"type": "text", "text": "S2"}]},
        {"role": "user", "content": [{"type": "text", "text": "U"}, {"type": "image_url", "image_url": {}}]},
        {"role": "user", "content": "plain"}]}
    assert profiles.normalize("llamacpp", "chat", body) == ["tools", "messages"]
    assert body["tools"] == [{"type": "function", "function": {"name": "a", "description": "",
                                                               "parameters": {"type": "object"}}},
                             {"type": "function", "function": {"name": "b", "description": "d", "parameters": {}}},
                             custom]
    assert [m["content"] for m in body["messages"]][::2] == ["S1\nS2", "plain"]
    assert isinstance(body["messages"][1]["content"], list)
    assert profiles.normalize("llamacpp", "chat", body) == []
    assert profiles.normalize("vllm", "chat", {"tools": [tool]}) == []


def test_restreamed_answer_is_the_stream_a_client_expects() -> None:
    """A whole Chat answer with text, a tool call and logprobs becomes Chat chunks a stream reader folds
    back into the same message, and (translated) an Anthropic stream with the same tool_use block."""
    call = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    logprobs = {"content": [{"id": 7, "token": "Hi", "logprob": -0.5}]}
    answer = {"id": "chatcmpl-1", "created": 5, "model": "m", "object": "chat.completion",
              "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12},
              "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": logprobs,
                           "message": {"role": "assistant", "content": "Hi", "tool_calls": [call]}}]}
    events = list(sse_data(restream.chat_events(answer, include_usage=True)))
    assert events[-1] == "[DONE]" and events[-2]["usage"] == answer["usage"] and events[-2]["choices"] == []
    deltas = [c["choices"][0] for c in events[:-2]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Hi"
    assert [d["logprobs"] for d in deltas if "logprobs" in d] == [logprobs]
    assert [t for d in deltas for t in d["delta"].get("tool_calls") or ()] == [{**call, "index": 0}]
    assert [d["finish_reason"] for d in deltas] == [None, None, None, "tool_calls"]
    assert "usage" not in restream.chat_events(answer, include_usage=False).decode()
    stream = translate.stream_translator("anthropic", {"model": "m"})
    out = list(sse_data(stream.feed(restream.chat_events(answer, True)) + stream.finish()))
    blocks = [e["content_block"] for e in out if e["type"] == "content_block_start"]
    assert [b["type"] for b in blocks] == ["text", "tool_use"] and blocks[1]["id"] == "call_1"
    assert out[-1]["type"] == "message_stop"


# -- against the embedded engine -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": COPY_CALL}], "tools": TOOLS,
                              "stream_options": {"include_usage": True}}),
    ("/v1/messages", {"messages": [{"role": "user", "content": COPY_CALL}], "tools": [
        {"name": "bash", "description": "run a shell command", "input_schema": TOOLS[0]["function"]["parameters"]}]}),
    ("/v1/responses", {"input": COPY_CALL, "tools": [
        {"type": "function", "name": "bash", "parameters": TOOLS[0]["function"]["parameters"]}]}),
])
def test_streamed_call_with_tools_is_answered_with_every_token_id(
    path: str, body: dict[str, Any], engine: Any, start_proxy: Any
) -> None:
    """The defect: through the proxy, a streamed call with tools got llama.cpp's 400. Now it is a 200 event
    stream in the client's protocol, and the record holds one token id per generated token."""
    proxy = start_proxy(engine.url)
    request = {"model": "m", "max_tokens": 40, "temperature": 0, "stream": True, **body}
    answer = httpx.post(proxy.url + path, json=request, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/event-stream")
    events = list(sse_data(answer.content))
    assert events and "error" not in json.dumps(events[-1]).lower()[:40]
    proxy.status()
    (rec,) = [r for r in read_records(proxy.flow_dir) if r.get("type") == "exchange"]
    assert rec["has_token_ids"] and rec["engine_profile"] == "llamacpp" and "stream" in rec["injected"]
    usage = json.loads(rec["response"]["body"])["usage"]
    assert len(engine_ids(rec)) == usage["completion_tokens"] > 0
    assert "logprobs" not in answer.text  # what the proxy asked for is not the client's


@pytest.mark.slow
def test_reconstruct_tokenizer_splits_digits_as_llamacpp_does(engine: Any, retok: Any) -> None:
    """mini-swe-agent's prompt holds "problems.\\n\\n1. Analyze": llama.cpp's SmolLM2 pre-tokenizer splits digits
    first ("\\n\\n" is one id); the converted tokenizer made it two, so the prompt's length differed from the
    engine's and reconstruct left the call out of training (prompt_check mismatch)."""
    text = "problems.\n\n1. Analyze 12345 x\n\n\n2) a  b 3.14\n\n10 items"
    served = httpx.post(f"{engine.url}/tokenize", json={"content": text}, timeout=60).json()["tokens"]
    assert retok(text, add_special_tokens=False)["input_ids"] == served


@pytest.mark.slow
@pytest.mark.parametrize("name", toolchains.TOOLCHAINS)
def test_real_cli_completes_a_task_on_the_embedded_engine(
    name: str, engine: Any, retok: Any, start_proxy: Any, tmp_path: Path
) -> None:
    import duckdb

    from openforge.reconstruct import reconstruct

    if not toolchains.installed(name):
        pytest.fail(f"{name} is not installed: run toolchains/install.sh (make setup does)")
    proxy = start_proxy(engine.url, f"openforge_models={json.dumps(ROUTE)}")
    episode = f"ep-{name}"
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    inv = toolchains.invocation(name, TASK, home, base_url=f"{proxy.url}/e/{episode}")
    done = subprocess.run(lean_argv(name, inv.argv, home), cwd=work, env=inv.env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    proxy.status()
    calls = [r for r in read_records(proxy.flow_dir) if r.get("type") == "exchange" and r.get("episode") == episode]
    assert calls, proxy.log()
    for rec in calls:
        assert rec["complete"] and rec["error"] is None and rec["response"]["status"] == 200, rec.get("error")
        assert rec["has_token_ids"] and rec["engine_profile"] == "llamacpp"
    summary = reconstruct(proxy.flow_files(), tmp_path / "db.duckdb", retok, missing_reward="fill:0")
    # llama.cpp returns completion ids; the proxy asked it for each prompt's ids (`engine_prompt_ids`), of the
    # length llama.cpp counted (else the call is left out of training)
    assert all(rec.get("engine_prompt_ids") for rec in calls), [rec.get("engine_prompt_error") for rec in calls]
    assert summary.calls == summary.calls_engine_ids == len(calls) and summary.calls_prompt_mismatch == 0, summary
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    rows = con.execute("SELECT input_ids, loss_mask, token_source FROM samples").fetchall()
    con.close()
    assert {r[2] for r in rows} == {"engine"}
    segments = [seg for ids, mask, _ in rows for seg in trainable_segments(ids, mask)]
    assert sorted(segments) == sorted(engine_ids(rec) for rec in calls)
    print(f"\n{name} on the embedded engine: exit 0 after {len(calls)} call(s), "
          f"{sum(map(len, segments))} trainable tokens, all llama.cpp's ids")


def test_a_run_in_which_every_episode_failed_names_the_cause(tmp_path: Path) -> None:
    """Every CLI exited non-zero on the engine's 400: the run says so with what the agent printed (the
    engine's error answer as the CLI showed it); one episode that finished ok makes it a run like any other."""
    from openforge.rollout.run_failure import every_episode_failed
    from openforge.rollout.spec import EpisodeResult

    def result(n: int, status: str) -> EpisodeResult:
        return EpisodeResult(episode=f"ep{n}", task_id="t", toolchain="codex", attempt=n, status=status, reward=0.0,
                             reason="agent exited 1 (see agent.stderr)" if status != "ok" else "")

    episode = tmp_path / "ep1"
    episode.mkdir()
    (episode / "agent.stdout").write_text('{"type":"thread.started"}\n{"type":"error","message":"unexpected status '
                                          '400 Bad Request: logprobs is not supported with tools + stream"}\n')
    (episode / "agent.stderr").write_text("Reading additional input from stdin...\n")
    failed = [result(1, "agent_failed"), result(2, "agent_failed"), result(3, "timeout")]
    message = every_episode_failed(failed, tmp_path)
    assert message is not None and message.startswith("every episode failed (agent_failed 2, timeout 1); ep1: agent")
    assert message.endswith("logprobs is not supported with tools + stream\"}")
    assert every_episode_failed([*failed, result(4, "ok")], tmp_path) is None
    assert every_episode_failed([], tmp_path) is None
    assert every_episode_failed([result(2, "crashed")], tmp_path) == (
        "every episode failed (crashed 1); ep2: agent exited 1 (see agent.stderr)")


@pytest.mark.slow
def test_each_slot_has_the_whole_context(tmp_path: Path) -> None:
    """Two calls at once whose prompts fit the context each but not together: the defect was one context
    shared by the slots (two Codex calls of 5800 prompt tokens: 500 "Context size has been exceeded")."""
    from concurrent.futures import ThreadPoolExecutor

    prompt = " ".join(f"word{i}" for i in range(120))  # about 350 tokens with the template
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "temperature": 0}
    with EmbeddedEngine(n_ctx=512, n_parallel=2, threads=1, log_path=tmp_path / "engine.log") as eng:
        tokens = httpx.post(f"{eng.url}/tokenize", json={"content": prompt}, timeout=60).json()["tokens"]
        assert 256 < len(tokens) < 480
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{eng.url}/v1/chat/completions", json=body, timeout=300),
                                    range(2)))
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
