"""`openforge rollout` with real, unmodified CLIs through their built-in adapters: mini-swe-agent (Python),
Claude Code, Codex and Qwen Code (Node; Codex through a config file in the episode's home), 2 tasks x 2
attempts each, against the toolchain engine (it makes each CLI run a real shell command, `ls`, and answer).
The `ls` output with the task's marker file must reach the engine, and the verifiers' rewards must reach
DuckDB through reconstruct."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pytest

from openforge.reconstruct import reconstruct
from openforge.rollout import run
from openforge.testing import ROOT
from openforge.testing.toolchain_engine import ToolchainEngine
from toolchains import run as toolchains

pytestmark = pytest.mark.slow

CLIENT = "client-token-rollout-cli-0123456789"
REWARD = "reward-token-rollout-cli-0123456789"
MARKER = "rollout_marker_5d1c.txt"


@pytest.mark.parametrize("name", ["mini-swe-agent", "claude-code", "codex", "qwen-code"])
def test_real_cli_rollout_two_tasks_two_attempts(name: str, qwen_tok: Any, retok: Any, start_proxy: Any,
                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not toolchains.installed(name):
        pytest.fail(f"{name} is not installed: run toolchains/install.sh (make setup does)")
    monkeypatch.setenv("OPENFORGE_TOOLS_DIR", str(toolchains.TOOLS))
    monkeypatch.setenv("OPENFORGE_CLIENT_TOKEN", CLIENT)
    monkeypatch.setenv("OPENFORGE_REWARD_TOKEN", REWARD)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    tasks = tmp_path / "tasks.jsonl"
    prompt = "List the files in the current directory with ls, then summarize what you found."
    tasks.write_text("".join(json.dumps(t) + "\n" for t in [
        {"id": "list", "prompt": prompt, "files": {MARKER: "x"}, "verify": f"test -f {MARKER}", "timeout_s": 240},
        {"id": "graded", "prompt": prompt, "files": {MARKER: "x"}, "verify": "echo 0.5", "timeout_s": 240}]))
    with ToolchainEngine(tokenizer=qwen_tok, profile="vllm") as engine:
        proxy = start_proxy(engine.url, "openforge_engine_profile=vllm", f"openforge_client_tokens={CLIENT}",
                            f"openforge_reward_tokens={REWARD}")
        rollout = run(tasks, [name], proxy=proxy.url, out=tmp_path / "out", attempts=2, concurrency=2)
        proxy.stop()
        requests = [json.dumps(r.body) for r in engine.requests]
    explain = {r.episode: (r.status, r.reason) for r in rollout.results}
    assert [(r.task_id, r.status, r.reward) for r in rollout.results] == [
        ("list", "ok", 1.0), ("list", "ok", 1.0), ("graded", "ok", 0.5), ("graded", "ok", 0.5)], explain
    assert all(r.reward_posted and r.toolchain == name for r in rollout.results)
    # the CLI's shell tool really ran in the episode's workspace: its ls output went back to the engine
    assert sum(MARKER in body for body in requests) >= 4
    summary = rollout.summary["toolchains"][name]
    assert (summary["pass_at_k"], summary["pass_all_k"], summary["mean_reward"]) == (0.5, 0.5, 0.75)
    reconstruct(proxy.flow_files(), tmp_path / "db.duckdb", retok)
    con = duckdb.connect(str(tmp_path / "db.duckdb"), read_only=True)
    rows = con.execute("SELECT episode_id, task_id, reward FROM episodes").fetchall()
    con.close()
    assert {e: (t, r) for e, t, r in rows} == {r.episode: (r.task_id, r.reward) for r in rollout.results}
