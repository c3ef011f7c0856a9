"""The policy version: set through the control API (reward token only), stamped on every exchange record."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from openforge.addons import options
from openforge.testing.control_api import CLIENT_TOKEN, REWARD_TOKEN, TOKENS_ENV, bearer, exchanges
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

CHAT = {"model": "m", "messages": [{"role": "user", "content": "list the files here"}]}


@pytest.fixture(scope="module")
def engine() -> Any:
    with ScriptedEngine() as eng:
        yield eng


@pytest.fixture(scope="module")
def proxy(engine: ScriptedEngine, start_module_proxy: Any) -> Any:
    return start_module_proxy(engine.url, "openforge_engine_profile=vllm", "openforge_policy_version=2",
                              env=TOKENS_ENV)


def policy(proxy: Any, token: str = REWARD_TOKEN, **kwargs: Any) -> httpx.Response:
    method = kwargs.pop("method", "PUT")
    return httpx.request(method, f"{proxy.url}/openforge/v1/policy", headers=bearer(token), **kwargs)


def test_the_option_sets_the_first_version_and_the_api_reads_and_sets_it(proxy: Any, engine: Any) -> None:
    seen = len(engine.requests)
    assert policy(proxy, CLIENT_TOKEN, method="GET").json() == {"ok": True, "version": 2}
    assert httpx.get(f"{proxy.url}/openforge/v1/status", headers=bearer(CLIENT_TOKEN)).json()["policy_version"] == 2
    r = policy(proxy, json={"version": 7})
    assert r.status_code == 200 and r.json() == {"ok": True, "version": 7, "previous": 2}, r.text
    assert policy(proxy, method="POST", json={"version": 0}).json()["previous"] == 7  # POST too; may go back
    assert policy(proxy, method="GET").json()["version"] == 0
    assert len(engine.requests) == seen  # answered by the proxy, never forwarded


def test_records_carry_the_version_current_when_each_call_arrived(proxy: Any) -> None:
    for version in (0, 3):
        assert policy(proxy, json={"version": version}).status_code == 200
        r = httpx.post(f"{proxy.url}/e/pv/v1/chat/completions", json=CHAT, headers=bearer(CLIENT_TOKEN))
        assert r.status_code == 200, r.text
    assert [r["policy_version"] for r in exchanges(proxy, "pv")] == [0, 3]


def test_only_a_reward_token_sets_the_version(proxy: Any) -> None:
    before = policy(proxy, method="GET").json()["version"]
    agent = policy(proxy, CLIENT_TOKEN, json={"version": 99})  # the agent holds this one
    assert agent.status_code == 403 and "reward token" in agent.json()["error"], agent.text
    for headers in ({}, bearer("of-unknown-TOKEN-0123456789abcdef")):
        r = httpx.put(f"{proxy.url}/openforge/v1/policy", json={"version": 99}, headers=headers)
        assert r.status_code == 401 and r.json()["error"], r.text
    assert httpx.get(f"{proxy.url}/openforge/v1/policy").status_code == 401  # reading needs a token too
    assert policy(proxy, method="GET").json()["version"] == before


@pytest.mark.parametrize("body", [b"", b"[]", b'{"version": -1}', b'{"version": 1.5}', b'{"version": true}',
                                  b'{"version": "3"}', b'{"v": 3}', b'{"version": 9223372036854775808}'])
def test_bad_bodies_are_refused_and_change_nothing(proxy: Any, body: bytes) -> None:
    before = policy(proxy, method="GET").json()["version"]
    r = policy(proxy, content=body)
    assert r.status_code == 400 and "version" in r.json()["error"], r.text
    assert policy(proxy, method="GET").json()["version"] == before


def test_other_methods_are_refused(proxy: Any) -> None:
    r = policy(proxy, method="DELETE")
    assert r.status_code == 405 and "PUT" in r.json()["error"], r.text


@pytest.mark.parametrize(("value", "expected"), [("", 0), ("0", 0), (" 12 ", 12)])
def test_option_parses_a_non_negative_integer(value: str, expected: int) -> None:
    s = options.parse({"openforge_upstream_url": "http://127.0.0.1:1", "openforge_policy_version": value})
    assert s.policy_version == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "x", str(1 << 63)])
def test_option_refuses_anything_else(value: str) -> None:
    with pytest.raises(options.BadOption, match="openforge_policy_version"):
        options.parse({"openforge_upstream_url": "http://127.0.0.1:1", "openforge_policy_version": value})
