"""`openforge rl --engine vllm`: the loop on real vLLM (CPU build, `make setup-vllm`), two short iterations.

The engine gives prompt and completion ids (every call `engine`-exact), and the new weights go in through
vLLM's in-place reload while the proxy holds new calls: iteration 2's calls carry policy version 1.
Asserts ids, versions and files, never answer quality (a 135M model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest

from openforge.engines.vllm import VLLM_VENV
from openforge.testing import ROOT

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),  # vLLM's first start compiles
    pytest.mark.skipif(not (VLLM_VENV / ".setup-done").is_file(),
                       reason=f"vLLM's CPU build is not installed in {VLLM_VENV}: run `make setup-vllm`"),
]


def test_rl_loop_on_vllm_reloads_weights_in_place(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
           "PYTHONPATH": str(ROOT), "COLUMNS": "160"}
    done = subprocess.run(
        [sys.executable, "-m", "openforge.cli", "rl", "--out", str(out), "--engine", "vllm", "--iterations", "2",
         "--attempts", "2", "--steps", "1", "--set", "rollout.max_tasks=2", "--set", "proxy.max_tokens=64",
         "--set", "train.step_tokens=1024", "--set", "train.row_tokens=1024",
         "--set", "train.keep_zero_advantage=true"],  # a step (and an in-place reload) every iteration
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    lines = [json.loads(x) for x in (out / "rl.jsonl").read_text().splitlines()]
    assert [x["policy_version"] for x in lines] == [0, 1] and all(x["episodes"] == 4 for x in lines)
    # published from the resident trainer's memory as a weights-only directory, reloaded in place; the
    # last iteration also writes a full checkpoint
    assert lines[-1]["served"] == str(out / "policies/policy-0002")
    assert sorted(p.name for p in (out / "policies").iterdir()) == ["policy-0002"]
    assert not (out / "policies/policy-0002/trainer_state.pt").exists()
    assert lines[-1]["checkpoint"] == str(out / "train/checkpoints/step_000002")

    con = duckdb.connect(str(out / "rl.duckdb"), read_only=True)
    calls = con.execute("SELECT r.iteration, c.policy_version, c.token_source, c.prompt_check, count(*) FROM calls c "
                        "JOIN rl_episodes r USING (episode_id) GROUP BY ALL ORDER BY 1").fetchall()
    con.close()
    assert {(i, v) for i, v, *_ in calls} == {(0, 0), (1, 1)}
    assert {(source, check) for _, _, source, check, _ in calls} == {("engine", "engine")}  # vLLM's own ids
    for line in lines:
        if line["train"]:
            assert line["train"]["engine_logprob_share"] == 1.0 and line["train"]["engine_gap_mean"] < 0.2
