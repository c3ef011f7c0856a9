"""An episode's key opens its own episode's LLM calls as the policy role and nothing else; the episode's budget
of calls and tokens. Through a real mitmdump in front of the scripted engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.protocols.client_keys import KeyScope, episode_client_key, key_scope
from openforge.protocols.control import ControlClient
from openforge.testing.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.addon

CLIENT_TOKEN = "of-client-TOKEN-0123456789abcdef"
REWARD_TOKEN = "of-reward-TOKEN-0123456789abcdef"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "list the files here"}], "max_tokens": 8}
ANTHROPIC = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "list the files here"}]}


@pytest.fixture(scope="module")
def engine() -> Any:
    with ScriptedEngine() as eng:
        yield eng


def start(start_proxy: Any, engine: ScriptedEngine, *sets: str) -> Any:
    return start_proxy(engine.url, "openforge_engine_profile=vllm", *sets,
                       env={"OPENFORGE_CLIENT_TOKENS": CLIENT_TOKEN, "OPENFORGE_REWARD_TOKENS": REWARD_TOKEN})


def chat(proxy: Any, prefix: str, key: str, **headers: str) -> httpx.Response:
    return httpx.post(f"{proxy.url}{prefix}/v1/chat/completions", json=CHAT, timeout=30,
                      headers={"authorization": f"Bearer {key}", **headers})


def calls(proxy: Any, episode: str) -> dict[str, Any]:
    return dict(ControlClient(proxy.url, REWARD_TOKEN).calls(episode))


def records(proxy: Any) -> list[dict[str, Any]]:
    ControlClient(proxy.url, REWARD_TOKEN).status()  # every answered exchange is on disk
    return [r for p in expand_paths([proxy.flow_dir]) for r in open_flow_file(p).records() if r["type"] == "exchange"]


def test_a_key_names_its_episode_and_role_and_only_its_token_opens_it() -> None:
    tokens = (CLIENT_TOKEN.encode(),)
    key = episode_client_key(CLIENT_TOKEN, "ep-1/ü")
    assert key.startswith("ofec-") and CLIENT_TOKEN not in key
    assert key_scope(key.encode(), tokens) == KeyScope("ep-1/ü", None)
    assert key_scope(key.encode(), (b"another-token-0123456789",)) is None
    other = episode_client_key(CLIENT_TOKEN, "ep-2")
    forged = other.rsplit(".", 1)[0] + "." + key.rsplit(".", 1)[1]  # another episode's name, this key's MAC
    assert key_scope(forged.encode(), tokens) is None
    assert episode_client_key(CLIENT_TOKEN, "ep-2") != episode_client_key(CLIENT_TOKEN, "ep-1")
    validator = episode_client_key(CLIENT_TOKEN, "ep-1/ü", "validator")
    assert key_scope(validator.encode(), tokens) == KeyScope("ep-1/ü", "validator")
    name, role, mac = validator.removeprefix("ofec-").split(".")
    assert key_scope(f"ofec-{name}.{mac}".encode(), tokens) is None  # the role dropped: the policy role's key?
    assert key_scope(f"ofec-{name}.{role}.{key.rsplit('.', 1)[1]}".encode(), tokens) is None  # a role added
    assert key_scope(episode_client_key(CLIENT_TOKEN, "ab", "c").replace("YWI.Yw", "YQ.YmM").encode(),
                     tokens) is None  # ("ab", "c") is not ("a", "bc")
    for junk in (b"ofec-", b"ofec-.", b"ofec-!!." + b"0" * 64, b"ofec-YQ.." + b"0" * 64, b"sk-" + key.encode()):
        assert key_scope(junk, tokens) is None


def test_an_episode_key_opens_its_own_calls_only(start_proxy: Any, engine: ScriptedEngine) -> None:
    proxy = start(start_proxy, engine)
    key = episode_client_key(CLIENT_TOKEN, "ep-1")
    assert chat(proxy, "/e/ep-1", key).status_code == 200
    refused = {
        "another episode": chat(proxy, "/e/ep-2", key),
        "no episode": chat(proxy, "", key),
        "another role": chat(proxy, "/e/ep-1/r/validator", key),
        "a role header": chat(proxy, "/e/ep-1", key, **{"x-openforge-role": "validator"}),
        "an episode header": chat(proxy, "", key, **{"x-openforge-episode": "ep-2"}),
    }
    for what, answer in refused.items():
        assert answer.status_code == 403, what
        error = answer.json()["error"]
        assert error["type"] == "permission_error" and "opens only episode 'ep-1'" in error["message"], what
    anthropic = httpx.post(f"{proxy.url}/e/ep-2/v1/messages", json=ANTHROPIC, timeout=30,
                           headers={"x-api-key": key, "anthropic-version": "2023-06-01"})
    assert anthropic.status_code == 403 and anthropic.json()["type"] == "error"  # the client's own protocol
    assert anthropic.json()["error"]["type"] == "permission_error"
    assert httpx.get(f"{proxy.url}/health", headers={"authorization": f"Bearer {key}"}).status_code == 403
    control = [httpx.get(f"{proxy.url}{path}", headers={"authorization": f"Bearer {key}"})
               for path in ("/openforge/v1/status", "/openforge/v1/episodes/ep-1/calls", "/openforge/v1/policy")]
    control.append(httpx.post(f"{proxy.url}/openforge/v1/episodes/ep-1/reward", json={"reward": 1.0},
                              headers={"authorization": f"Bearer {key}"}))
    for answer in control:  # the control API's own plain JSON, saying what the key opens
        assert answer.status_code == 403 and "opens only episode 'ep-1'" in answer.json()["error"], answer.text
    # the operator's token keeps every door
    assert chat(proxy, "/e/ep-2/r/validator", CLIENT_TOKEN).status_code == 200
    counted = calls(proxy, "ep-1")
    # 5 + Anthropic + /health refused as calls (a record, a 403), 4 at the control API (counted only)
    assert counted["refused_scope"] == 11 and counted["statuses"] == {"200": 1, "403": 7}
    assert calls(proxy, "ep-2")["calls"] == 1  # the operator's call only: a refusal is the offender's
    mine = [r for r in records(proxy) if r["episode"] == "ep-1"]
    assert sorted(r["response"]["status"] for r in mine) == [200] + [403] * 7
    assert all(key not in str(r["client_request"]["headers"]) for r in mine)  # masked like any credential


def test_a_key_derived_for_a_role_opens_that_role_only(start_proxy: Any, engine: ScriptedEngine) -> None:
    """What the runner gives a validator's episode (`openforge tasks synth`: its rollout's role)."""
    proxy = start(start_proxy, engine)
    key = episode_client_key(CLIENT_TOKEN, "v-1", "validator")
    assert chat(proxy, "/r/validator/e/v-1", key).status_code == 200
    assert chat(proxy, "/e/v-1", key, **{"x-openforge-role": "validator"}).status_code == 200
    for prefix in ("/e/v-1", "/r/agent/e/v-1", "/r/validator/e/v-2"):
        refused = chat(proxy, prefix, key)
        assert refused.status_code == 403, prefix
        assert "episode 'v-1'" in refused.json()["error"]["message"] and "as role 'validator'" in refused.text
    assert calls(proxy, "v-1")["refused_scope"] == 3


def test_tokens_are_counted_from_every_protocols_usage(start_proxy: Any, engine: ScriptedEngine) -> None:
    """Whole and streamed, Chat and Anthropic (as the engine answers it: not translated here)."""
    proxy = start(start_proxy, engine, "openforge_episode_max_tokens=1000000", "openforge_translate=never")
    key = episode_client_key(CLIENT_TOKEN, "t-1")
    sent = [("/v1/chat/completions", CHAT), ("/v1/chat/completions",
                                             {**CHAT, "stream": True, "stream_options": {"include_usage": True}}),
            ("/v1/messages", ANTHROPIC), ("/v1/messages", {**ANTHROPIC, "stream": True})]
    used = []
    for path, body in sent:
        answer = httpx.post(f"{proxy.url}/e/t-1{path}", json=body, timeout=30,
                            headers={"x-api-key": key, "authorization": f"Bearer {key}",
                                     "anthropic-version": "2023-06-01"})
        assert answer.status_code == 200, answer.text
        used.append(calls(proxy, "t-1")["tokens"])
    whole_chat, whole_anthropic = used[0], used[2] - used[1]
    assert whole_chat > 8 and used[1] == 2 * whole_chat  # a stream counts as its whole answer does
    assert whole_anthropic > 8 and used[3] - used[2] == whole_anthropic


def test_usage_is_read_from_a_long_streams_first_and_last_events() -> None:
    from openforge.addons.episode_calls import usage_tokens
    from openforge.addons.exchange import ResponseParts

    events = [b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":1200,'
              b'"cache_read_input_tokens":7,"output_tokens":1}}}\n\n']
    events += [b'data: {"type":"content_block_delta","delta":{"text":"\\"output_tokens\\": 99999"}}\n\n'] * 50
    events += [b'data: {"type":"message_delta","usage":{"output_tokens":',
               b' 30}}\n\n']  # cut between two reads
    assert usage_tokens(ResponseParts(200, (), None, [[0.0, e] for e in events])) == 1230
    chat = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}}'
    assert usage_tokens(ResponseParts(200, (), chat)) == 8


def test_an_episode_past_its_budget_is_refused(start_proxy: Any, engine: ScriptedEngine) -> None:
    proxy = start(start_proxy, engine, "openforge_episode_max_calls=3")
    key = episode_client_key(CLIENT_TOKEN, "flood")
    statuses = [chat(proxy, "/e/flood", key).status_code for _ in range(5)]
    assert statuses == [200, 200, 200, 403, 403]
    last = chat(proxy, "/e/flood", key).json()["error"]
    assert last["type"] == "budget_exhausted" and "openforge_episode_max_calls" in last["message"]
    assert chat(proxy, "/e/other", episode_client_key(CLIENT_TOKEN, "other")).status_code == 200  # its own budget
    counted = calls(proxy, "flood")
    assert counted["refused_budget"] == 3 and counted["statuses"] == {"200": 3, "403": 3}
    assert [r["response"]["status"] for r in records(proxy) if r["episode"] == "flood"] == [200] * 3 + [403] * 3


def test_an_episode_past_its_tokens_is_refused(start_proxy: Any, engine: ScriptedEngine) -> None:
    proxy = start(start_proxy, engine, "openforge_episode_max_tokens=40")
    statuses = []
    for _ in range(4):
        statuses.append(chat(proxy, "/e/big", CLIENT_TOKEN).status_code)
    used = calls(proxy, "big")
    assert statuses[0] == 200 and 403 in statuses and used["tokens"] >= 40 and used["refused_budget"] >= 1


@pytest.mark.parametrize("value", ["-1", "lots", "1.5"])
def test_a_bad_budget_stops_the_proxy_with_a_sentence(start_proxy: Any, engine: ScriptedEngine, value: str,
                                                      tmp_path: Path) -> None:
    proxy = start_proxy(engine.url, f"openforge_episode_max_calls={value}", wait=False)
    assert proxy.proc.wait(30) != 0
    assert "openforge_episode_max_calls must be a whole number" in proxy.log()
