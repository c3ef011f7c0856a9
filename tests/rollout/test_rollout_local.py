"""`openforge rollout` end to end on this machine: real episode processes through a real proxy (reward and
client tokens set) in front of the scripted engine; rewards reach DuckDB through reconstruct.

Agents: the example agent (built-in `tool-agent` adapter) and a tiny Python CLI driven by a custom adapter
TOML, which also reports what an agent can see (its environment, a reward post with its own key) and
misbehaves on request (sleeps past the timeout with a child in its group, crashes)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest

from openforge.protocols.client_keys import episode_client_key
from openforge.reconstruct import reconstruct
from openforge.rollout import run
from openforge.rollout.runner import Rollout
from openforge.testing import ROOT
from openforge.testing.toolchain_engine import ToolchainEngine

CLIENT = "client-token-rollout-0123456789"
REWARD = "reward-token-rollout-0123456789"

# A CLI without a built-in adapter: one chat call through the proxy, then whatever its prompt says.
AGENT = r'''
import json, os, subprocess, sys, time, urllib.request, urllib.error
prompt, base_url, key = sys.argv[1], os.environ["MY_BASE_URL"], os.environ["MY_KEY"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def post(url, body, token):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json",
                                 "authorization": f"Bearer {token}"}, method="POST")
    try:
        with opener.open(req, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, None
status, answer = post(base_url + "/v1/chat/completions",
                      {"model": "m", "messages": [{"role": "user", "content": prompt}]}, key)
open("reply.txt", "w").write(answer["choices"][0]["message"]["content"])
json.dump(dict(os.environ), open("env.json", "w"))
json.dump({"argv": sys.argv[1:], "config": open(os.path.join(os.environ["HOME"], "cfg", "settings.json")).read()},
          open("seen.json", "w"))
proxy = base_url.split("/e/")[0]
hack, _ = post(proxy + "/openforge/v1/episodes/" + base_url.split("/e/")[1] + "/reward", {"reward": 1.0}, key)
open("hack.txt", "w").write(str(hack))
call = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}  # as a sibling episode, as the validator
sibling, _ = post(base_url + "-sibling/v1/chat/completions", call, key)
validator, _ = post(proxy + "/r/validator/e/" + base_url.split("/e/")[1] + "/v1/chat/completions", call, key)
open("scope.txt", "w").write(f"{sibling} {validator}")
if prompt == "crash":
    sys.exit(3)
if prompt == "sleep":
    child = subprocess.Popen(["sleep", "600.3131"])
    time.sleep(600)
'''

ADAPTER = '''
command = ["{python}", "{workdir}/../../../agent.py", "{prompt}"]
[env]
MY_BASE_URL = "{base_url}"
MY_KEY = "{api_key}"
[config_files]
"cfg/settings.json" = '{"episode": "{episode}", "keep": {"braces": true}}'
'''


@pytest.fixture
def engine(qwen_tok: Any) -> Iterator[ToolchainEngine]:
    with ToolchainEngine(tokenizer=qwen_tok, profile="vllm") as eng:
        yield eng


@pytest.fixture
def proxy(engine: ToolchainEngine, start_proxy: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("OPENFORGE_CLIENT_TOKEN", CLIENT)
    monkeypatch.setenv("OPENFORGE_REWARD_TOKEN", REWARD)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the agent and episode processes import this checkout
    return start_proxy(engine.url, "openforge_engine_profile=vllm", f"openforge_client_tokens={CLIENT}",
                       f"openforge_reward_tokens={REWARD}")


def tasks_file(path: Path, *tasks: dict[str, Any]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def custom_adapter(tmp_path: Path) -> str:
    (tmp_path / "out").mkdir(exist_ok=True)
    (tmp_path / "out" / "agent.py").write_text(AGENT)  # {workdir}/../../../ is out/
    (tmp_path / "my-cli.toml").write_text(ADAPTER)
    return f"custom:{tmp_path / 'my-cli.toml'}"


def db_episodes(proxy: Any, tmp_path: Path, retok: Any, **kwargs: Any) -> dict[str, tuple[str, float]]:
    proxy.stop()  # every record on disk
    reconstruct(proxy.flow_files(), tmp_path / "db.duckdb", retok, **kwargs)
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    try:
        return {e: (t, r) for e, t, r in con.execute("SELECT episode_id, task_id, reward FROM episodes").fetchall()}
    finally:
        con.close()


def running_with(argv: bytes) -> list[str]:
    """Processes (pids) whose command line holds `argv` (arguments joined by NUL)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if argv in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:  # exited meanwhile
            pass
    return found


def by_task(rollout: Rollout) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for r in rollout.results:
        out.setdefault(r.task_id, []).append(r)
    return out


def test_example_agent_two_tasks_two_attempts_rewards_reach_duckdb(proxy: Any, tmp_path: Path, retok: Any) -> None:
    tasks = tasks_file(tmp_path / "tasks.jsonl",
                       {"id": "answers", "prompt": "What is 17 + 25?", "verify": "test -s answer.txt"},
                       {"id": "half", "prompt": "What is 2 + 2?", "files": {"data/in.txt": "x"},
                        "setup": "cp data/in.txt copied.txt", "verify": "test -f copied.txt && echo 0.5"})
    rollout = run(tasks, ["tool-agent"], proxy=proxy.url, out=tmp_path / "out", attempts=2, concurrency=2)
    results = by_task(rollout)
    assert [(r.status, r.reward, r.reward_posted) for r in results["answers"]] == [("ok", 1.0, True)] * 2, results
    assert [(r.status, r.reward, r.reward_posted) for r in results["half"]] == [("ok", 0.5, True)] * 2, results
    assert len({r.episode for r in rollout.results}) == 4
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert s["tasks"]["answers"]["pass_at_k"] == s["tasks"]["answers"]["pass_all_k"] == 1.0
    assert s["tasks"]["half"]["pass_at_k"] == 0.0 and s["tasks"]["half"]["mean_reward"] == 0.5
    assert s["toolchains"]["tool-agent"]["episodes"] == 4 and s["overall"]["mean_reward"] == 0.75
    assert len((tmp_path / "out" / "results.jsonl").read_text().splitlines()) == 4
    # each episode's calls are recorded under its id and the verifier's reward and task id reach DuckDB
    episodes = db_episodes(proxy, tmp_path, retok)
    assert episodes == {r.episode: (r.task_id, r.reward) for r in rollout.results}


def test_custom_adapter_cli_sees_no_reward_token_and_cannot_grade_itself(proxy: Any, tmp_path: Path,
                                                                        retok: Any) -> None:
    toolchain = custom_adapter(tmp_path)
    verify = "test -s reply.txt && echo 0.75"
    tasks = tasks_file(tmp_path / "tasks.jsonl", {"id": "t1", "prompt": "say hi", "verify": verify},
                       {"id": "t2", "prompt": "say bye", "verify": verify})
    rollout = run(tasks, [toolchain], proxy=proxy.url, out=tmp_path / "out", attempts=2, concurrency=2,
                  fresh_verify_copy=True)
    assert [(r.toolchain, r.status, r.reward) for r in rollout.results] == [("my-cli", "ok", 0.75)] * 4, rollout.results
    for r in rollout.results:
        ep = tmp_path / "out" / "episodes" / r.episode
        env = json.loads((ep / "work" / "env.json").read_text())
        assert REWARD not in json.dumps(env) and env["HOME"] == str(ep / "home")
        # its key is its episode's own, never the run's client token
        assert env["MY_KEY"] == episode_client_key(CLIENT, r.episode) and CLIENT not in json.dumps(env)
        assert not any(k.startswith("OPENFORGE_") for k in env)  # nothing of ours, the tokens least of all
        assert (ep / "work" / "hack.txt").read_text() == "403"  # its own key may not post a reward
        assert (ep / "work" / "scope.txt").read_text() == "403 403"  # nor call as another episode or role
        seen = json.loads((ep / "work" / "seen.json").read_text())
        assert seen["argv"] == [{"t1": "say hi", "t2": "say bye"}[r.task_id]]
        assert json.loads(seen["config"]) == {"episode": r.episode, "keep": {"braces": True}}
        assert (ep / "work.verify" / "reply.txt").exists()  # verified in the fresh copy
    assert db_episodes(proxy, tmp_path, retok) == {r.episode: (r.task_id, 0.75) for r in rollout.results}


def test_an_agent_planned_under_a_role_holds_a_key_for_that_role(proxy: Any, tmp_path: Path) -> None:
    """`openforge tasks synth`'s validator: its episodes' calls go as role validator, and their keys open it."""
    tasks = tasks_file(tmp_path / "tasks.jsonl", {"id": "t1", "prompt": "say hi", "verify": "test -s reply.txt"})
    rollout = run(tasks, [custom_adapter(tmp_path)], proxy=proxy.url, out=tmp_path / "out", role="validator")
    (r,) = rollout.results
    assert (r.status, r.reward) == ("ok", 1.0), r
    work = tmp_path / "out" / "episodes" / r.episode / "work"
    assert json.loads((work / "env.json").read_text())["MY_KEY"] == episode_client_key(CLIENT, r.episode, "validator")
    assert (work / "scope.txt").read_text() == "403 200"  # a sibling episode no, its own role yes


def test_timeout_crash_and_garbage_verifier_are_recorded_and_rewarded_zero(proxy: Any, tmp_path: Path,
                                                                          retok: Any) -> None:
    toolchain = custom_adapter(tmp_path)
    tasks = tasks_file(tmp_path / "tasks.jsonl",
                       {"id": "sleepy", "prompt": "sleep", "verify": "echo 1", "timeout_s": 8},
                       {"id": "crashy", "prompt": "crash", "verify": "echo 1"},
                       {"id": "garbage", "prompt": "ok", "verify": "echo NaN"},
                       {"id": "chatty", "prompt": "ok", "verify": "echo 1; echo all tests passed"},
                       {"id": "badsetup", "prompt": "ok", "setup": "exit 7", "verify": "echo 1"})
    rollout = run(tasks, [toolchain], proxy=proxy.url, out=tmp_path / "out", concurrency=3, on_failure="zero")
    r = {x.task_id: x for x in rollout.results}
    assert (r["sleepy"].status, r["sleepy"].exit_code) == ("timeout", None) and "killed after 8 s" in r["sleepy"].reason
    assert (r["crashy"].status, r["crashy"].exit_code) == ("agent_failed", 3)
    assert r["garbage"].status == "verify_failed" and "'NaN' is not a finite number" in r["garbage"].reason
    assert r["chatty"].status == "verify_failed" and "'all tests passed' is not a number" in r["chatty"].reason
    assert r["badsetup"].status == "crashed" and "setup exited 7" in r["badsetup"].reason
    assert all(x.reward is None and x.reward_posted for x in rollout.results)  # 0.0 posted for each
    # the sleeping agent and the child it started were killed together
    assert not running_with(b"sleep\x00600.3131")
    s = rollout.summary["overall"]
    assert s["failures"] == {"agent_failed": 1, "crashed": 1, "timeout": 1, "verify_failed": 2}
    assert s["mean_reward"] == 0
    # every episode that made a call is in DuckDB with reward 0.0 (badsetup never started its agent)
    episodes = db_episodes(proxy, tmp_path, retok)
    assert episodes == {x.episode: (x.task_id, 0.0) for x in rollout.results if x.task_id != "badsetup"}


def test_on_failure_drop_posts_nothing_and_reconstruct_drops_the_episode(proxy: Any, tmp_path: Path,
                                                                        retok: Any) -> None:
    toolchain = custom_adapter(tmp_path)
    tasks = tasks_file(tmp_path / "tasks.jsonl", {"id": "crashy", "prompt": "crash", "verify": "echo 1"},
                       {"id": "fine", "prompt": "ok", "verify": "echo 0.25"})
    rollout = run(tasks, [toolchain], proxy=proxy.url, out=tmp_path / "out", attempts=2, on_failure="drop")
    r = by_task(rollout)
    assert [(x.status, x.reward_posted) for x in r["crashy"]] == [("agent_failed", False)] * 2
    assert [(x.status, x.reward, x.reward_posted) for x in r["fine"]] == [("ok", 0.25, True)] * 2
    assert rollout.summary["tasks"]["crashy"]["mean_reward"] is None  # dropped, not counted as 0
    episodes = db_episodes(proxy, tmp_path, retok, missing_reward="drop")
    assert episodes == {x.episode: ("fine", 0.25) for x in r["fine"]}


def test_cli_prints_the_summary_tables(proxy: Any, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from openforge.cli import app

    tasks = tasks_file(tmp_path / "tasks.jsonl", {"id": "t1", "prompt": "What is 1 + 1?", "verify": "true"})
    done = CliRunner().invoke(app, ["rollout", "--tasks", str(tasks), "--toolchain", "tool-agent", "--attempts", "2",
                                    "--proxy", proxy.url, "--out", str(tmp_path / "out")],
                              env={**os.environ, "COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    assert "per task" in done.output and "pass@2" in done.output and "pass^2" in done.output
    assert "2 rewards posted" in done.output


@pytest.mark.slow
def test_example_agent_against_the_embedded_engine(start_proxy: Any, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same rollout against the real embedded engine (llama.cpp serving SmolLM2-135M) instead of a
    scripted one. Every episode ends with a posted reward: `ok` with the verifier's (right answer 1.0, else
    0.0), or `agent_failed` with 0.0 (a sampled tool call that is not JSON makes llama.cpp answer 500 and
    the agent exit 1); the rewards and the engine's own token ids reach DuckDB through reconstruct."""
    from openforge.engines.llamacpp import EmbeddedEngine
    from openforge.models import load_gguf_tokenizer

    monkeypatch.setenv("OPENFORGE_CLIENT_TOKEN", CLIENT)
    monkeypatch.setenv("OPENFORGE_REWARD_TOKEN", REWARD)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    tasks = tasks_file(tmp_path / "tasks.jsonl",
                       *({"id": t, "prompt": q, "verify": f"grep -q {a} answer.txt"}
                         for t, q, a in (("add", "What is 17 + 25?", 42), ("mul", "What is 12 * 7?", 84))))
    with EmbeddedEngine(threads=1, log_path=tmp_path / "engine.log") as engine:
        proxy = start_proxy(engine.url, f"openforge_client_tokens={CLIENT}", f"openforge_reward_tokens={REWARD}")
        rollout = run(tasks, ["tool-agent"], proxy=proxy.url, out=tmp_path / "out", attempts=2, concurrency=2)
        assert len(rollout.results) == 4 and all(r.reward_posted for r in rollout.results), rollout.results
        assert {(r.status, r.reward) for r in rollout.results} <= {("ok", 0.0), ("ok", 1.0), ("agent_failed", None)}
        proxy.stop()
    summary = reconstruct(proxy.flow_files(), tmp_path / "db.duckdb", load_gguf_tokenizer())
    # llama.cpp's completion ids and the prompt ids the proxy asked it for; a completion ending mid-character
    # has no ids (retokenized)
    assert summary.calls_engine_ids > 0 and summary.calls_mixed == 0 and summary.calls_prompt_mismatch == 0, summary
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    try:
        rows = con.execute("SELECT episode_id, task_id, reward FROM episodes").fetchall()
    finally:
        con.close()
    got = {e: (t, r) for e, t, r in rows}  # an episode whose every call failed (500) has no calls to train on
    assert got.items() <= {r.episode: (r.task_id, r.reward or 0.0) for r in rollout.results}.items()
    assert {r.episode for r in rollout.results if r.status == "ok"} <= got.keys()
