"""Per-role upstreams (docs/addon.md, Routing): a role's route may name its own upstream and key file, so a
hosted model validates while the local engine serves the policy, behind one client key. Two scripted
engines on 127.0.0.1, each accepting only its own key, behind a real mitmdump."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from openforge.addons import options
from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.processes import free_port
from openforge.testing.scripted_engine import ScriptedEngine

LOCAL_KEY = "sk-local-ENGINE-0123456789abcdef"
HOSTED_KEY = "sk-hosted-VALIDATOR-fedcba9876543210"
CLIENT = "client-token-0123456789abcdef0123"
BODY = {"model": "claude-x", "messages": [{"role": "user", "content": "check this task"}]}


def routes_file(tmp: Path, hosted_url: str, key: str = HOSTED_KEY) -> Path:
    (tmp / "hosted.key").write_text(key + "\n")
    path = tmp / "routes.toml"
    path.write_text(f'[agent]\nmodels = {{"*" = "policy-model"}}\n\n'
                    f'[validator]\nmodels = {{"*" = "hosted-model"}}\nupstream = "{hosted_url}/v1"\n'
                    f'key_file = "{tmp / "hosted.key"}"\n')
    return path


@pytest.fixture
def engines() -> Any:
    with ScriptedEngine(api_key=LOCAL_KEY) as local, ScriptedEngine(api_key=HOSTED_KEY, profile="generic") as hosted:
        yield local, hosted


def test_each_role_goes_to_its_upstream_with_its_key(engines: Any, start_proxy: Any, tmp_path: Path) -> None:
    local, hosted = engines
    proxy = start_proxy(local.url, f"openforge_upstream_key={LOCAL_KEY}", f"openforge_client_tokens={CLIENT}",
                        f"openforge_models={routes_file(tmp_path, hosted.url)}")
    auth = {"authorization": f"Bearer {CLIENT}"}
    for role in ("agent", "validator", "agent"):
        answer = httpx.post(f"{proxy.url}/r/{role}/e/ep-{role}/v1/chat/completions", json=BODY, headers=auth,
                            timeout=30)
        assert answer.status_code == 200, answer.text
    assert [r.body["model"] for r in local.requests if r.path.startswith("/v1/chat")] == ["policy-model"] * 2
    assert [r.body["model"] for r in hosted.requests if r.path.startswith("/v1/chat")] == ["hosted-model"]
    proxy.stop()

    recs = []
    for path in expand_paths([proxy.flow_dir]):
        raw = path.read_bytes()
        assert HOSTED_KEY.encode() not in raw and LOCAL_KEY.encode() not in raw and CLIENT.encode() not in raw
        recs.extend(r for r in open_flow_file(path).records() if r.get("type") == "exchange")
    by_role = {r["role"]: r for r in recs}
    assert sorted(r["role"] for r in recs) == ["agent", "agent", "validator"]
    assert all(r["complete"] and r["response"]["status"] == 200 for r in recs)
    assert by_role["validator"]["upstream_request"]["url"].startswith(f"{hosted.url}/v1/chat/completions")
    assert by_role["agent"]["upstream_request"]["url"].startswith(f"{local.url}/v1/chat/completions")
    assert by_role["validator"]["engine_profile"] == "generic" and by_role["agent"]["engine_profile"] == "vllm"
    assert by_role["validator"]["upstream_model"] == "hosted-model"
    log = proxy.log()
    assert HOSTED_KEY not in log and f"validator: *->hosted-model upstream http://127.0.0.1:{hosted.port}" in log


def test_an_unreachable_role_upstream_stops_the_proxy_with_one_line(engines: Any, start_proxy: Any,
                                                                      tmp_path: Path) -> None:
    local, _ = engines
    gone = f"http://127.0.0.1:{free_port()}"
    proxy = start_proxy(local.url, f"openforge_models={routes_file(tmp_path, gone)}", wait=False)
    assert proxy.proc.wait(timeout=60) != 0
    lines = [line for line in proxy.log().splitlines() if "cannot start" in line]
    assert len(lines) == 1 and f"role 'validator': its upstream {gone} is not reachable" in lines[0], proxy.log()


@pytest.mark.parametrize(("table", "message"), [
    ({"validator": {"upstream": "http://h:1", "key": "sk-inline"}}, "names a key inline"),
    ({"validator": {"key_file": "/k"}}, "key_file is set without validator.upstream"),
    ({"validator": {"upstream": "ftp://h"}}, "validator.upstream must be an http(s) URL"),
    ({"validator": {"upstream": "http://h:1", "key_file": "/nonexistent/key"}}, "cannot read validator.key_file"),
])
def test_bad_role_upstreams_are_refused(table: dict[str, Any], message: str) -> None:
    with pytest.raises(options.BadOption, match=re.escape(message)) as err:
        options.parse_models(json.dumps(table))
    assert "sk-inline" not in str(err.value)


def test_preflight_checks_every_roles_upstream(engines: Any, tmp_path: Path) -> None:
    from openforge.cli import app

    local, hosted = engines
    args = ["preflight", "--upstream", local.url, "--key", LOCAL_KEY, "--json"]
    good = CliRunner().invoke(app, [*args, "--models", str(routes_file(tmp_path, hosted.url))])
    report = json.loads(good.stdout)
    assert good.exit_code == 0 and report["ok"], good.stdout
    assert report["roles"]["validator"]["upstream"] == hosted.url
    assert any(f["check"] == "chat hosted-model (role validator)" and f["ok"]
               for f in report["roles"]["validator"]["findings"])
    assert all("hosted-model" not in f["check"] for f in report["findings"])
    bad = CliRunner().invoke(app, [*args, "--models", str(routes_file(tmp_path, hosted.url, key="sk-wrong-key"))])
    report = json.loads(bad.stdout)
    assert bad.exit_code == 1 and not report["ok"] and not report["roles"]["validator"]["ok"]
    assert HOSTED_KEY not in bad.stdout and "sk-wrong-key" not in bad.stdout
