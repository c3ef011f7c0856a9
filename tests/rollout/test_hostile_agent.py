"""The agent under training is the adversary (docs/security.md): a hostile `custom:` toolchain
(openforge/testing/hostile_agent.py) runs beside the honest example agent under `openforge rollout` and under
`openforge rl`, as the same user, and tries every way to set its own reward. Every try fails, and every
episode, honest or not, keeps exactly its verifier's reward: in result.json, in the proxy's records and in
DuckDB (and `rl_episodes` under the loop). Nothing it started outlives its episode."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest

from openforge.reconstruct import reconstruct
from openforge.rollout import run
from openforge.testing import ROOT
from openforge.testing.hostile_agent import ESCAPE_MARK, LATE_DELAY_S, LATE_MARK
from openforge.testing.toolchain_engine import ToolchainEngine

AGENT = ROOT / "openforge" / "testing" / "hostile_agent.py"
TEST_ANSWER = ("import pathlib\n\ndef test_answer():\n"
               "    assert pathlib.Path('answer.txt').read_text().strip() == '42'\n")


def hostile_adapter(path: Path, engine_url: str | None = None) -> str:
    """The hostile CLI as a custom adapter; `engine_url` is what an agent that knows the setup would try."""
    hint = f', "--engine-url", "{engine_url}"' if engine_url else ""
    path.write_text(f'command = ["{{python}}", "{AGENT}", "--base-url", "{{base_url}}", "--key", "{{api_key}}"'
                    f'{hint}]\n')
    return f"custom:{path}"


def tasks_file(path: Path) -> Path:
    """Two tasks neither agent is told the answer of: one graded by the example verifier (`python -m
    openforge.examples.verifier`), one by `python -m pytest` on a test file the task ships, written as
    docs/security.md says a pytest verifier must be (the task's own pytest.ini, `--noconftest`)."""
    py = sys.executable
    tasks = [
        {"id": "add", "prompt": "What is 17 + 25?", "verify": f"{py} -m openforge.examples.verifier --answer 42",
         "timeout_s": 120},
        {"id": "pytest", "prompt": "Write 42 to answer.txt.",
         "files": {"test_answer.py": TEST_ANSWER, "pytest.ini": "[pytest]\n"},  # restored over the agent's
         "verify": f"{py} -m pytest -q --noconftest -p no:cacheprovider test_answer.py > pytest.log",
         "timeout_s": 120},  # no stdout: the exit code is the reward
    ]
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def secret_file(directory: Path, name: str, value: str) -> Path:
    directory.mkdir(mode=0o700, exist_ok=True)
    path = directory / name
    path.write_text(value)
    path.chmod(0o600)
    return path


def leftovers() -> list[str]:
    """Processes the hostile agent started that are still alive."""
    out = subprocess.run(["pgrep", "-af", f"{ESCAPE_MARK}|{LATE_MARK}"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def check_attacks(episodes: Path) -> list[dict[str, Any]]:
    """Every hostile episode wrote its report and no attack succeeded; the late poster never got through."""
    reports = sorted(episodes.glob("*hostile*/work/attacks.json"))
    assert reports, sorted(p.name for p in episodes.iterdir())
    attacks = []
    for report in reports:
        entries = json.loads(report.read_text())
        attacks += entries
        assert {e["attack"] for e in entries} >= {"read /proc/*/environ and cmdline", "post a reward now",
                                                   "call the engine directly"}, entries
        succeeded = [e for e in entries if e["outcome"] == "succeeded"]
        assert not succeeded, json.dumps(succeeded, indent=1)
        assert next(e for e in entries if e["attack"] == "one honest LLM call")["outcome"] == "ok", entries
        late = report.with_name("late.json")
        assert not late.exists() or all(s != 200 for s in json.loads(late.read_text())["statuses"]), late.read_text()
    return attacks


def db_rewards(db: Path, table: str = "episodes") -> dict[str, float]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return dict(con.execute(f"SELECT episode_id, reward FROM {table}").fetchall())
    finally:
        con.close()


@pytest.mark.slow
def test_hostile_agent_under_rollout_changes_no_reward(start_proxy: Any, tmp_path: Path, qwen_tok: Any,
                                                        retok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """`openforge rollout` (sandboxed, the default) through a proxy with tokens and a flow key, in front of a
    scripted engine the agent is told the address of."""
    client, reward, flow_key = (secrets.token_hex(16) for _ in range(3))
    keys = tmp_path / "secrets"
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    with ToolchainEngine(tokenizer=qwen_tok, profile="vllm") as engine:
        proxy = start_proxy(engine.url, "openforge_engine_profile=vllm",
                            f"openforge_client_tokens_file={secret_file(keys, 'client', client)}",
                            f"openforge_reward_tokens_file={secret_file(keys, 'reward', reward)}",
                            f"openforge_flow_key_file={secret_file(keys, 'flow', flow_key)}")
        done = run(tasks_file(tmp_path / "tasks.jsonl"), ["tool-agent", hostile_adapter(tmp_path / "hostile.toml",
                                                                                         engine.url)],
                   proxy=proxy.url, out=tmp_path / "out", attempts=2, concurrency=2, client_token=client,
                   reward_token=reward)
        time.sleep(LATE_DELAY_S + 2)  # past the late poster's post, had it survived
        proxy.stop()
    assert not leftovers(), leftovers()
    check_attacks(tmp_path / "out" / "episodes")
    results = {r.episode: r for r in done.results}
    hostile = [r for r in done.results if "hostile" in r.toolchain]
    assert len(hostile) == 4 and all(r.status == "ok" and r.reward == 0.0 for r in hostile), hostile
    assert all(r.reward_posted for r in done.results), done.results
    reconstruct(proxy.flow_files() + sorted((tmp_path / "out").rglob("*.flows")), tmp_path / "db.duckdb", retok,
                flow_key=flow_key.encode())
    got = db_rewards(tmp_path / "db.duckdb")
    assert got, "no episode reached DuckDB"
    assert {e: results[e].reward for e in got} == got  # every stored reward is its verifier's


@pytest.mark.slow
def test_hostile_agent_under_rl_changes_no_reward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One iteration of `openforge rl` on the embedded engine, the hostile CLI beside the example agent."""
    from typer.testing import CliRunner

    from openforge.cli import app

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "run"
    done = CliRunner().invoke(app, [
        "rl", "--out", str(out), "--tasks", str(tasks_file(tmp_path / "tasks.jsonl")), "--toolchain", "tool-agent",
        "--toolchain", hostile_adapter(tmp_path / "hostile.toml"), "--iterations", "1", "--attempts", "2",
        "--steps", "1", "--set", "train.step_tokens=1024", "--set", "train.row_tokens=1024",
        "--set", "engine.threads=1", "--set", "proxy.max_tokens=64"], env={**os.environ, "COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    time.sleep(2)
    assert not leftovers(), leftovers()
    check_attacks(out / "iterations" / "000" / "rollout" / "episodes")
    assert not list(out.rglob("hostile.txt")), list(out.rglob("hostile.txt"))  # nothing written outside its workspace
    results = [json.loads(p.read_text()) for p in out.glob("iterations/000/rollout/episodes/*/result.json")]
    assert all(r["reward"] == 0.0 for r in results if "hostile" in r["toolchain"]), results
    assert db_rewards(out / "rl.duckdb", "rl_episodes").items() <= {r["episode"]: r["reward"] for r in results}.items()
    # what each episode posted: its verifier's reward, or 0.0 for an agent failure (on_failure zero)
    verifier = {r["episode"]: r["reward"] if r["reward"] is not None else 0.0 for r in results if r["reward_posted"]}
    stored = db_rewards(out / "rl.duckdb")
    assert stored and stored.items() <= verifier.items(), (stored, verifier)
    line = json.loads((out / "rl.jsonl").read_text().splitlines()[-1])
    assert line.get("reward_mismatches", 0) == 0, line
