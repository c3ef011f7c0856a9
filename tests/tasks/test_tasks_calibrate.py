"""`openforge tasks calibrate` through a real proxy in front of the scripted engine, with a scripted agent whose
success is known per attempt: pass rates, the band filter, the metadata written, and failures that are not
the policy's left out; and `openforge rl`'s re-calibration with the same band logic (stub stages, no engine).

The agent (a custom adapter) makes one call through the proxy, then reads its prompt `pass 1,3` (or
`crash 2`) and its episode id (which ends in the attempt number): it writes `ok` on the attempts listed, or
exits 3 (the agent's own failure) on the one named."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from openforge.cli import app
from openforge.rl.config import load_rl_config
from openforge.rl.errors import RLError
from openforge.rl.loop import RLRun
from openforge.rollout.runner import Rollout, write_rollout
from openforge.rollout.spec import EpisodeResult
from openforge.settings import ConfigError
from openforge.taskforge.calibrate import KEPT, TOO_EASY, TOO_HARD, UNMEASURED, parse_band, pass_rates, verdict
from openforge.testing import ROOT
from openforge.testing.toolchain_engine import ToolchainEngine

CLIENT = "client-token-calibrate-0123456789"
REWARD = "reward-token-calibrate-0123456789"

AGENT = r'''
import json, os, sys, urllib.request
prompt, base_url, key, episode = sys.argv[1], os.environ["MY_BASE_URL"], os.environ["MY_KEY"], os.environ["MY_EP"]
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
req = urllib.request.Request(base_url + "/v1/chat/completions", json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode(),
    {"content-type": "application/json", "authorization": f"Bearer {key}"}, method="POST")
opener.open(req, timeout=60).read()
what, attempts = prompt.split()
attempt = episode.rsplit("-", 1)[1]
if what == "crash" and attempt in attempts.split(","):
    sys.exit(3)
open("answer.txt", "w").write("ok" if what != "pass" or attempt in attempts.split(",") else "no")
'''

ADAPTER = '''
command = ["{python}", "{workdir}/../../../../agent.py", "{prompt}"]
[env]
MY_BASE_URL = "{base_url}"
MY_KEY = "{api_key}"
MY_EP = "{episode}"
'''

VERIFY = 'test "$(cat answer.txt)" = ok'
INFRA_ON_FIRST = 'case "$PWD" in *-1/work) exit 7;; esac'  # setup fails on attempt 1: a `crashed` (infra) episode

TASKS = [  # 4 attempts each
    {"id": "easy", "prompt": "pass 1,2,3,4", "verify": VERIFY, "metadata": {"source": "mutate"}},  # 1.0
    {"id": "hard", "prompt": "pass none", "verify": VERIFY},  # 0.0
    {"id": "half", "prompt": "pass 1,2", "verify": VERIFY, "solution": "echo ok > answer.txt"},  # 0.5
    {"id": "infra", "prompt": "pass 2", "verify": VERIFY, "setup": INFRA_ON_FIRST},  # 1 of 3 counted: 0.33
    {"id": "agentfail", "prompt": "crash 1", "verify": VERIFY},  # attempt 1 scores 0: 3 of 4
    {"id": "broken", "prompt": "pass 1,2,3,4", "verify": VERIFY, "setup": "exit 7"},  # nothing counted
]


@pytest.fixture
def proxy(qwen_tok: Any, start_proxy: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("OPENFORGE_CLIENT_TOKEN", CLIENT)
    monkeypatch.setenv("OPENFORGE_REWARD_TOKEN", REWARD)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the agent and episode processes import this checkout
    with ToolchainEngine(tokenizer=qwen_tok, profile="vllm") as engine:
        yield start_proxy(engine.url, "openforge_engine_profile=vllm", f"openforge_client_tokens={CLIENT}",
                          f"openforge_reward_tokens={REWARD}", "openforge_policy_version=3")


def write_tasks(path: Path, tasks: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["tasks", "calibrate", *args], env={**os.environ, "COLUMNS": "200"})


def test_pass_rates_band_filter_and_metadata_through_the_proxy(proxy: Any, tmp_path: Path) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", TASKS)
    (tmp_path / "agent.py").write_text(AGENT)  # {workdir}/../../../../ is tmp_path (OUT.rollout/episodes/EP/work)
    (tmp_path / "scripted.toml").write_text(ADAPTER)
    out = tmp_path / "calibrated.jsonl"
    done = invoke(str(tasks), "--proxy", proxy.url, "--toolchain", f"custom:{tmp_path / 'scripted.toml'}",
                  "--attempts", "4", "--band", "0.25,0.75", "--concurrency", "3", "--out", str(out))
    assert done.exit_code == 0, done.output
    figures = json.loads((tmp_path / "calibrated.jsonl.rollout" / "calibration.json").read_text())
    got = {t["task_id"]: (t["episodes"], t["attempts"], t["pass_rate"], t["verdict"]) for t in figures["tasks"]}
    assert got == {
        "easy": (4, 4, 1.0, TOO_EASY), "hard": (4, 4, 0.0, TOO_HARD), "half": (4, 4, 0.5, KEPT),
        "infra": (4, 3, 0.333333, KEPT),  # the infra failure is not an attempt
        "agentfail": (4, 4, 0.75, KEPT),  # the agent's own failure is a failed attempt; 0.75 = HI is inside
        "broken": (4, 0, None, UNMEASURED),
    }, got
    assert figures["calibrated_at_policy"] == 3
    written = [json.loads(x) for x in out.read_text().splitlines()]
    assert [t["id"] for t in written] == ["half", "infra", "agentfail"]  # file order, the band's only
    assert written[0]["metadata"] == {"pass_rate": 0.5, "mean_reward": 0.5, "attempts": 4, "calibrated_at_policy": 3}
    assert written[0]["solution"] == "echo ok > answer.txt"  # every other field as it was
    assert written[1]["metadata"]["mean_reward"] == 0.333333 and written[1]["setup"] == INFRA_ON_FIRST
    assert "calibration (band 0.25..0.75, policy version 3)" in done.output
    assert "3 of 6 tasks in the band 0.25..0.75 written to" in done.output
    for task_id in ("easy", "hard", "broken"):  # the others are listed with their pass rate
        assert task_id in done.output
    assert "too easy" in done.output and "no attempt counted" in done.output
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize(("args", "message"), [
    (["--band", "0.9,0.1"], "--band: the band needs 0 <= LO <= HI <= 1, not 0.9,0.1"),
    (["--band", "half"], "--band: the band is two pass rates LO,HI"),
    (["--attempts", "0"], "--attempts must be >= 1, not 0"),
    (["--tasks-missing"], "no such task file"),
    (["--proxy-ftp"], "--proxy must be the proxy's http(s) URL"),
    (["--out-nowhere"], "--out: no such directory"),
])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    tasks = write_tasks(tmp_path / "tasks.jsonl", TASKS[:1])
    proxy = "ftp://x" if args == ["--proxy-ftp"] else "http://127.0.0.1:9"
    path = tmp_path / "missing.jsonl" if args == ["--tasks-missing"] else tasks
    out = tmp_path / "nowhere" / "o.jsonl" if args == ["--out-nowhere"] else tmp_path / "o.jsonl"
    extra = [] if args[0] in ("--tasks-missing", "--proxy-ftp", "--out-nowhere") else args
    done = invoke(str(path), "--proxy", proxy, "--toolchain", "tool-agent", "--out", str(out), *extra)
    assert done.exit_code == 2, done.output
    assert message in done.output and "Traceback" not in done.output, done.output
    assert not (tmp_path / "o.jsonl").exists()


def result(task: str, attempt: int, status: str, reward: float | None) -> EpisodeResult:
    return EpisodeResult(episode=f"r-{task}-a-{attempt}", task_id=task, toolchain="a", attempt=attempt,
                         status=status, reward=reward)


def test_pass_rates_count_only_the_policys_attempts_and_the_band_is_inclusive() -> None:
    results = [result("t", 1, "ok", 1.0), result("t", 2, "ok", 0.5), result("t", 3, "timeout", None),
               result("t", 4, "agent_failed", None), result("u", 1, "engine_error", None)]
    rates = pass_rates(results, 1.0, "default")
    assert (rates["t"].episodes, rates["t"].attempts, rates["t"].passed) == (4, 3, 1)
    assert rates["t"].pass_rate == 0.333333 and rates["t"].mean_reward == 0.5
    assert rates["u"].pass_rate is None
    assert pass_rates(results, 0.5, "zero")["t"].pass_rate == 0.5  # every failure scored: 2 of 4
    assert [verdict(x, (0.25, 0.75)) for x in (0.25, 0.75, 0.2, 0.8, None)] == \
        [KEPT, KEPT, TOO_HARD, TOO_EASY, UNMEASURED]
    assert parse_band([0, 1]) == (0.0, 1.0) and parse_band(" 0.1 , 0.9") == (0.1, 0.9)
    for bad in ("0.1", "a,b", "0.1,0.9,1", "-0.1,0.5", "0.5,nan", [True, 1]):
        with pytest.raises(ValueError):
            parse_band(bad)


# --- re-calibration in `openforge rl` -----------------------------------------------------------------------

class Recalibrated(RLRun):
    """The loop's stage machine on three tasks, with a rollout stage that writes the results `passes` says
    ({task: attempts passed of 4}, per iteration) for the tasks the loop gives it, and no engine, proxy or
    model; `stop_at` interrupts that iteration's rollout as Ctrl-C would."""

    def __init__(self, out: Path, passes: list[dict[str, int]], ran: list[list[str]], sets: dict[str, str],
                 resume: bool = False, stop_at: int | None = None) -> None:
        tasks = write_tasks(out.parent / "tasks.jsonl", [{"id": t, "prompt": "p", "verify": "true"} for t in "abc"])
        cfg = load_rl_config(sets={"rollout.tasks": str(tasks), "loop.iterations": "4", **sets})
        super().__init__(cfg, out, Console(file=io.StringIO()), resume)
        self.passes, self.ran, self.stop_at = passes, ran, stop_at
        for stage in ("reconstruct", "train"):
            setattr(self, stage, lambda i: None)

    def publish(self, i: int) -> None:
        self.state.version = i + 1

    def rollout(self, i: int) -> None:
        if i == self.stop_at:
            raise KeyboardInterrupt
        self.ran.append([t.id for t in self.tasks])
        results = [result(t.id, k, "ok", float(k <= self.passes[i][t.id])) for t in self.tasks for k in range(1, 5)]
        self.rollout_dir(i).mkdir(parents=True, exist_ok=True)
        write_rollout(Rollout("r", self.rollout_dir(i), results, {"run_id": "r"}))

    @contextlib.contextmanager
    def services(self) -> Iterator[None]:
        yield

    def summary_line(self, i: int) -> dict[str, Any]:
        return {"iteration": i, "policy_version": i, "reward_mean": None, "pass_at_k": None, "samples": 0,
                "attempts": 4, "toolchains": {}}


def test_rl_drops_the_tasks_that_left_the_band_every_n_iterations_and_remembers_across_resume(
        tmp_path: Path) -> None:
    passes = [{"a": 4, "b": 2, "c": 0}, {"a": 4, "b": 2, "c": 1}, {"b": 4, "c": 1}, {"b": 4, "c": 1}]
    sets = {"tasks.recalibrate_every": "2", "tasks.band": "0.25,0.75"}
    ran: list[list[str]] = []
    with pytest.raises(KeyboardInterrupt):  # in iteration 3, after the re-calibration of iteration 2
        Recalibrated(tmp_path / "run", passes, ran, sets, stop_at=2).run()
    Recalibrated(tmp_path / "run", passes, ran, sets, resume=True).run()
    # c at 0.0 in iteration 1 is not looked at (only every 2nd); after iteration 2, a (1.0) goes, c (0.25) stays;
    # after iteration 4, the last, nothing is re-calibrated (no iteration follows)
    assert ran == [["a", "b", "c"], ["a", "b", "c"], ["b", "c"], ["b", "c"]]
    lines = [json.loads(x) for x in (tmp_path / "run" / "rl.jsonl").read_text().splitlines()]
    assert [x.get("recalibrated") for x in lines] == [None, {
        "band": [0.25, 0.75], "dropped": {"a": "too easy: pass rate 1.00 of 4 attempts"}, "tasks_left": 2},
        None, None]
    state = json.loads((tmp_path / "run" / "state.json").read_text())
    assert state["dropped"] == {"a": "too easy: pass rate 1.00 of 4 attempts"}


def test_rl_never_drops_the_last_task(tmp_path: Path) -> None:
    passes = [{"a": 4, "b": 0, "c": 4}] * 2
    with pytest.raises(RLError, match=r"re-calibration after iteration 1: every task left the band 0.1..0.9 \(a: "
                                      r"too easy: pass rate 1.00 of 4 attempts; b: too hard: pass rate 0.00 .*"
                                      r"widen it \(--set tasks.band=LO,HI\)"):
        Recalibrated(tmp_path / "run", passes, [], {"tasks.recalibrate_every": "1"}).run()
    assert json.loads((tmp_path / "run" / "state.json").read_text())["dropped"] == {}


@pytest.mark.parametrize(("sets", "message"), [
    ({"tasks.band": "0.9,0.1"}, "tasks.band: the band needs 0 <= LO <= HI <= 1"),
    ({"tasks.band": "0.1"}, "tasks.band: the band is two pass rates LO,HI"),
    ({"tasks.recalibrate_every": "-1"}, "tasks.recalibrate_every must be >= 0"),
])
def test_rl_task_settings_errors(sets: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_rl_config(sets=sets)


# --- `openforge rl --tasks` on a task file `openforge tasks mutate` made -------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rl_runs_end_to_end_on_a_mutate_made_task_file(tmp_path: Path) -> None:
    """`openforge tasks mutate` makes a task from openforge/testing/mutate_project, then one iteration of
    `openforge rl` (embedded engine, tool-agent) runs on it: its episodes run, its verifier scores each, the
    loop reconstructs, trains if it can and publishes; the task's solution and metadata never reach an
    episode."""
    tasks = tmp_path / "tasks.jsonl"
    out = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
           "PYTHONPATH": str(ROOT), "COLUMNS": "160"}
    made = subprocess.run([sys.executable, "-m", "openforge.cli", "tasks", "mutate", "--repo",
                           str(ROOT / "openforge/testing/mutate_project"), "--test", f"{sys.executable} -m pytest -q",
                           "--out", str(tasks), "--n", "1", "--seed", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout + made.stderr
    [task] = [json.loads(x) for x in tasks.read_text().splitlines()]
    assert task["metadata"]["source"] == "mutate" and task["solution"]
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "rl", "--out", str(out), "--tasks", str(tasks),
                           "--iterations", "1", "--attempts", "2", "--steps", "1", "--set", "engine.threads=1",
                           "--set", "train.step_tokens=1024", "--set", "train.row_tokens=1024"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    [line] = [json.loads(x) for x in (out / "rl.jsonl").read_text().splitlines()]
    assert line["episodes"] == 2 and list(line["tasks"]) == [task["id"]], line
    results = [json.loads(x) for x in (out / "iterations/000/rollout/results.jsonl").read_text().splitlines()]
    assert any(r["status"] == "ok" and r["reward"] in (0.0, 1.0) for r in results), results
    for spec in (out / "iterations/000/rollout/episodes").glob("*/spec.json"):
        task = json.loads(spec.read_text())["task"]
        assert task["solution"] is None and task["metadata"] == {}
