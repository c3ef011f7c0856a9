"""A shortened `openforge demo` against the real engine: 2 tasks x 2 attempts, 1 GRPO step, export, reload.

Asserts shapes, ids and files, never the quality of a 135M model's answers. Prints the gap between the
engine's logprobs and the PyTorch model's for the same tokens (run with -s to see it).
"""

from __future__ import annotations

import json
import math
import os

import duckdb
import pytest
from rich.console import Console

from openforge.demo import Demo, DemoConfig

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)  # minutes on 2 idle cores; much longer when other suites share them
def test_demo_e2e_short_loop(tmp_path) -> None:
    cfg = DemoConfig(out=tmp_path / "demo", tasks=2, attempts=2, train_steps=1, step_tokens=1024, threads=1,
                     max_tokens=64, gap_samples=2)
    demo = Demo(cfg, Console(file=open(os.devnull, "w"), width=120))
    result = demo.run()
    demo.summary()

    # episodes: every attempt ran through the proxy and was scored
    assert len(result.episodes) == 4
    assert all(e.reward is not None and 0.0 <= e.reward <= 1.0 for e in result.episodes)
    assert {e.task.id for e in result.episodes} == {"add-1", "mul-1"}

    # flow files -> DuckDB: engine token ids, rewards and GRPO advantages
    s = result.reconstruct
    assert s.calls >= 4 and s.calls_mixed == s.calls and s.rewards >= 4  # llama.cpp: completion ids, no prompt ids
    assert s.calls_prompt_mismatch == 0  # prompts rendered with the engine's template, as long as it counted them
    con = duckdb.connect(str(result.db), read_only=True)
    rows = con.execute(
        "SELECT input_ids, loss_mask, behaviour_logprobs, vocab_size, reward, advantage, token_source FROM samples"
    ).fetchall()
    calls = con.execute("SELECT count(*), count(DISTINCT episode_id) FROM calls").fetchone()
    con.close()
    assert calls == (s.calls, 4)
    assert rows
    for ids, mask, logprobs, vocab, reward, advantage, source in rows:
        assert len(ids) == len(mask) == len(logprobs) and vocab == 49152
        assert all(0 <= i < vocab for i in ids) and sum(mask) > 0
        assert all((m == 0) == math.isnan(lp) for m, lp in zip(mask, logprobs))
        assert all(lp <= 0 for m, lp in zip(mask, logprobs) if m)
        assert reward is not None and advantage is not None and source in ("engine", "mixed")

    # engine vs trainer logprobs for the same tokens (Q4_1 in llama.cpp vs dequantised fp32 in PyTorch)
    gap = result.logprob_gap
    print(f"\nengine vs PyTorch logprobs: mean {gap['mean']:.4f}, max {gap['max']:.4f} nats "
          f"over {gap['tokens']} tokens")
    assert gap["tokens"] > 0 and gap["mean"] < 0.1

    # one GRPO step, a loadable checkpoint, an exported GGUF the engine served for one more episode
    assert [m["step"] for m in result.metrics] == [1] and math.isfinite(result.metrics[0]["loss"])
    assert (result.checkpoint / "model.safetensors").is_file() and (result.checkpoint / "tokenizer.json").is_file()
    assert result.exported_gguf.is_file() and result.exported_gguf.stat().st_size > 200_000_000
    assert result.final_episode is not None and result.final_episode.reward is not None
    # the new policy answered through the proxy; a malformed tool call it sampled (llama.cpp answers 500 when
    # a tool call is cut off by max_tokens) is the 135M model's quality, scored 0, not a pipeline failure
    final = result.final_episode
    assert ((final.n_calls >= 1 and final.error is None)
            or "Failed to parse tool call" in (final.error or "")), final.error
    timings = result.timings
    assert {"engine", "proxy", "episodes", "reconstruct", "train", "export", "episode_new_policy"} <= set(timings)
    print("timings: " + json.dumps({k: round(v, 1) for k, v in timings.items()}))

    # nothing left running
    assert demo.engine.proc is None and demo.proxy.proc is None
