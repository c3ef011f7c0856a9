"""README command one, shortened: `openforge demo` (the RL loop on the embedded engine) with 2 tasks x 2
attempts, 2 iterations of 1 GRPO step, then the notebook over its output directory.

Asserts shapes, ids, versions and files, never the quality of a 135M model's answers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1800)  # minutes on 2 idle cores; much longer when other suites share them
def test_demo_runs_the_loop_and_says_where_everything_is(tmp_path: Path) -> None:
    out = tmp_path / "demo-out"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPENFORGE_")},
           "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "openforge.cli", "demo", "--out", str(out), "--tasks", "2",
                           "--attempts", "2", "--iterations", "2", "--steps", "1", "--step-tokens", "1024",
                           "--threads", "1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1700)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    text = done.stdout
    assert "Traceback" not in text + done.stderr
    # the summary: reward per iteration, where everything is, what to run next
    assert "openforge rl" in text and "where everything is" in text and "Next:" in text
    for name in ("rl.jsonl", "rl.png", "rl.duckdb", "flows", "train", "policies"):
        assert str(out / name) in text
    assert "--resume --iterations 4" in text and "--engine vllm" in text and "--toolchain codex" in text

    lines = [json.loads(x) for x in (out / "rl.jsonl").read_text().splitlines()]
    assert [x["iteration"] for x in lines] == [0, 1] and [x["policy_version"] for x in lines] == [0, 1]
    step = 0
    for line in lines:
        assert line["episodes"] == 4 and set(line["tasks"]) == {"add-1", "mul-1"}
        assert 0.0 <= line["reward_mean"] <= 1.0 and line["toolchains"]["tool-agent"]["episodes"] == 4
        assert {"rollout", "reconstruct", "train", "publish"} <= set(line["seconds"])
        if line["skipped_train"]:  # every group had equal rewards: no step, nothing published (docs/rl.md)
            assert line["train_steps"] == 0 and line["train"] is None, line
            # the last iteration saves the steps only memory holds, an earlier iteration's (the resident trainer)
            last_steps = out / "train" / "checkpoints" / f"step_{step:06d}"
            assert line["checkpoint"] in ((None, str(last_steps)) if line is lines[-1] and step else (None,)), line
            continue
        step += 1
        assert line["train_steps"] == 1 and math.isfinite(line["train"]["loss"])
        # the engine's logprobs are the trainer's policy's: policy 0 is served as an f16 GGUF that holds the
        # starting (Q4_1) weights exactly (measured gaps 0.0003-0.005 nats); a trained policy is served rounded
        # to f16, which loses part of a small step's update (measured 0.104). Logprobs of other tokens or of
        # another position differ by nats.
        assert line["train"]["engine_gap_mean"] < (0.02 if line["policy_version"] == 0 else 0.5), line["train"]
        assert line["train_step_range"] == [step, step]
    # held-out evaluation of the first and the last policy, on tasks never trained on
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [x["policy_version"] for x in evals] == [0, 2], evals
    for e in evals:
        assert e["sampled"]["episodes"] == 4 and e["greedy"]["episodes"] == 2, e
    held = {json.loads(p.read_text())["task_id"] for p in (out / "eval").rglob("result.json")}
    assert held == {"sub-1", "sub-2"} and not held & set(lines[0]["tasks"]), held
    assert (out / "rl.png").stat().st_size > 10_000
    published = [line["iteration"] + 1 for line in lines if not line["skipped_train"]]
    if published:  # the newest policy the loop published is what the engine serves at the end
        served = out / "policies" / f"policy-{published[-1]:04d}.gguf"
        assert lines[-1]["served"] == str(served) and served.stat().st_size > 200_000_000
    else:  # policy 0 throughout: the starting GGUF's f16 export, which the engine was given
        assert lines[-1]["served"].endswith(".f16.gguf"), lines[-1]["served"]

    # flow files -> DuckDB: engine token ids, rewards, GRPO advantages, the policy version of every call
    con = duckdb.connect(str(out / "rl.duckdb"), read_only=True)
    versions = con.execute("SELECT r.iteration, c.policy_version, count(*) FROM calls c JOIN rl_episodes r "
                           "USING (episode_id) GROUP BY 1, 2 ORDER BY 1").fetchall()
    calls = con.execute("SELECT call_id, episode_id, prompt_check, token_source, prompt_tokens FROM calls "
                        "ORDER BY t_start").fetchall()
    rows = con.execute("SELECT input_ids, loss_mask, behaviour_logprobs, vocab_size, reward, advantage, "
                       "token_source FROM samples WHERE n_trainable > 0").fetchall()
    con.close()
    assert [(i, v) for i, v, _ in versions] == [(0, 0), (1, 1)]
    # the proxy asks llama.cpp for every prompt's ids; a completion it merged (a character split over tokens)
    # has no ids of its own and is rendered, with its prompt, which must then be the engine's prompt
    drifted = [c for c in calls if (c[2], c[3]) not in {("engine", "engine"), ("match", "retokenized")}]
    assert not drifted, drift_report(out / "flows", drifted)
    assert rows
    for ids, mask, logprobs, vocab, reward, advantage, source in rows:
        assert len(ids) == len(mask) and vocab == 49152
        assert all(0 <= i < vocab for i in ids) and sum(mask) > 0
        # llama.cpp's logprob entries are its completion ids unless it merged a character split over tokens;
        # then the completion is rendered (retokenized) and has no logprobs
        assert logprobs is not None or source == "retokenized"
        assert logprobs is None or (len(logprobs) == len(ids)
                                    and all(lp <= 0 for m, lp in zip(mask, logprobs) if m and not math.isnan(lp)))
        assert reward is not None and advantage is not None and source in ("engine", "mixed", "retokenized")
    assert sum(source == "engine" for *_, source in rows) > len(rows) // 2

    from openforge.testing.notebooks import execute_rl_notebook

    execute_rl_notebook(out)


def drift_report(flow_dir: Path, drifted: list[tuple[Any, ...]]) -> str:
    """Each call whose prompt reconstruct could not take from the engine or check against it, with what the
    proxy recorded of it: why the engine gave no prompt ids, the engine's count, the tool calls it was sent."""
    from openforge.addons import flowfile

    records = {r.get("id"): r for f in sorted(flow_dir.glob("*.flows")) for r in flowfile.open_flow_file(f).records()}
    lines = [f"{len(drifted)} call(s) whose prompt is not the engine's:"]
    for call_id, episode, check, source, prompt_tokens in drifted:
        rec = records.get(str(call_id).split("#")[0]) or {}
        body = json.loads((rec.get("upstream_request") or {}).get("body") or b"{}")
        tool_calls = [tc.get("function") for m in body.get("messages") or [] for tc in m.get("tool_calls") or []]
        lines.append(f"- call {call_id} (episode {episode}): prompt_check {check}, token_source {source}, the engine "
                     f"counted {prompt_tokens} prompt tokens, recorded {len(rec.get('engine_prompt_ids') or [])} "
                     f"prompt ids, engine_prompt_error {rec.get('engine_prompt_error')!r}, tool calls {tool_calls!r}")
    return "\n".join(lines)
