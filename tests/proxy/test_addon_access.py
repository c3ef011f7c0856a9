"""Who gets in (client and reward tokens, forwarded paths), what is refused, and no credential leaks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from mitmproxy.test import taddons

from openforge.addons import options
from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.addons.proxy import OpenForge
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

UPSTREAM_KEY = "sk-upstream-SECRET-0123456789abcdef"
CLIENT_TOKEN = "of-client-TOKEN-0123456789abcdef"
REWARD_TOKEN = "of-reward-TOKEN-0123456789abcdef"
FOREIGN_KEY = "AIzaFOREIGN-credential-0123456789"
MESSAGES = [{"role": "user", "content": "list the files here"}]
CHAT = {"model": "m", "messages": MESSAGES}


@pytest.fixture(scope="module")
def engine() -> Any:
    with ScriptedEngine(api_key=UPSTREAM_KEY) as eng:
        yield eng


@pytest.fixture(scope="module")
def open_proxy(engine: ScriptedEngine, start_module_proxy: Any) -> Any:
    """No tokens configured: today's open behaviour, with the new value checks and path rules."""
    return start_module_proxy(engine.url, f"openforge_upstream_key={UPSTREAM_KEY}", "openforge_engine_profile=vllm")


@pytest.fixture(scope="module")
def proxy(engine: ScriptedEngine, start_module_proxy: Any) -> Any:
    return start_module_proxy(engine.url, f"openforge_upstream_key={UPSTREAM_KEY}", "openforge_engine_profile=vllm",
                              "openforge_reward_policy=first", "openforge_allow_paths=/health",
                              env={"OPENFORGE_CLIENT_TOKENS": f"of-other-token-aaaaaaaaaaaa, {CLIENT_TOKEN}",
                                   "OPENFORGE_REWARD_TOKENS": REWARD_TOKEN})


def records(proxy: Any, token: str | None = None) -> list[dict[str, Any]]:
    httpx.get(f"{proxy.url}/openforge/v1/status", headers={"authorization": f"Bearer {token}"} if token else {})
    return [r for path in expand_paths([proxy.flow_dir]) for r in open_flow_file(path).records()]


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# -- A. reward values ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("body", "message"), [
    (b'{"reward": NaN}', "finite"),
    (b'{"reward": Infinity}', "finite"),
    (b'{"reward": -Infinity}', "finite"),
    (b'{"reward": 1' + b"0" * 400 + b"}", "between"),
    (b'{"reward": 1e300}', "between"),
    (b'{"reward": 1, "metadata": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}", "nested"),
    (b'{"reward": 1, "metadata": {"log": "' + b"x" * 300_000 + b'"}}', "metadata"),
    (b'{"reward": 1, "task_id": "' + b"t" * 5000 + b'"}', "task_id"),
    (b"[" * 100_000 + b"]" * 100_000, "JSON object"),
])
def test_reward_refuses_non_finite_and_absurd_values(open_proxy: Any, body: bytes, message: str) -> None:
    r = httpx.post(f"{open_proxy.url}/openforge/v1/episodes/bad-value/reward", content=body)
    assert r.status_code == 400 and message in r.json()["error"], r.text
    assert not [rec for rec in records(open_proxy) if rec.get("episode") == "bad-value"]


@pytest.mark.parametrize("episode", ["x" * 300, "a%0Aforged", "a%1B%5B31mred"])
def test_reward_refuses_long_or_control_character_episode_ids(open_proxy: Any, episode: str) -> None:
    r = httpx.post(f"{open_proxy.url}/openforge/v1/episodes/{episode}/reward", json={"reward": 1.0})
    assert r.status_code == 400 and "episode" in r.json()["error"], r.text


def test_reward_policy_last_is_recorded_on_every_reward(engine: Any, start_proxy: Any) -> None:
    proxy = start_proxy(engine.url, "openforge_reward_policy=last")
    for value in (0.0, 1.0):
        assert httpx.post(f"{proxy.url}/openforge/v1/episodes/twice/reward", json={"reward": value}).is_success
    rewards = [r for r in records(proxy) if r["type"] == "reward" and r["episode"] == "twice"]
    assert [(r["reward"], r["reward_policy"]) for r in rewards] == [(0.0, "last"), (1.0, "last")]


def test_the_first_reward_counts_by_default_and_a_second_is_refused_on_record(open_proxy: Any) -> None:
    """A later post (the agent's own, from a process that outlived it) never replaces the verifier's: 409,
    a warning line and a `reward_refused` record."""
    url = f"{open_proxy.url}/openforge/v1/episodes/once/reward"
    assert httpx.post(url, json={"reward": 0.0, "task_id": "t"}).is_success
    later = httpx.post(url, json={"reward": 0.99})
    assert later.status_code == 409 and "already has a reward" in later.json()["error"]
    recs = [r for r in records(open_proxy) if r.get("episode") == "once"]
    assert [(r["type"], r["reward"]) for r in recs] == [("reward", 0.0), ("reward_refused", 0.99)]
    assert recs[0]["reward_policy"] == "first" and "already has a reward" in recs[1]["error"]
    assert "reward refused (409) episode=once" in open_proxy.log()


# -- B. access ---------------------------------------------------------------------------------------------------
def test_no_token_or_an_unknown_one_is_refused_in_the_clients_protocol(proxy: Any, engine: Any) -> None:
    seen = len(engine.requests)
    oa = httpx.post(f"{proxy.url}/e/anon/v1/chat/completions", json=CHAT)
    assert oa.status_code == 401 and oa.json()["error"]["code"] == "invalid_api_key", oa.text
    an = httpx.post(f"{proxy.url}/e/anon/v1/messages", json={**CHAT, "max_tokens": 5},
                    headers={"x-api-key": "sk-ant-wrong-0123456789abcdef"})
    assert an.status_code == 401 and an.json()["type"] == "error"
    assert an.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{proxy.url}/v1/models", headers=bearer(UPSTREAM_KEY)).status_code == 401  # not a client token
    assert httpx.get(f"{proxy.url}/openforge/v1/status").status_code == 401
    assert len(engine.requests) == seen  # nothing reached the engine
    recs = [r for r in records(proxy, CLIENT_TOKEN) if r.get("episode") == "anon"]
    assert [r["response"]["status"] for r in recs] == [401, 401] and all(r["upstream_request"] is None for r in recs)


@pytest.mark.parametrize(("path", "headers"), [
    ("/e/tok-bearer/v1/chat/completions", bearer(CLIENT_TOKEN)),
    ("/e/tok-xkey/v1/chat/completions", {"x-api-key": CLIENT_TOKEN}),
    ("/e/tok-azure/v1/chat/completions", {"api-key": CLIENT_TOKEN}),
    (f"/k/{CLIENT_TOKEN}/e/tok-path/v1/chat/completions", {}),
])
def test_a_client_token_is_swapped_for_the_upstream_key(proxy: Any, engine: Any, path: str,
                                                        headers: dict[str, str]) -> None:
    r = httpx.post(proxy.url + path, json=CHAT, headers=headers)
    assert r.status_code == 200, r.text
    got = engine.requests[-1]
    assert got.path == "/v1/chat/completions" and got.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert CLIENT_TOKEN not in json.dumps(got.headers)


def test_status_needs_a_token_and_rewards_need_the_reward_token(proxy: Any) -> None:
    assert httpx.get(f"{proxy.url}/openforge/v1/status", headers=bearer(CLIENT_TOKEN)).json()["ok"]
    assert httpx.get(f"{proxy.url}/openforge/v1/status", headers=bearer(REWARD_TOKEN)).json()["ok"]
    url = f"{proxy.url}/openforge/v1/episodes/ep-r/reward"
    assert httpx.post(url, json={"reward": 1.0}).status_code == 401
    agent = httpx.post(url, json={"reward": 1.0}, headers=bearer(CLIENT_TOKEN))  # the agent holds this one
    assert agent.status_code == 403 and "reward token" in agent.json()["error"]
    assert httpx.post(url, json={"reward": 0.0}, headers=bearer(REWARD_TOKEN)).status_code == 200
    later = httpx.post(url, json={"reward": 1.0}, headers=bearer(REWARD_TOKEN))
    assert later.status_code == 409 and "first" in later.json()["error"]
    rewards = [r for r in records(proxy, CLIENT_TOKEN) if r["type"] == "reward" and r["episode"] == "ep-r"]
    assert [(r["reward"], r["reward_policy"]) for r in rewards] == [(0.0, "first")]


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/sleep", "/collective_rpc", "/metrics", "/e/x/tokenize"])
def test_engine_paths_outside_the_llm_endpoints_are_refused(proxy: Any, engine: Any, path: str) -> None:
    seen = len(engine.requests)
    r = httpx.post(proxy.url + path, json={"lora_name": "x"}, headers=bearer(CLIENT_TOKEN))
    assert r.status_code == 403 and "openforge_allow_paths" in r.json()["error"]["message"], r.text
    assert len(engine.requests) == seen
    (rec,) = [r for r in records(proxy, CLIENT_TOKEN) if r.get("protocol") == "other"
              and r["client_request"]["url"].endswith(path)]
    assert rec["response"]["status"] == 403 and rec["upstream_request"] is None and rec["error"]


def test_allowed_paths_are_forwarded_with_a_client_token(proxy: Any, engine: Any) -> None:
    assert httpx.get(f"{proxy.url}/health").status_code == 401
    assert httpx.get(f"{proxy.url}/health", headers=bearer(CLIENT_TOKEN)).status_code == 200
    assert engine.requests[-1].path == "/health"


def test_open_listen_address_without_tokens_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from openforge.addons import access

    addon = OpenForge()
    with taddons.context(addon) as tctx:
        addon._apply(options.parse({"openforge_upstream_url": "http://127.0.0.1:9", "openforge_flow_dir": str(tmp_path),
                                    "openforge_engine_profile": "vllm"}))
        tctx.options.listen_host = "0.0.0.0"
        addon.running()
        assert "without openforge_client_tokens" in caplog.text
        caplog.clear()
        tctx.options.listen_host = "127.0.0.1"
        addon.running()
        assert "without openforge_client_tokens" not in caplog.text
        addon.done()
    assert access.is_loopback("::1") and access.is_loopback("localhost") and not access.is_loopback("")


def test_token_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from openforge.addons import access

    base = {"openforge_upstream_url": "http://127.0.0.1:9", "openforge_flow_dir": str(tmp_path)}
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# agent pods\n{CLIENT_TOKEN}\n\nof-second-token-0123456789\n")
    s = options.parse({**base, "openforge_client_tokens_file": str(tokens)})
    assert s.client_tokens == (CLIENT_TOKEN.encode(), b"of-second-token-0123456789")
    assert access.matches([f"Bearer {CLIENT_TOKEN}"[7:]], s.client_tokens)
    assert not access.matches(["of-second-token-012345678"], s.client_tokens)
    for bad, message in ((f"{CLIENT_TOKEN},short", "at least 16"),):
        with pytest.raises(options.BadOption, match=message):
            options.parse({**base, "openforge_client_tokens": bad})
    with pytest.raises(options.BadOption, match="both a client and a reward token"):
        options.parse({**base, "openforge_client_tokens": CLIENT_TOKEN, "openforge_reward_tokens": CLIENT_TOKEN})
    monkeypatch.setenv("OPENFORGE_UPSTREAM_KEY", UPSTREAM_KEY + "\n")
    with pytest.raises(options.BadOption, match="openforge_upstream_key ends with a newline"):
        options.parse(base)


# -- C. secrets and logs -----------------------------------------------------------------------------------------
def test_every_client_credential_is_masked_and_never_forwarded(open_proxy: Any, engine: Any) -> None:
    headers = {"api-key": FOREIGN_KEY, "x-goog-api-key": FOREIGN_KEY, "authorization": f"Bearer {FOREIGN_KEY}"}
    r = httpx.post(f"{open_proxy.url}/e/creds/v1/chat/completions?key={FOREIGN_KEY}&api_key={FOREIGN_KEY}&keep=1",
                   json=CHAT, headers=headers)
    assert r.status_code == 200, r.text
    got = engine.requests[-1]
    assert FOREIGN_KEY not in got.path + json.dumps(got.headers) and got.path == "/v1/chat/completions?keep=1"
    (rec,) = [rec for rec in records(open_proxy) if rec.get("episode") == "creds"]
    assert FOREIGN_KEY not in json.dumps(rec["client_request"]["headers"]) + rec["client_request"]["url"]
    assert f"key={FOREIGN_KEY[:4]}…{FOREIGN_KEY[-4:]}" in rec["client_request"]["url"]
    for path in list(open_proxy.flow_dir.iterdir()) + [open_proxy.log_path]:
        assert FOREIGN_KEY[4:-4].encode() not in path.read_bytes(), path


def test_control_characters_are_escaped_in_the_log(open_proxy: Any) -> None:
    r = httpx.post(f"{open_proxy.url}/e/ep%0A[00:00:00.000]%20FORGED%1B[31m/v1/chat/completions",
                   json={"model": "m\nFORGED-LINE \x1b[2J", "messages": MESSAGES})
    assert r.status_code == 200
    records(open_proxy)  # the call's line is written and flushed with its record
    log = open_proxy.log()
    assert "\x1b" not in log
    assert not [line for line in log.splitlines() if line.startswith(("FORGED", "[00:00:00.000] FORGED"))]
    assert "episode=ep\\x0a[00:00:00.000] FORGED\\x1b[31m" in log and "model=m\\x0aFORGED-LINE \\x1b[2J" in log


def test_upstream_key_with_a_trailing_newline_stops_the_proxy(start_proxy: Any) -> None:
    p = start_proxy("http://127.0.0.1:9", wait=False, env={"OPENFORGE_UPSTREAM_KEY": UPSTREAM_KEY + "\n"})
    assert p.proc.wait(60) != 0
    assert "OpenForge cannot start: openforge_upstream_key ends with a newline" in p.log()
    assert UPSTREAM_KEY not in p.log()


def test_tokens_never_reach_mitmproxys_own_flow_output(engine: Any, start_proxy: Any) -> None:
    """flow_detail=3 prints every request's URL and headers: tokens presented, right or wrong, show masked."""
    wrong = "of-wrong-TOKEN-fedcba9876543210"
    p = start_proxy(engine.url, f"openforge_upstream_key={UPSTREAM_KEY}", "openforge_engine_profile=vllm",
                    "flow_detail=3",
                    env={"OPENFORGE_CLIENT_TOKENS": CLIENT_TOKEN, "OPENFORGE_REWARD_TOKENS": REWARD_TOKEN})
    assert httpx.post(f"{p.url}/k/{CLIENT_TOKEN}/v1/chat/completions", json=CHAT).status_code == 200
    assert httpx.post(f"{p.url}/k/{wrong}/v1/chat/completions?key={wrong}", json=CHAT,
                      headers={"x-goog-api-key": wrong}).status_code == 401
    assert httpx.post(f"{p.url}/openforge/v1/episodes/e/reward", json={"reward": 1.0},
                      headers=bearer(REWARD_TOKEN)).status_code == 200
    records(p, CLIENT_TOKEN)
    log = p.log()
    assert "/k/of-c…cdef/" in log or "/k/of-w…3210/" in log  # the lines are there, masked
    for secret in (CLIENT_TOKEN, REWARD_TOKEN, wrong, UPSTREAM_KEY):
        assert secret[4:-4] not in log, secret
