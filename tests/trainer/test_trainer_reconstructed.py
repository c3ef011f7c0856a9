"""The trainer on what the real reconstructor writes: flow files (real FlowWriter, real Qwen3 tokenizer and
chat template) -> `reconstruct.reconstruct` -> DuckDB -> `train`, with a tiny Qwen3 of the Qwen3 vocabulary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from openforge.reconstruct import reconstruct
from openforge.testing.reconstruct_flows import FlowFactory, db_rows, qwen_retokenizer
from openforge.trainer.config import load_config
from openforge.trainer.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_ppo_steps_on_reconstructed_samples(tmp_path: Path, tiny_qwen_dir: Path) -> None:
    flows = FlowFactory(tmp_path / "flows", seed=11)
    for i, reward in enumerate([1.0, 0.0, 0.0, 1.0]):  # one task, so GRPO gives +/- advantages
        flows.tool_loop(f"ep{i}", turns=1 + i % 2, stream=bool(i % 2))
        flows.write(flows.reward(f"ep{i}", reward, "task"))
    flows.close()
    db = tmp_path / "runs.duckdb"
    summary = reconstruct([tmp_path / "flows"], db, qwen_retokenizer())
    samples = db_rows(db, "SELECT n_tokens, n_trainable, advantage, behaviour_logprobs IS NOT NULL AS lp FROM samples")
    assert summary.samples == len(samples) == 4 and all(s["lp"] for s in samples)
    assert {s["advantage"] > 0 for s in samples} == {True, False}

    # every step is the whole selection (one global batch), trained twice with the ppo objective
    tokens = sum(s["n_tokens"] for s in samples)
    cfg = load_config(None, dict(db=str(db), model=str(tiny_qwen_dir), out=str(tmp_path / "out"), steps=2,
                                 step_tokens=tokens, row_tokens=max(s["n_tokens"] for s in samples) * 2,
                                 lr=1e-2, progress=False))
    train(cfg, say=lambda _: None)
    steps = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["samples"] for m in steps] == [4, 4] and [m["tokens"] for m in steps] == [tokens, tokens]
    assert all(m["trainable_tokens"] == sum(s["n_trainable"] for s in samples) for m in steps)
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in steps)
    assert steps[1]["loss"] != steps[0]["loss"]  # the first update moved the policy
