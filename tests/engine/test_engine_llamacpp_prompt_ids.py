"""Prompt ids on the embedded engine: real llama.cpp behind a real proxy, then reconstruct.

llama.cpp answers a Chat call with completion ids only. The proxy asks it for the prompt's ids beside each
call (`/apply-template` + `/tokenize`), so every call's prompt is the engine's own (`prompt_check` `engine`);
with that turned off, reconstruct renders the prompt with the tokenizer's template and must render what
llama.cpp rendered (`match`), non-ASCII tool arguments and tool results included.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import httpx
import pytest

from openforge.addons import flowfile
from openforge.engines.llamacpp import EmbeddedEngine
from openforge.models import hf_dir
from openforge.reconstruct import reconstruct
from openforge.reconstruct.tokenize import load_tokenizer

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Évalue une expression × ÷ (計算)",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
# (tool-call arguments as a client sends them back, the tool's result)
TURNS = [
    ('{"expression": "12 × 7"}', "84"),
    ('{"expression": "12 \\u00d7 7"}', "84 (12 × 7)"),
    ('{"expression":"café + é"}', "é is not a number"),
    ('{"expression" : "三 + 四"}', "七 (中文)"),
    ('{"expression": "🙂 * 2"}', "🙂🙂"),
    ('{"expression": "say \\"hi\\""}', 'a "quoted" \\ result'),
    ('{"expression": "1.0 + 2", "precision": 1.0, "digits": [3.14159265358979, 1e-7]}', "3"),
]


CALLS = 2 * len(TURNS) + 1


def conversation(arguments: str, result: str, stream: bool) -> dict[str, Any]:
    return {"model": "smollm2", "stream": stream, "max_tokens": 4, "tools": TOOLS, "temperature": 1.0,
            "messages": [
                {"role": "system", "content": "Use the calculator. Réponds en français."},
                {"role": "user", "content": "Combien font ces nombres ? ×"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": result},
            ]}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    with EmbeddedEngine(threads=1, log_path=tmp_path_factory.mktemp("engine") / "engine.log") as eng:
        yield eng


def run_calls(start_proxy: Any, engine: EmbeddedEngine, tmp_path: Path, *sets: str) -> tuple[list[Any], Path]:
    """Every turn through a proxy, whole and streamed; (the flow records, the flow directory)."""
    proxy = start_proxy(engine.url, *sets)
    with httpx.Client(timeout=300) as client:
        for i, (arguments, result) in enumerate(TURNS):
            for stream in (False, True):
                answer = client.post(f"{proxy.url}/e/turn-{i}-{int(stream)}/v1/chat/completions",
                                     json=conversation(arguments, result, stream))
                assert answer.status_code == 200, answer.text
        plain = {"model": "smollm2", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 4,
                 "messages": [{"role": "user", "content": "Dis « bonjour » en 中文 🙂"}]}
        answer = client.post(f"{proxy.url}/e/plain-stream/v1/chat/completions", json=plain)  # streamed upstream too
        assert answer.status_code == 200 and "data:" in answer.text, answer.text
    proxy.status()  # every answered exchange is on disk
    records = [r for f in proxy.flow_files() for r in flowfile.open_flow_file(f).records()]
    return [r for r in records if r.get("type") == "exchange"], proxy.flow_dir


def calls_table(flow_dir: Path, tmp_path: Path) -> list[tuple[Any, ...]]:
    db = tmp_path / "runs.duckdb"
    reconstruct([flow_dir], db, load_tokenizer(hf_dir()), missing_reward="fill:0")
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute("SELECT episode_id, prompt_check, token_source, prompt_tokens FROM calls "
                           "ORDER BY episode_id").fetchall()
    finally:
        con.close()


def test_proxy_records_the_engines_prompt_ids(start_proxy: Any, engine: EmbeddedEngine, tmp_path: Path) -> None:
    records, flow_dir = run_calls(start_proxy, engine, tmp_path)
    assert len(records) == CALLS
    for rec in records:
        assert "engine_prompt_error" not in rec, rec.get("engine_prompt_error")
        ids = rec["engine_prompt_ids"]
        assert ids and all(isinstance(i, int) for i in ids)
        if rec["response"]["body"]:  # a streamed answer's count is checked by reconstruct below
            assert len(ids) == json.loads(rec["response"]["body"])["usage"]["prompt_tokens"]
    calls = calls_table(flow_dir, tmp_path)
    assert len(calls) == CALLS
    # a completion llama.cpp merged (a character split over tokens: the emoji, CJK) has no ids of its own and
    # is rendered, with its prompt, which must then be the engine's prompt
    drifted = [(episode, check, source) for episode, check, source, _ in calls
               if (check, source) not in {("engine", "engine"), ("match", "retokenized")}]
    assert not drifted, drifted
    assert sum(check == "engine" for _, check, _, _ in calls) > CALLS // 2, calls


def test_rendered_prompts_match_the_engines_without_its_ids(start_proxy: Any, engine: EmbeddedEngine,
                                                            tmp_path: Path) -> None:
    """The fallback for an engine that gives no prompt ids: the tokenizer's template must render what
    llama.cpp rendered, whatever the client's JSON looks like."""
    records, flow_dir = run_calls(start_proxy, engine, tmp_path, "openforge_engine_prompt_ids=false")
    assert not any("engine_prompt_ids" in r for r in records)
    calls = calls_table(flow_dir, tmp_path)
    assert len(calls) == CALLS
    drifted = [(episode, check) for episode, check, _, _ in calls if check != "match"]
    assert not drifted, drifted
