"""`openforge preflight` against a real (scripted) engine: each way an upstream can be wrong gets a clear
message and a non-zero exit; a healthy engine passes and gets the right engine profile."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import typer
from typer.testing import CliRunner

from openforge.commands import preflight as preflight_cmd
from openforge.preflight import Preflight
from openforge.testing.scripted_engine import ScriptedEngine

KEY = "sk-right-key-0123456789"
CLEAN_ENV = {"OPENFORGE_UPSTREAM_URL": "", "OPENFORGE_UPSTREAM_KEY": "", "OPENFORGE_MODELS": ""}


def run(*args: str):
    app = typer.Typer()
    preflight_cmd.register(app)
    app.command("other")(lambda: None)  # keep `preflight` a subcommand, as in the real CLI
    return CliRunner().invoke(app, ["preflight", *args], env=CLEAN_ENV)


def run_json(*args: str) -> tuple[int, dict]:
    result = run(*args, "--json")
    return result.exit_code, json.loads(result.stdout)


def failed(report: dict) -> dict[str, str]:
    return {f["check"]: f["message"] for f in report["findings"] if not f["ok"]}


def test_preflight_healthy_vllm_engine_passes():
    with ScriptedEngine(api_key=KEY, models=["Qwen/Qwen3-8B"]) as eng:
        result = run("--upstream", eng.url + "/v1", "--key", KEY)
        assert result.exit_code == 0, result.output
        assert "ready" in result.output and "engine profile: vllm" in result.output
        assert KEY not in result.output
        chat = [r for r in eng.requests if r.path == "/v1/chat/completions"]
        assert chat[0].body["model"] == "Qwen/Qwen3-8B" and "return_token_ids" not in chat[0].body
        assert chat[1].body["return_token_ids"] is True and chat[1].body["logprobs"] is True


def test_preflight_rejected_key_is_masked():
    with ScriptedEngine(api_key=KEY) as eng:
        code, report = run_json("--upstream", eng.url, "--key", "sk-wrong-key-abcdefgh")
        assert code == 1
        assert "401" in failed(report)["auth"] and "sk-w…efgh" in failed(report)["auth"]
        assert "sk-wrong-key-abcdefgh" not in json.dumps(report)
        code, report = run_json("--upstream", eng.url)
        assert code == 1 and "no key was sent" in failed(report)["auth"]


def test_preflight_unreachable_and_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, report = run_json("--upstream", f"http://127.0.0.1:{port}")
    assert code == 1 and "connection refused" in failed(report)["reachable"]
    with socket.socket() as silent:  # accepts connections (backlog) but never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        code, report = run_json("--upstream", f"http://127.0.0.1:{silent.getsockname()[1]}", "--timeout", "0.3")
    assert code == 1 and "did not answer within 0.3 s" in failed(report)["reachable"]


def test_preflight_unknown_model_lists_served_ones():
    with ScriptedEngine(models=["Qwen/Qwen3-8B", "Qwen/Qwen3-VL"]) as eng:
        code, report = run_json("--upstream", eng.url, "--model", "gpt-4o")
    assert code == 1
    message = failed(report)["chat gpt-4o"]
    assert "unknown" in message and "Qwen/Qwen3-8B, Qwen/Qwen3-VL" in message


@pytest.mark.parametrize(("fault", "expected"), [("no_choices", "no `choices`"), ("empty", "empty output"),
                                                 ("http_500", "HTTP 500")])
def test_preflight_broken_answers_fail(fault, expected):
    with ScriptedEngine(fault=fault) as eng:
        code, report = run_json("--upstream", eng.url)
    assert code == 1 and expected in failed(report)["chat scripted-model"]


@pytest.mark.parametrize(("profile", "warn"), [("llamacpp", False), ("generic", True)])
def test_preflight_names_the_engine_profile(profile, warn):
    with ScriptedEngine(profile=profile) as eng:
        code, report = run_json("--upstream", eng.url)
    assert code == 0 and report["profile"] == profile
    token = next(f for f in report["findings"] if f["check"] == "token ids")
    assert token["warn"] is warn
    prompt = [f for f in report["findings"] if f["check"] == "prompt ids"]
    if profile == "llamacpp":  # asked as the proxy asks them, and counted as the Chat answer counted them
        assert [(f["ok"], f["warn"]) for f in prompt] == [(True, False)] and "/apply-template" in prompt[0]["message"]
    else:
        assert prompt == []


def test_preflight_tries_every_routed_model_with_its_sampling():
    routes = {"agent": {"models": {"claude-*": "served-a"}, "sampling": {"temperature": 1.0}},
              "validator": {"models": {"*": "served-b"}}}
    with ScriptedEngine(models=["served-a"]) as eng:
        code, report = run_json("--upstream", eng.url, "--models", json.dumps(routes))
        sent = [r.body for r in eng.requests if r.path == "/v1/chat/completions"]
    assert code == 1 and list(failed(report)) == ["chat served-b (role validator)"]
    assert sent[0]["model"] == "served-a" and sent[0]["temperature"] == 1.0


def test_preflight_bad_input_is_a_clear_error():
    result = run("--upstream", "ftp://example")
    assert result.exit_code == 2 and "http(s) URL" in result.output and "Traceback" not in result.output
    result = run()
    assert result.exit_code == 2 and "OPENFORGE_UPSTREAM_URL" in result.output
    result = run("--upstream", "http://127.0.0.1:1", "--models", "{not json")
    assert result.exit_code == 2 and "not valid JSON" in result.output


@pytest.mark.parametrize("bad", [KEY + "\n", KEY + " ", " " + KEY, KEY[:6] + "\n" + KEY[6:]])
def test_preflight_key_with_whitespace_is_named_and_never_printed(bad):
    with ScriptedEngine(api_key=KEY) as eng:
        result = run("--upstream", eng.url, "--key", bad)
        code, report = run_json("--upstream", eng.url, "--key", bad)
    assert result.exit_code == 1 and code == 1
    assert "whitespace" in failed(report)["key"] or "control character" in failed(report)["key"]
    for shown in (result.output, json.dumps(report)):
        assert KEY[4:-4] not in shown and "cannot reach" not in shown


def test_preflight_warns_when_a_proxy_variable_would_catch_the_toolchains_calls():
    with ScriptedEngine() as eng:
        env = {**CLEAN_ENV, "NO_PROXY": None, "no_proxy": None, "http_proxy": None, "all_proxy": None,
               "ALL_PROXY": None, "HTTP_PROXY": "http://user:secret-pw@corp-proxy:3128"}
        app = typer.Typer()
        preflight_cmd.register(app)
        app.command("other")(lambda: None)
        result = CliRunner().invoke(app, ["preflight", "--upstream", eng.url, "--json"], env=env)
        report = json.loads(result.stdout)
        warning = next(f for f in report["findings"] if f["check"] == "proxy environment")
        assert result.exit_code == 0 and warning["warn"] and "NO_PROXY" in warning["message"]
        assert "corp-proxy:3128" in warning["message"] and "secret-pw" not in result.stdout
        result = CliRunner().invoke(app, ["preflight", "--upstream", eng.url, "--json"],
                                    env={**env, "NO_PROXY": "127.0.0.1,localhost"})
        assert all(f["check"] != "proxy environment" for f in json.loads(result.stdout)["findings"])


def test_preflight_names_a_cut_by_the_engines_own_length_limit():
    """A 1-token answer with finish_reason=length was reported as "cut at max_tokens=16"."""
    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "owned_by": "llamacpp"}]})
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"role": "assistant", "content": "O"},
                                                      "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": 20, "completion_tokens": 1}})

    client = httpx.Client(transport=httpx.MockTransport(engine))
    report = Preflight("http://engine:8000", client=client).run()
    message = failed(report.as_dict())["chat m"]
    assert "after 1 token(s)" in message and "own length limit" in message and "cut at max_tokens" not in message


def test_preflight_sends_a_streamed_call_with_tools_as_the_proxy_would():
    """Every real CLI streams with tools: preflight sends that shape with the profile's token-id fields."""
    with ScriptedEngine() as eng:
        code, report = run_json("--upstream", eng.url)
    assert code == 0, report
    (call,) = [r.body for r in eng.requests if r.path == "/v1/chat/completions" and r.body.get("tools")]
    assert call["stream"] is True and call["return_token_ids"] is True and call["logprobs"] is True
    finding = next(f for f in report["findings"] if f["check"] == "streamed call with tools")
    assert finding["ok"] and not finding["warn"] and "with token ids" in finding["message"]


@pytest.mark.slow
def test_preflight_on_the_embedded_engine_checks_the_streamed_tool_call(monkeypatch, tmp_path):
    """llama.cpp refuses logprobs on a streamed call with tools (400): preflight says "ready" only because
    the proxy sends that call unstreamed; sent streamed (as the proxy once did), preflight fails naming it."""
    from openforge import preflight
    from openforge.engines.llamacpp import EmbeddedEngine

    with EmbeddedEngine(threads=1, log_path=tmp_path / "engine.log") as eng:
        code, report = run_json("--upstream", eng.url)
        assert code == 0 and report["profile"] == "llamacpp", report
        finding = next(f for f in report["findings"] if f["check"] == "streamed call with tools")
        assert finding["ok"] and "unstreamed" in finding["message"] and "with token ids" in finding["message"]
        monkeypatch.setattr(preflight.profiles, "unstream", lambda *_: False)
        code, report = run_json("--upstream", eng.url)
    assert code == 1
    assert "logprobs is not supported with tools + stream" in failed(report)["streamed call with tools"]
