"""A real capture: OpenAI client -> `mitmdump -s addons/openforge.py` -> scripted engine that tokenises
with the real Qwen3 tokenizer (vLLM token ids). Reconstruct must merge the tool loop exactly."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from openforge.reconstruct import reconstruct
from openforge.testing.reconstruct_flows import BASH, db_rows, trainable_segments
from openforge.testing.scripted_engine import ScriptedEngine


@pytest.mark.parametrize("stream", [True])
def test_reconstruct_real_capture_merges_exactly(start_proxy: Any, tmp_path, stream: bool, qwen_tok, retok) -> None:
    with ScriptedEngine(tokenizer=qwen_tok, profile="vllm") as eng:
        proxy = start_proxy(eng.url, "openforge_engine_profile=vllm")
        client = openai.OpenAI(base_url=f"{proxy.url}/e/cap-1/v1", api_key="sk-test-0000")
        msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "List the files"}]
        chunks = list(client.chat.completions.create(model="m", messages=msgs, tools=[BASH], stream=stream))
        call = next(c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls)
        args = "".join(c.choices[0].delta.tool_calls[0].function.arguments or "" for c in chunks
                       if c.choices and c.choices[0].delta.tool_calls)
        msgs += [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": "bash", "arguments": args}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"}]
        final = list(client.chat.completions.create(model="m", messages=msgs, tools=[BASH], stream=stream))
        assert any(c.choices and c.choices[0].delta.content for c in final)
        proxy.stop()
    s = reconstruct(proxy.flow_files(), tmp_path / "db.duckdb", retok, missing_reward="fill:1")
    assert (s.calls, s.calls_engine_ids, s.samples, dict(s.skipped)) == (2, 2, 1, {})
    [sample] = db_rows(tmp_path / "db.duckdb", "SELECT * FROM samples")
    assert sample["token_source"] == "engine" and sample["n_calls"] == 2
    # the trainable tokens decode to exactly what the engine streamed, each once
    tok = qwen_tok
    texts = [tok.decode(r) for r in trainable_segments(sample["input_ids"], sample["loss_mask"])]
    assert len(texts) == 2 and json.loads(args)["command"] in texts[0]
    assert texts[1].startswith("".join(c.choices[0].delta.content or "" for c in final if c.choices))
