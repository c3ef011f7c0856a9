"""The addon end to end: real mitmdump subprocess, real sockets, official clients, scripted engine upstream."""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

UPSTREAM_KEY = "sk-upstream-SECRET-0123456789abcdef"
CLIENT_KEY = "sk-client-OWNKEY-fedcba9876543210"
MESSAGES = [{"role": "user", "content": "list the files here"}]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object",
                                                          "properties": {"command": {"type": "string"}},
                                                          "required": ["command"]}}}]


@pytest.fixture(scope="module")
def engine() -> Any:
    with ScriptedEngine(api_key=UPSTREAM_KEY, chunk_delay=0.002) as eng:
        yield eng


@pytest.fixture(scope="module")
def proxy(engine: ScriptedEngine, start_module_proxy: Any) -> Any:
    return start_module_proxy(engine.url, f"openforge_upstream_key={UPSTREAM_KEY}", "openforge_record_other=true",
                              "openforge_allow_paths=/health,/v1/nothing-*")


def records(proxy: Any) -> list[dict[str, Any]]:
    proxy.status()  # the proxy is up (a record is in the file before its call is answered)
    out = []
    for path in expand_paths([proxy.flow_dir]):
        ff = open_flow_file(path)
        out.extend(ff.records())
        assert ff.error is None and not ff.torn_tail, (path, ff.error)
    return out


def answered(proxy: Any, episode: str) -> list[dict[str, Any]]:
    """The episode's complete records. An official SDK retries a call the proxy answered 502 (on a loaded
    machine the scripted engine has closed a fresh connection unanswered); that attempt is recorded too,
    incomplete, with its error, and reconstruct skips it."""
    recs = [r for r in records(proxy) if r.get("episode") == episode]
    assert all(r["complete"] or (r["error"] and r["response"]["status"] == 502) for r in recs), recs
    return [r for r in recs if r["complete"]]


def comparable(obj: Any) -> Any:
    """Engine answers differ per call only in their id and creation time."""
    if isinstance(obj, dict):
        return {k: comparable(v) for k, v in obj.items() if k not in ("id", "created", "created_at", "item_id")}
    if isinstance(obj, list):
        return [comparable(v) for v in obj]
    return obj


def sse_events(data: bytes) -> list[Any]:
    return [line[5:].strip().decode() if line[5:].strip() == b"[DONE]" else json.loads(line[5:])
            for line in data.split(b"\n") if line.startswith(b"data:")]


def post(url: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(url, json=body, headers={"authorization": f"Bearer {CLIENT_KEY}", **headers}, timeout=30)


# -- what the client receives ------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_chat_client_sees_engine_answer_minus_injected_fields(engine: Any, proxy: Any, stream: bool) -> None:
    body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "stream": stream}
    direct = httpx.post(f"{engine.url}/v1/chat/completions", json=body,
                        headers={"authorization": f"Bearer {UPSTREAM_KEY}"}).content
    via = post(f"{proxy.url}/e/cmp-{stream}/v1/chat/completions", body).content
    if stream:
        assert comparable(sse_events(via)) == comparable(sse_events(direct))
    else:
        assert comparable(json.loads(via)) == comparable(json.loads(direct))
    (rec,) = answered(proxy, f"cmp-{stream}")
    assert rec["injected"] == ["return_token_ids", "logprobs"]
    assert rec["has_token_ids"] and rec["complete"] and rec["engine_profile"] == "vllm"
    raw = b"".join(c[1] for c in rec["response"]["chunks"]) if stream else rec["response"]["body"]
    assert b"prompt_token_ids" in raw and b"token_ids" in raw  # the record keeps what the client did not see
    assert b"token_ids" not in via and b'"logprobs": {' not in via


def test_client_asking_for_logprobs_keeps_them(proxy: Any) -> None:
    body = {"model": "m", "messages": MESSAGES, "logprobs": True}
    answer = post(f"{proxy.url}/e/lp/v1/chat/completions", body).json()
    assert answer["choices"][0]["logprobs"]["content"]
    assert "token_ids" not in answer["choices"][0]
    (rec,) = answered(proxy, "lp")
    assert rec["injected"] == ["return_token_ids"]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_tool_loop(proxy: Any, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/e/oa-{stream}/v1", api_key=CLIENT_KEY)
    msgs: list[dict[str, Any]] = list(MESSAGES)
    if stream:
        chunks = list(client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True))
        call = chunks[1].choices[0].delta.tool_calls[0]
        args = "".join(c.choices[0].delta.tool_calls[0].function.arguments for c in chunks[1:4])
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    else:
        msg = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS).choices[0].message
        call, args = msg.tool_calls[0], msg.tool_calls[0].function.arguments
    assert call.function.name == "bash" and "command" in json.loads(args)
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "bash", "arguments": args}}]},
             {"role": "tool", "tool_call_id": call.id, "content": "a.txt b.txt"}]
    final = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert final.choices[0].message.content.startswith("Done")
    recs = answered(proxy, f"oa-{stream}")
    assert [r["toolchain"] for r in recs] == ["openai-python"] * 2
    assert all(r["has_token_ids"] and r["complete"] and r["protocol"] == "chat" for r in recs)
    assert json.loads(recs[1]["upstream_request"]["body"])["messages"][-1]["role"] == "tool"


def test_completions_strip_and_record(proxy: Any) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/e/cmpl/v1", api_key=CLIENT_KEY)
    out = client.completions.create(model="m", prompt="say hello")
    assert out.choices[0].text.startswith(" Echo") and out.choices[0].logprobs is None
    (rec,) = answered(proxy, "cmpl")
    assert rec["protocol"] == "completions" and rec["has_token_ids"]
    assert b"prompt_token_ids" in rec["response"]["body"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_client_through_translation(proxy: Any, stream: bool) -> None:
    client = anthropic.Anthropic(base_url=f"{proxy.url}/e/an-{stream}", api_key=CLIENT_KEY)
    tools = [{"name": "bash", "description": "run", "input_schema": TOOLS[0]["function"]["parameters"]}]
    kwargs: dict[str, Any] = dict(model="claude-x", max_tokens=200, tools=tools, messages=MESSAGES)
    if stream:
        with client.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    tool_use = next(b for b in msg.content if b.type == "tool_use")
    assert tool_use.name == "bash" and "command" in tool_use.input
    (rec,) = answered(proxy, f"an-{stream}")
    assert rec["protocol"] == "anthropic" and rec["translated"]["from"] == "anthropic"
    assert rec["upstream_request"]["url"].endswith("/v1/chat/completions")
    assert rec["has_token_ids"] and rec["client_response"] is not None
    assert rec["toolchain"] == "anthropic-python"


def test_anthropic_count_tokens(proxy: Any) -> None:
    client = anthropic.Anthropic(base_url=f"{proxy.url}/e/ct", api_key=CLIENT_KEY)
    n = client.messages.count_tokens(model="claude-x", messages=MESSAGES).input_tokens
    assert n > 0
    (rec,) = answered(proxy, "ct")
    assert rec["protocol"] == "anthropic_count_tokens"


def test_responses_client_through_translation(proxy: Any) -> None:
    client = openai.OpenAI(base_url=f"{proxy.url}/e/resp/v1", api_key=CLIENT_KEY)
    with client.responses.stream(model="m", input="hello there") as s:
        final = s.get_final_response()
    assert final.output_text
    (rec,) = answered(proxy, "resp")
    assert rec["translated"]["from"] == "responses" and rec["has_token_ids"]
    assert rec["client_response"]["chunks"]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_untranslated_to_vllm_client_sees_the_unasked_answer(engine: Any, start_proxy: Any,
                                                                         stream: bool) -> None:
    """`openforge_translate=never`: the call goes to vLLM's /v1/responses asking `enable_response_messages`;
    the client gets the answer as if unasked (both fields null), the record keeps the engine's ids."""
    p = start_proxy(engine.url, f"openforge_upstream_key={UPSTREAM_KEY}", "openforge_translate=never")
    body = {"model": "m", "input": "hello there", "stream": stream}
    direct = httpx.post(f"{engine.url}/v1/responses", json=body,
                        headers={"authorization": f"Bearer {UPSTREAM_KEY}"}).content
    via = post(f"{p.url}/e/native-{stream}/v1/responses", body).content
    if stream:
        assert comparable(sse_events(via)) == comparable(sse_events(direct))
    else:
        assert comparable(json.loads(via)) == comparable(json.loads(direct))
    assert b'"output_messages":null' in via.replace(b" ", b"") and b"raw_message_tokens" not in via
    (rec,) = answered(p, f"native-{stream}")
    assert rec["translated"] is None and rec["injected"] == ["enable_response_messages"] and rec["has_token_ids"]
    assert json.loads(rec["upstream_request"]["body"])["enable_response_messages"] is True
    raw = b"".join(c[1] for c in rec["response"]["chunks"]) if stream else rec["response"]["body"]
    assert b"raw_message_tokens" in raw


# -- episodes, roles, passthrough, rewards, errors ---------------------------------------------------------
@pytest.mark.parametrize(("headers", "path", "episode", "source"), [
    ({"x-openforge-episode": "hdr"}, "/e/pth/v1/chat/completions", "pth", "path"),
    ({"x-openforge-episode": "hdr", "x-claude-code-session-id": "cc"}, "/v1/chat/completions", "hdr", "header"),
    ({"x-claude-code-session-id": "cc-1"}, "/v1/chat/completions", "cc-1", "session_header"),
    ({"session-id": "codex-1"}, "/v1/chat/completions", "codex-1", "session_header"),
    ({"proxy-authorization": "Basic ZXAtYXV0aDp4"}, "/v1/chat/completions", "ep-auth", "proxy_auth"),
])
def test_episode_sources(proxy: Any, headers: dict[str, str], path: str, episode: str, source: str) -> None:
    assert post(proxy.url + path, {"model": "m", "messages": MESSAGES}, **headers).status_code == 200
    (rec,) = answered(proxy, episode)
    assert rec["episode_source"] == source


def test_no_episode_and_role_from_path_and_header(proxy: Any) -> None:
    post(f"{proxy.url}/r/validator/v1/chat/completions", {"model": "role-probe", "messages": MESSAGES})
    post(f"{proxy.url}/v1/chat/completions", {"model": "role-probe2", "messages": MESSAGES},
         **{"x-openforge-role": "vl"})
    recs = {r["model"]: r for r in records(proxy) if r["model"] in ("role-probe", "role-probe2")}
    assert recs["role-probe"]["role"] == "validator" and recs["role-probe"]["episode"] is None
    assert recs["role-probe2"]["role"] == "vl" and recs["role-probe2"]["episode_source"] is None


def test_allowed_other_paths_pass_through_and_are_recorded(proxy: Any) -> None:
    r = httpx.get(f"{proxy.url}/health", headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert r.status_code == 200
    r = httpx.get(f"{proxy.url}/v1/nothing-here")
    assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    models = httpx.get(f"{proxy.url}/e/mdl/v1/models", headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert models.json()["data"][0]["owned_by"] == "vllm"
    (rec,) = answered(proxy, "mdl")
    assert rec["protocol"] == "models" and rec["response"]["status"] == 200
    others = [r for r in records(proxy) if r["protocol"] == "other"]
    assert {o["client_request"]["url"].rsplit("/", 1)[-1] for o in others} >= {"health", "nothing-here"}


def test_engine_errors_pass_through(proxy: Any) -> None:
    r = httpx.post(f"{proxy.url}/e/e400/v1/chat/completions", content=b"[1, 2]",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "request body must be a JSON object"
    (rec,) = answered(proxy, "e400")
    assert rec["response"]["status"] == 400 and rec["complete"]


def test_reward_endpoint(proxy: Any) -> None:
    r = httpx.post(f"{proxy.url}/openforge/v1/episodes/ep%2F9/reward",
                   json={"reward": 0.75, "task_id": "t1", "metadata": {"tests": 3}})
    assert r.status_code == 200 and r.json()["ok"]
    bad = httpx.post(f"{proxy.url}/openforge/v1/episodes/x/reward", json={"reward": "high"})
    assert bad.status_code == 400
    assert httpx.get(f"{proxy.url}/openforge/v1/episodes/x/reward").status_code == 405
    (rew,) = [r for r in records(proxy) if r["type"] == "reward"]
    assert rew == {**rew, "episode": "ep/9", "reward": 0.75, "task_id": "t1", "metadata": {"tests": 3}}


def test_status_answer_comes_after_the_records_of_answered_calls(proxy: Any, engine: Any) -> None:
    """Records are written just after their answers leave; the status answer is a barrier behind them."""
    seen = len(engine.requests)
    with httpx.Client() as client:
        for i in range(20):
            stream = i % 2 == 1
            r = client.post(f"{proxy.url}/e/st-{i}/v1/chat/completions",
                            json={"model": "m", "messages": MESSAGES, "stream": stream})
            assert r.status_code == 200
        status = client.get(f"{proxy.url}/openforge/v1/status").json()
    written = [r for path in expand_paths([proxy.flow_dir]) for r in open_flow_file(path).records()]
    assert {f"st-{i}" for i in range(20)} <= {r.get("episode") for r in written}
    assert status == {**status, "ok": True, "records": len(written), "in_flight": 0}
    assert status["flow_file"] in {str(p) for p in expand_paths([proxy.flow_dir])}
    assert engine.url.startswith(status["upstream"]) and status["engine_profile"] == "vllm"  # auto-detected
    assert len(engine.requests) == seen + 20  # answered by the proxy, never forwarded
    # each call's line, streamed or not; mitmproxy's own per-stream line is dropped (it costs time to first token)
    log = proxy.log()
    assert all(f"episode=st-{i} " in log for i in range(20)) and "Streaming response from" not in log


def test_forward_mode_vendor_host_is_rewritten(proxy: Any) -> None:
    with httpx.Client(proxy=proxy.url) as client:
        r = client.post("http://api.openai.com/v1/chat/completions", json={"model": "gpt-x", "messages": MESSAGES},
                        headers={"authorization": f"Bearer {CLIENT_KEY}", "x-openforge-episode": "fwd"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("Echo")
    (rec,) = answered(proxy, "fwd")
    assert rec["client_request"]["url"].startswith("http://api.openai.com/")


def test_forward_mode_https_tunnel_with_proxy_auth_episode(engine: Any, proxy: Any) -> None:
    """HTTPS_PROXY use: CONNECT api.anthropic.com through mitmproxy's CA; the tunnel's user is the episode."""
    ca = proxy.flow_dir.parent / "mitmconf" / "mitmproxy-ca-cert.pem"
    client = anthropic.Anthropic(api_key=CLIENT_KEY, http_client=httpx.Client(
        proxy=f"http://ep-tunnel:x@127.0.0.1:{proxy.port}", verify=ssl.create_default_context(cafile=ca)))
    msg = client.messages.create(model="claude-x", max_tokens=50, messages=MESSAGES)
    assert msg.content[0].text.startswith("Echo")
    (rec,) = answered(proxy, "ep-tunnel")
    assert rec["episode_source"] == "proxy_auth" and rec["client_request"]["url"].startswith("https://api.anthropic.com/")
    assert rec["upstream_request"]["url"] == f"{engine.url}/v1/chat/completions"  # translated, to the engine


def test_64_concurrent_streams_give_64_complete_records(proxy: Any) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> bytes:
        body = {"model": "m", "messages": [{"role": "user", "content": f"stream number {i}"}], "stream": True}
        async with client.stream("POST", f"{proxy.url}/e/con-{i}/v1/chat/completions", json=body) as r:
            return b"".join([c async for c in r.aiter_bytes()])

    async def main() -> list[bytes]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    outs = asyncio.run(main())
    assert all(o.endswith(b"data: [DONE]\n\n") for o in outs)
    recs = [r for r in records(proxy) if (r.get("episode") or "").startswith("con-")]
    assert len(recs) == 64 and len({r["episode"] for r in recs}) == 64
    for r in recs:
        i = r["episode"].split("-")[1]
        assert r["complete"] and r["response"]["streamed"] and r["has_token_ids"]
        assert f"stream number {i}".encode() in r["client_request"]["body"]


def test_keys_never_written(proxy: Any) -> None:
    """Runs last in this module: nothing any test sent may have left a key in a file or the log."""
    files = list(Path(proxy.flow_dir).iterdir())
    assert files
    for path in files + [proxy.log_path]:
        data = path.read_bytes()
        for key in (UPSTREAM_KEY, CLIENT_KEY, UPSTREAM_KEY[4:-4], CLIENT_KEY[4:-4]):
            assert key.encode() not in data, f"{key[:6]}... found in {path.name}"
    assert UPSTREAM_KEY[:4] + "…" + UPSTREAM_KEY[-4:] in proxy.log()  # masked form is what shows


def test_unreachable_engine_gives_502_in_client_shape(start_proxy: Any) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    p = start_proxy(f"http://127.0.0.1:{dead}")
    oa = post(f"{p.url}/e/d1/v1/chat/completions", {"model": "m", "messages": MESSAGES})
    assert oa.status_code == 502 and f"127.0.0.1:{dead}" in oa.json()["error"]["message"]
    an = post(f"{p.url}/e/d2/v1/messages", {"model": "c", "max_tokens": 5, "messages": MESSAGES})
    assert an.status_code == 502 and an.json()["type"] == "error" and an.json()["error"]["type"] == "api_error"
    recs = {r["episode"]: r for r in records(p)}
    assert recs["d1"]["response"]["status"] == 502 and "unreachable" in recs["d1"]["error"]
    assert recs["d1"]["upstream_request"] is None
