"""Pause and resume: new LLM calls wait in the proxy during a weight update and go on, with the new policy
version, when it resumes; the harness sees a slow call, never an error, unless it waits past the timeout."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from openforge.addons import options
from openforge.protocols.control import ControlClient, StatusAnswer
from openforge.testing.control_api import CLIENT_TOKEN, REWARD_TOKEN, TOKENS_ENV, bearer, exchanges
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

MESSAGES: list[Any] = [{"role": "user", "content": "list the files here"}]
DEADLINE = 60.0  # generous: only a broken proxy takes this long


@pytest.fixture(scope="module")
def engine() -> Any:
    with ScriptedEngine() as eng:
        yield eng


@pytest.fixture(scope="module")
def proxy(engine: ScriptedEngine, start_module_proxy: Any) -> Any:
    return start_module_proxy(engine.url, "openforge_engine_profile=vllm",
                              env=TOKENS_ENV)


@pytest.fixture(autouse=True)
def resumed(proxy: Any) -> Iterator[None]:
    """Every test starts and ends with the proxy running."""
    yield
    assert control(proxy, "resume").status_code == 200


def control(proxy: Any, action: str, token: str | None = REWARD_TOKEN, **kwargs: Any) -> httpx.Response:
    method = kwargs.pop("method", "POST")
    headers = bearer(token) if token else {}
    return httpx.request(method, f"{proxy.url}/openforge/v1/{action}", headers=headers, timeout=30, **kwargs)


def status(proxy: Any) -> StatusAnswer:
    return ControlClient(proxy.url, CLIENT_TOKEN).status()


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def chat_calls(engine: ScriptedEngine) -> int:
    return sum(r.path.startswith("/v1/chat/completions") for r in engine.requests)


def openai_client(proxy: Any, episode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/e/{episode}/v1", api_key=CLIENT_TOKEN, max_retries=0, timeout=120)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run `fn` in a thread; its result (or exception) lands in the dict."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as e:  # noqa: BLE001 - the test reads it
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_held_calls_reach_the_engine_only_on_resume_with_its_version(proxy: Any, engine: ScriptedEngine) -> None:
    client = openai_client(proxy, "held")
    r = control(proxy, "pause")
    assert r.status_code == 200 and r.json() == {"ok": True, "paused": True, "was_paused": False, "held": 0,
                                                 "timeout_s": 300.0}, r.text
    before = chat_calls(engine)

    def streamed() -> str:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def whole() -> str:
        return client.chat.completions.create(model="m", messages=MESSAGES).choices[0].message.content or ""

    calls = [in_thread(streamed), in_thread(whole)]
    wait_until(lambda: status(proxy)["held"] == 2, "both calls held")
    assert status(proxy)["paused"] is True
    assert chat_calls(engine) == before  # held in the proxy, not at the engine
    assert all(t.is_alive() for t, _ in calls)  # waiting, not failed

    r = control(proxy, "resume", json={"version": 5})
    assert r.status_code == 200, r.text
    assert r.json() == {"ok": True, "paused": False, "was_paused": True, "released": 2, "version": 5,
                        "previous": 0}
    for t, _ in calls:
        t.join(DEADLINE)
    (_, stream_out), (_, whole_out) = calls
    assert "error" not in stream_out and "error" not in whole_out, (stream_out, whole_out)
    assert stream_out["result"] and stream_out["result"] == whole_out["result"]
    assert chat_calls(engine) == before + 2
    records = exchanges(proxy, "held")
    assert len(records) == 2
    assert all(r["policy_version"] == 5 and r["complete"] and not r["error"] for r in records), records
    assert status(proxy)["held"] == 0


def test_a_call_held_past_the_timeout_gets_a_503_in_the_chat_protocol(proxy: Any, engine: ScriptedEngine) -> None:
    assert control(proxy, "pause", json={"timeout_s": 0.2}).json()["timeout_s"] == 0.2
    before = chat_calls(engine)
    client = openai_client(proxy, "late-chat")
    with pytest.raises(openai.InternalServerError) as raised:  # a proper error, never a half stream
        for _ in client.chat.completions.create(model="m", messages=MESSAGES, stream=True):
            pass
    assert raised.value.status_code == 503 and "paused" in raised.value.message
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model="m", messages=MESSAGES)
    assert raised.value.status_code == 503
    assert chat_calls(engine) == before
    records = exchanges(proxy, "late-chat")
    assert len(records) == 2
    for record in records:  # recorded like every other refused call
        assert record["complete"] and "paused" in record["error"] and record["upstream_request"] is None
        assert record["response"]["status"] == 503


def test_a_call_held_past_the_timeout_gets_a_503_in_the_anthropic_protocol(proxy: Any) -> None:
    control(proxy, "pause", json={"timeout_s": 0.2})
    client = anthropic.Anthropic(base_url=f"{proxy.url}/e/late-anthropic", api_key=CLIENT_TOKEN, max_retries=0)
    with pytest.raises(anthropic.InternalServerError) as raised:
        with client.messages.stream(model="m", max_tokens=64, messages=MESSAGES) as stream:
            for _ in stream:
                pass
    assert raised.value.status_code == 503
    assert raised.value.body == {"type": "error", "error": {"type": "api_error", "message": raised.value.body[
        "error"]["message"]}} and "paused" in raised.value.body["error"]["message"]
    (record,) = exchanges(proxy, "late-anthropic")
    assert record["protocol"] == "anthropic" and record["response"]["status"] == 503


def test_a_stream_in_flight_when_the_pause_comes_completes(proxy: Any, engine: ScriptedEngine) -> None:
    version = control(proxy, "resume").json()["version"]
    engine.chunk_delay = 0.05
    try:
        stream = openai_client(proxy, "in-flight").chat.completions.create(model="m", messages=MESSAGES, stream=True)
        chunks = iter(stream)
        first = next(chunks)
        assert control(proxy, "pause").status_code == 200
        rest = list(chunks)
    finally:
        engine.chunk_delay = 0.0
    assert rest and rest[-1].choices[0].finish_reason == "stop"
    assert status(proxy)["paused"] is True
    (record,) = exchanges(proxy, "in-flight")
    assert record["complete"] and not record["error"] and record["policy_version"] == version
    assert first.id == rest[-1].id


def test_the_proxys_own_endpoints_are_never_held(proxy: Any) -> None:
    control(proxy, "pause")
    assert status(proxy)["paused"] is True
    assert httpx.get(f"{proxy.url}/openforge/v1/policy", headers=bearer(CLIENT_TOKEN)).status_code == 200
    r = httpx.post(f"{proxy.url}/openforge/v1/episodes/during-pause/reward", json={"reward": 1.0},
                   headers=bearer(REWARD_TOKEN))
    assert r.status_code == 200, r.text
    assert control(proxy, "resume").json()["was_paused"] is True


def test_pause_and_resume_are_idempotent(proxy: Any) -> None:
    assert control(proxy, "pause").json()["was_paused"] is False
    again = control(proxy, "pause", json={"timeout_s": 7})
    assert again.json() == {"ok": True, "paused": True, "was_paused": True, "held": 0, "timeout_s": 7.0}
    assert control(proxy, "resume").json()["was_paused"] is True
    version = status(proxy)["policy_version"]
    r = control(proxy, "resume", content=b"")
    assert r.json() == {"ok": True, "paused": False, "was_paused": False, "released": 0, "version": version,
                        "previous": version}
    assert status(proxy)["paused"] is False


def test_only_a_reward_token_pauses_or_resumes(proxy: Any) -> None:
    for action in ("pause", "resume"):
        agent = control(proxy, action, CLIENT_TOKEN)  # the agent holds this one
        assert agent.status_code == 403 and "reward token" in agent.json()["error"], agent.text
        for token in (None, "of-unknown-TOKEN-0123456789abcdef"):
            r = control(proxy, action, token)
            assert r.status_code == 401 and r.json()["error"], r.text
    assert status(proxy)["paused"] is False
    control(proxy, "pause")
    version = status(proxy)["policy_version"]
    assert control(proxy, "resume", CLIENT_TOKEN, json={"version": version + 1}).status_code == 403
    assert status(proxy)["paused"] is True and status(proxy)["policy_version"] == version


@pytest.mark.parametrize(("action", "body"), [
    ("pause", b"[]"), ("pause", b'{"timeout_s": 0}'), ("pause", b'{"timeout_s": -1}'), ("pause", b'{"timeout_s": "9"}'),
    ("pause", b'{"timeout_s": true}'), ("pause", b'{"timeout_s": 1e9}'), ("pause", b'{"timeout": 9}'),
    ("resume", b"[]"), ("resume", b'{"version": -1}'), ("resume", b'{"version": 1.5}'), ("resume", b'{"v": 1}'),
])
def test_bad_bodies_are_refused_and_change_nothing(proxy: Any, action: str, body: bytes) -> None:
    control(proxy, "pause")
    before = status(proxy)
    r = control(proxy, action, content=body)
    assert r.status_code == 400 and r.json()["error"], r.text
    after = status(proxy)
    assert (after["paused"], after["policy_version"]) == (before["paused"], before["policy_version"])


def test_other_methods_are_refused(proxy: Any) -> None:
    for action in ("pause", "resume"):
        r = control(proxy, action, method="GET")
        assert r.status_code == 405 and "POST" in r.json()["error"], r.text


@pytest.mark.parametrize(("value", "expected"), [("", 300.0), ("0.5", 0.5), (" 20 ", 20.0)])
def test_option_parses_a_timeout(value: str, expected: float) -> None:
    s = options.parse({"openforge_upstream_url": "http://127.0.0.1:1", "openforge_pause_timeout": value})
    assert s.pause_timeout == expected


@pytest.mark.parametrize("value", ["0", "-1", "x", "nan", "inf", "1e9"])
def test_option_refuses_anything_else(value: str) -> None:
    with pytest.raises(options.BadOption, match="openforge_pause_timeout"):
        options.parse({"openforge_upstream_url": "http://127.0.0.1:1", "openforge_pause_timeout": value})
