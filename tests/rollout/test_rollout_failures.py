"""Failures named, not trained as the agent's mistakes (docs/rollouts.md, Failure classes).

A verifier that crashes gives no reward (`verify_failed`, its exit code and stderr tail in result.json);
every failed episode has a class (agent, timeout, verifier, engine, infra) and each class a policy (`zero`
posts 0.0, `drop` posts nothing); an engine or proxy error answer to one of the episode's calls, which the
proxy counts per episode (`GET /openforge/v1/episodes/<episode>/calls`), makes it `engine_error`; `openforge
rollout` refuses to start when the proxy does not answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from openforge.protocols.control import ControlClient, ControlError
from openforge.rollout import run
from openforge.rollout.episode import Secrets, parse_reward, run_episode
from openforge.rollout.failures import DEFAULT_POLICY, classify, policies
from openforge.rollout.runner import RolloutError, prepare, summarize
from openforge.rollout.spec import Adapter, EpisodeResult, EpisodeSpec, Task
from openforge.testing import ROOT
from openforge.testing.scripted_chat import content_text
from openforge.testing.toolchain_engine import ToolchainEngine

CLIENT = "client-token-failures-0123456789"
REWARD = "reward-token-failures-0123456789"
TRACEBACK = 'Traceback (most recent call last):\n  File "check.py", line 1, in <module>\n'


# --- the verifier's verdict -------------------------------------------------------------------------------

@pytest.mark.parametrize(("stdout", "code", "stderr", "reward"), [
    ("0.7\n", 0, "", 0.7), ("", 0, "", 1.0), ("", 1, "", 0.0), ("", 0, TRACEBACK + "ValueError: x\n", 1.0),
    ("", 1, TRACEBACK + "AssertionError: expected 5\n", 0.0),  # an assert is a check saying no
    ("\n  \n", 1, "1 failed\n", 0.0)])
def test_a_reward_is_a_number_with_exit_0_or_the_exit_status_0_or_1(stdout: str, code: int, stderr: str,
                                                                    reward: float) -> None:
    assert parse_reward(stdout, code, stderr) == reward


@pytest.mark.parametrize(("stdout", "code", "stderr", "why"), [
    ("0.7\n", 1, TRACEBACK + "KeyError: 'x'\n", "exited 1 after printing"),
    ("", 127, "bash: line 1: grade: command not found\n", "exited 127"),
    ("", 2, "usage: check [-h]\n", "exited 2"),
    ("", -9, "", "killed by signal 9"),
    ("", 1, TRACEBACK + "NameError: name 'x' is not defined\n", "crashed: NameError"),
    ("", 1, "/usr/bin/python3: No module named grader\n", "crashed: No module named grader")])
def test_a_crashing_verifier_is_no_reward(stdout: str, code: int, stderr: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_reward(stdout, code, stderr)


class FakeProxy:
    """The proxy's reward, calls and status endpoints, in a thread: what the episode process asks it."""

    def __init__(self, calls: dict[str, Any] | None = None) -> None:
        self.calls, self.rewards = calls, []  # type: ignore[var-annotated]
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                found = proxy.calls if self.path.endswith("/calls") else None
                self.answer(404 if found is None else 200, found or {"error": "not found"})

            def do_POST(self) -> None:
                proxy.rewards.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                self.answer(200, {"ok": True})

            def answer(self, status: int, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture
def fake_proxy() -> Iterator[FakeProxy]:
    proxy = FakeProxy()
    yield proxy
    proxy.server.shutdown()


def episode(tmp_path: Path, proxy: FakeProxy, agent: str, verify: str, timeout_s: float = 60,
            on_failure: Any = "default") -> tuple[EpisodeResult, dict[str, Any]]:
    """Run one episode in this process (no sandbox); its result and result.json."""
    out = tmp_path / "ep"
    spec = EpisodeSpec(run_id="r", episode="r-t-a-1", task=Task("t", "p", verify, timeout_s=timeout_s),
                       adapter=Adapter("a", ("bash", "-c", agent)), attempt=1, proxy_url=proxy.url, out_dir=str(out),
                       workdir=str(out / "work"), home=str(out / "home"), on_failure=policies(on_failure))
    result = run_episode(spec, Secrets(spec.episode, None, {}))
    return result, json.loads((out / "result.json").read_text())


def test_a_verifier_that_prints_then_crashes_is_verify_failed_with_its_exit_code_and_stderr(
        tmp_path: Path, fake_proxy: FakeProxy) -> None:
    result, saved = episode(tmp_path, fake_proxy, "true", "echo 0.7; echo 'Traceback: boom' >&2; exit 3")
    assert (result.status, result.reward, result.failure_class) == ("verify_failed", None, "verifier")
    assert "exited 3 after printing" in result.reason
    assert saved["verify_exit_code"] == 3 and "Traceback: boom" in saved["verify_stderr"]
    assert fake_proxy.rewards == []  # the verifier class is dropped by default


def test_command_not_found_is_verify_failed_and_zero_only_when_asked(tmp_path: Path, fake_proxy: FakeProxy) -> None:
    result, saved = episode(tmp_path, fake_proxy, "true", "no-such-grader", on_failure="zero")
    assert (result.status, result.reward, saved["verify_exit_code"]) == ("verify_failed", None, 127)
    assert "command not found" in saved["verify_stderr"]
    assert [r["reward"] for r in fake_proxy.rewards] == [0.0] and result.reward_posted


def test_a_passing_verifier_records_its_exit_code(tmp_path: Path, fake_proxy: FakeProxy) -> None:
    result, saved = episode(tmp_path, fake_proxy, "true", "echo 0.25")
    assert (result.status, result.reward, result.failure_class, saved["verify_exit_code"]) == ("ok", 0.25, None, 0)
    assert [r["reward"] for r in fake_proxy.rewards] == [0.25]


# --- failure classes and their policies ---------------------------------------------------------------------

def test_policies_take_one_value_for_all_or_one_per_class() -> None:
    assert DEFAULT_POLICY == {"agent": "zero", "timeout": "drop", "verifier": "drop", "engine": "drop",
                              "infra": "drop"}
    assert policies("zero") == dict.fromkeys(DEFAULT_POLICY, "zero")
    assert policies({"timeout": "zero"}) == {**DEFAULT_POLICY, "timeout": "zero"}
    assert policies("agent=drop, timeout=zero") == {**DEFAULT_POLICY, "agent": "drop", "timeout": "zero"}
    for bad, why in (("ignore", "not one of"), ({"agnet": "zero"}, "unknown failure class 'agnet'"),
                     ({"agent": "maybe"}, "agent: 'maybe'")):
        with pytest.raises(ValueError, match=why):
            policies(bad)
    with pytest.raises(RolloutError, match="on_failure"):
        prepare([Task("a", "p", "v")], ["tool-agent"], proxy="http://127.0.0.1:9", out=Path("/nonexistent"),
                on_failure="sometimes", sandbox="none")


def test_an_agent_failure_scores_zero_and_a_timeout_without_answers_is_infrastructure(
        tmp_path: Path, fake_proxy: FakeProxy) -> None:
    fake_proxy.calls = {"calls": 2, "statuses": {"200": 2}, "errors": []}
    failed, _ = episode(tmp_path / "a", fake_proxy, "exit 4", "echo 1")
    assert (failed.status, failed.failure_class, failed.reward_posted) == ("agent_failed", "agent", True)
    slow, _ = episode(tmp_path / "b", fake_proxy, "sleep 30", "echo 1", timeout_s=1)
    assert (slow.status, slow.failure_class, slow.reward_posted) == ("timeout", "timeout", False)
    fake_proxy.calls = {"calls": 1, "statuses": {"none": 1}, "errors": []}  # killed waiting for its first answer
    starved, saved = episode(tmp_path / "c", fake_proxy, "sleep 30", "echo 1", timeout_s=1)
    assert (starved.status, starved.failure_class, starved.reward_posted) == ("timeout", "infra", False)
    assert saved["calls"] == {"none": 1} and "no call of it was answered" in starved.reason
    assert [r["reward"] for r in fake_proxy.rewards] == [0.0]  # the agent failure only


def test_an_engine_error_answer_is_engine_error_but_a_malformed_tool_call_is_the_agents(
        tmp_path: Path, fake_proxy: FakeProxy) -> None:
    fake_proxy.calls = {"calls": 3, "statuses": {"200": 2, "502": 1},
                        "errors": [{"status": 502, "message": "OpenForge: upstream 127.0.0.1:1 failed: refused"}]}
    down, _ = episode(tmp_path / "a", fake_proxy, "exit 0", "echo 1")
    assert (down.status, down.failure_class, down.reward, down.reward_posted) == ("engine_error", "engine", None, False)
    assert "502" in down.reason and "upstream 127.0.0.1:1 failed" in down.reason
    fake_proxy.calls = {"calls": 1, "statuses": {"500": 1}, "errors": [
        {"status": 500, "message": "Failed to parse tool call arguments as JSON: [json.exception.parse_error.101]"}]}
    malformed, _ = episode(tmp_path / "b", fake_proxy, "exit 1", "echo 1")
    assert (malformed.status, malformed.failure_class, malformed.reward_posted) == ("agent_failed", "agent", True)
    assert "could not parse the model's output" in malformed.reason


def r(task: str, attempt: int, status: str, reward: float | None, cls: str | None = None) -> EpisodeResult:
    return EpisodeResult("e", task, "x", attempt, status, reward, failure_class=cls, agent_s=1.0)


def test_the_summary_counts_failure_classes_and_leaves_dropped_ones_out_of_the_mean() -> None:
    results = [r("a", 1, "ok", 1.0), r("a", 2, "agent_failed", None, "agent"), r("a", 3, "timeout", None, "infra"),
               r("a", 4, "engine_error", None, "engine"), r("b", 1, "verify_failed", None, "verifier"),
               r("b", 2, "crashed", None)]  # an old result: its class from its status
    s = summarize(results, run_id="r", attempts=4, pass_threshold=1.0, on_failure=policies("default"), wall_s=1.0)
    assert s["overall"]["failure_classes"] == {"agent": 1, "engine": 1, "infra": 2, "verifier": 1}
    assert s["tasks"]["a"]["mean_reward"] == 0.5  # 1.0 and the agent's 0.0; infra and engine dropped
    assert s["tasks"]["b"]["mean_reward"] is None and s["on_failure"] == DEFAULT_POLICY
    assert [classify(x) for x in results] == [None, "agent", "infra", "engine", "verifier", "infra"]


# --- through a real proxy ------------------------------------------------------------------------------------

class FailingEngine(ToolchainEngine):
    """Answers 500 when the prompt says so: as an engine that fails, or as llama.cpp when the model's tool
    call is not JSON."""

    def _chat(self, h: Any, body: dict[str, Any]) -> None:
        prompt = " ".join(content_text(m.get("content")) for m in body.get("messages") or [])
        if "ENGINE-DOWN" in prompt:
            return self._error(h, 500, "CUDA error: an illegal memory access was encountered", "server_error")
        if "BAD-JSON" in prompt:
            return self._error(h, 500, "Failed to parse tool call arguments as JSON: [json.exception.parse_error.101] "
                                       "parse error at line 1, column 9", "server_error")
        super()._chat(h, body)


AGENT = r'''
import json, os, sys, urllib.request, urllib.error
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
req = urllib.request.Request(os.environ["MY_BASE_URL"] + "/v1/chat/completions", json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": sys.argv[1]}]}).encode(),
    {"content-type": "application/json", "authorization": "Bearer " + os.environ["MY_KEY"]}, method="POST")
try:
    with opener.open(req, timeout=60) as r:
        open("reply.txt", "w").write(json.load(r)["choices"][0]["message"]["content"])
except urllib.error.HTTPError as e:
    print(e.code, e.read()[:300], file=sys.stderr)
    sys.exit(1)
'''

ADAPTER = '''
command = ["{python}", "{workdir}/../../../agent.py", "{prompt}"]
[env]
MY_BASE_URL = "{base_url}"
MY_KEY = "{api_key}"
'''


@pytest.fixture
def proxy(qwen_tok: Any, start_proxy: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("OPENFORGE_CLIENT_TOKEN", CLIENT)
    monkeypatch.setenv("OPENFORGE_REWARD_TOKEN", REWARD)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    with FailingEngine(tokenizer=qwen_tok, profile="vllm") as engine:
        yield start_proxy(engine.url, "openforge_engine_profile=vllm", f"openforge_client_tokens={CLIENT}",
                          f"openforge_reward_tokens={REWARD}")


def test_engine_errors_seen_by_the_proxy_are_dropped_and_the_models_malformed_call_scores_zero(
        proxy: Any, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "agent.py").write_text(AGENT)
    (tmp_path / "my-cli.toml").write_text(ADAPTER)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": i, "prompt": p, "verify": "test -s reply.txt"}) + "\n" for i, p in
                             (("down", "ENGINE-DOWN please"), ("badjson", "BAD-JSON please"), ("fine", "hello"))))
    rollout = run(tasks, [f"custom:{tmp_path / 'my-cli.toml'}"], proxy=proxy.url, out=tmp_path / "out",
                  concurrency=3, sandbox="none")
    got = {x.task_id: x for x in rollout.results}
    assert (got["down"].status, got["down"].failure_class, got["down"].reward_posted) == ("engine_error", "engine",
                                                                                          False)
    assert "CUDA error" in got["down"].reason and got["down"].calls == {"500": 1}
    assert (got["badjson"].status, got["badjson"].failure_class, got["badjson"].reward_posted) == (
        "agent_failed", "agent", True)
    assert (got["fine"].status, got["fine"].reward, got["fine"].calls) == ("ok", 1.0, {"200": 1})
    overall = rollout.summary["overall"]
    assert overall["failure_classes"] == {"agent": 1, "engine": 1} and overall["mean_reward"] == 0.5
    # the endpoint the episode asked: the reward token (or the episode's key) reads it, an agent's token does not
    episode = got["down"].episode
    with pytest.raises(ControlError) as refused:
        ControlClient(proxy.url, CLIENT).calls(episode)
    assert refused.value.status == 403
    body = ControlClient(proxy.url, REWARD).calls(episode)
    assert body["statuses"] == {"500": 1} and "CUDA error" in body["errors"][0]["message"]


def test_rollout_refuses_to_start_when_the_proxy_does_not_answer(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"id": "t", "prompt": "What is 1 + 1?", "verify": "true"}) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")}
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "rollout", "--tasks", str(tasks), "--toolchain",
                           "tool-agent", "--proxy", "http://127.0.0.1:9", "--out", str(tmp_path / "out"),
                           "--no-sandbox"], cwd=tmp_path, text=True, capture_output=True, timeout=120,
                          env={**env, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: the proxy at http://127.0.0.1:9 does not answer"), done.stderr
    assert len(done.stderr.splitlines()) == 1 and not (tmp_path / "out" / "episodes").exists()


def test_rl_config_takes_on_failure_as_one_value_or_a_table_and_writes_it_back(tmp_path: Path) -> None:
    from openforge.rl.config import load_rl_config
    from openforge.settings import ConfigError

    assert load_rl_config().rollout.on_failure == DEFAULT_POLICY
    assert load_rl_config(sets={"rollout.on_failure": "zero"}).rollout.on_failure == dict.fromkeys(DEFAULT_POLICY,
                                                                                                   "zero")
    (tmp_path / "rl.toml").write_text('[rollout]\non_failure = {timeout = "zero"}\n')
    cfg = load_rl_config(tmp_path / "rl.toml")
    assert cfg.rollout.on_failure == {**DEFAULT_POLICY, "timeout": "zero"}
    (tmp_path / "back.toml").write_text(cfg.to_toml())
    assert load_rl_config(tmp_path / "back.toml").rollout.on_failure == cfg.rollout.on_failure
    with pytest.raises(ConfigError, match="rollout.on_failure: unknown failure class 'slow'"):
        load_rl_config(sets={"rollout.on_failure": "slow=drop"})
