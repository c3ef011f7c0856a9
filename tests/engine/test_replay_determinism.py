"""Replaying a captured trace through the real proxy twice gives the same samples as the capture itself.

Capture: an OpenAI-SDK agent loop (2 episodes, tool call then final answer, streamed) through mitmdump
+ addon in front of the scripted engine (real Qwen3 template, vLLM-style token ids). Replay: the same
client requests (`replay drive --side client`) through a fresh mitmdump whose upstream is `replay serve
--side engine`. Each flow directory goes through reconstruct; the samples must be identical.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import duckdb
import openai
import pytest

from openforge.reconstruct import reconstruct
from openforge.replay.drive import drive
from openforge.replay.serve import ReplayIndex, ReplayServer
from openforge.replay.trace import load_exchanges
from openforge.testing.reconstruct_flows import qwen_retokenizer
from openforge.testing.toolchain_engine import ToolchainEngine

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def agent_episode(base_url: str, episode: str, task: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/e/{episode}/v1", api_key="sk-client", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a shell agent."},
                                      {"role": "user", "content": task}]
    for _ in range(3):
        stream = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
        text, calls = "", {}
        for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                    c["name"] += tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
        if not calls:
            return
        messages.append({"role": "assistant", "content": text or None, "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls.values()]})
        for c in calls.values():
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": f"ran {json.loads(c['arguments'])}"})


def samples(flow_dir: Path, db: Path) -> list[tuple]:
    summary = reconstruct([flow_dir], db, qwen_retokenizer(), missing_reward="fill:0")
    assert summary.calls > 0 and not summary.skipped, summary
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("""SELECT sample_id, token_source, input_ids, loss_mask, behaviour_logprobs, n_calls
                          FROM samples ORDER BY sample_id""").fetchall()
    con.close()
    return [tuple(json.dumps(v) if isinstance(v, list) else v for v in r) for r in rows]


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory, start_module_proxy: Any) -> Path:
    with ToolchainEngine(tokenizer=qwen_retokenizer().tok) as engine:
        proxy = start_module_proxy(engine.url, mode=f"reverse:{engine.url}")
        for ep, task in (("ep-a", "list the files"), ("ep-b", "show the disk usage")):
            agent_episode(proxy.url, ep, task)
        proxy.stop()
    return proxy.flow_dir


def replay_once(trace: Path, start_proxy: Any) -> Path:
    exchanges = load_exchanges([trace])
    with ReplayServer(ReplayIndex.build(exchanges, side="engine"), speed=None) as server:
        proxy = start_proxy(server.url, mode=f"reverse:{server.url}")
        report = asyncio.run(drive(exchanges, proxy.url, concurrency=2, side="client"))
        proxy.stop()
    s = report.summary()
    assert s["failed"] == 0 and s["identical_fraction"] == 1.0, report.results
    assert not server.diverged
    return proxy.flow_dir


def test_replay_twice_gives_identical_samples(captured: Path, start_proxy: Any, tmp_path: Path) -> None:
    original = samples(captured, tmp_path / "orig.duckdb")
    assert len(original) == 2 and {r[1] for r in original} == {"engine"}
    first = samples(replay_once(captured, start_proxy), tmp_path / "r1.duckdb")
    second = samples(replay_once(captured, start_proxy), tmp_path / "r2.duckdb")
    assert first == second == original
