"""What the loop trains on and how (issue 27): an iteration with nothing to learn makes no optimizer step and
publishes nothing; samples with advantage 0 are not selected unless asked; the dynamic group filter; warmup
on by default."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
import torch
from safetensors.torch import save_file

from openforge.reconstruct import store
from openforge.rl.config import load_rl_config
from openforge.settings import ConfigError
from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, write_samples
from openforge.trainer.config import load_config
from openforge.trainer.data import DataError, SampleSource
from openforge.trainer.train import lr_factor, train
from tests.rl.test_rl_faults import Run


def samples_db(path: Path, groups: dict[str, list[float | None]], advantage: float | None = None) -> Path:
    """One single-sample episode per reward, grouped by task; `advantage` for every sample, or reward - mean."""
    rows, tasks = [], []
    base = make_samples(qwen_tokenizer(), 1, seed=3)[0]
    for task, rewards in groups.items():
        scored = [r for r in rewards if r is not None]
        mean = sum(scored) / len(scored) if scored else 0.0
        for k, reward in enumerate(rewards):
            adv = advantage if advantage is not None else (None if reward is None else reward - mean)
            rows.append(base | {"sample_id": f"{task}-{k}", "episode_id": f"{task}-e{k}", "reward": reward,
                                "advantage": adv})
            tasks.append((task, f"{task}-{k}"))
    write_samples(path, rows)
    con = duckdb.connect(str(path))
    con.executemany("UPDATE samples SET task_id = ?, group_id = ? WHERE sample_id = ?",
                    [(task, f"task:{task}@v0", sid) for task, sid in tasks])
    con.close()
    return path


def selected(db: Path, **kw) -> list[str]:
    with SampleSource(str(db), shuffle=False, **kw) as source:
        return [s.sample_id for s in source.samples(0)]


# --- what is selected ----------------------------------------------------------------------------------------

def test_samples_with_zero_advantage_are_left_out_unless_kept(tmp_path):
    db = samples_db(tmp_path / "db.duckdb", {"same": [1.0, 1.0], "mixed": [1.0, 0.0]})
    assert selected(db, drop_zero_advantage=True) == ["mixed-0", "mixed-1"]
    assert selected(db) == ["mixed-0", "mixed-1", "same-0", "same-1"]


def test_the_dynamic_group_filter(tmp_path):
    """Kept with probability 1 - pass rate: never a group that always passes or never does, never one with an
    aborted episode (no reward); the same groups for the same seed."""
    groups: dict[str, list[float | None]] = {"all": [1.0, 1.0], "none": [0.0, 0.0], "aborted": [1.0, 0.0, None]}
    groups |= {f"q{k:03d}": [1.0, 0.0, 0.0, 0.0] for k in range(200)}  # pass rate 1/4: kept 3 times in 4
    db = samples_db(tmp_path / "db.duckdb", groups)
    kept = {s.rsplit("-", 1)[0] for s in selected(db, group_filter="dynamic", seed=1)}
    assert not kept & {"all", "none", "aborted"}
    assert 0.65 < len(kept) / 200 < 0.85, len(kept)
    assert kept == {s.rsplit("-", 1)[0] for s in selected(db, group_filter="dynamic", seed=1)}
    assert kept != {s.rsplit("-", 1)[0] for s in selected(db, group_filter="dynamic", seed=2)}
    with pytest.raises(ConfigError, match="group_filter must be none or dynamic"):
        load_config(None, {"group_filter": "dapo"})


def test_the_trainer_refuses_a_selection_with_nothing_to_learn_before_any_step(tmp_path, tiny_qwen_dir):
    db = samples_db(tmp_path / "db.duckdb", {"same": [1.0, 1.0]}, advantage=0.0)
    cfg = load_config(None, dict(db=str(db), model=str(tiny_qwen_dir), out=str(tmp_path / "out"), progress=False))
    with pytest.raises(DataError, match="Left out: samples whose advantage is 0"):
        train(cfg, say=lambda _: None)
    assert not (tmp_path / "out" / "checkpoints").exists() and not (tmp_path / "out" / "metrics.jsonl").exists()


# --- the loop ------------------------------------------------------------------------------------------------

def test_an_iteration_with_equal_rewards_everywhere_steps_nothing_and_publishes_nothing(tmp_path, monkeypatch):
    run = Run(tmp_path / "run", [], fake=("rollout", "reconstruct"))
    run.out.mkdir()
    samples_db(run.db, {"t1": [1.0, 1.0], "t2": [0.0, 0.0]})
    with store.connect(run.db) as con:
        store.record_rl_iteration(con, 0, [(f"{t}-e{k}", t, "tool-agent", k, "ok", r)
                                           for t, rs in {"t1": [1.0, 1.0], "t2": [0.0, 0.0]}.items()
                                           for k, r in enumerate(rs)], [])
    before = tmp_path / "run" / "train" / "checkpoints" / "step_000002"
    before.mkdir(parents=True)
    (before / "config.json").write_text("{}")
    save_file({"w": torch.ones(4, 4)}, str(before / "model.safetensors"))
    weights = (before / "model.safetensors").read_bytes()

    def no_training(*args, **kwargs):
        raise AssertionError("the trainer loaded")

    monkeypatch.setattr("openforge.trainer.train.Trainer", no_training)
    run.run()
    (line,) = [json.loads(x) for x in (tmp_path / "run" / "rl.jsonl").read_text().splitlines()]
    assert line["skipped_train"] == "every group had equal rewards (2 groups)"
    assert run.fake_policy.published == [] and run.state.served == "" and run.state.checkpoint == ""
    assert [p.name for p in (tmp_path / "run" / "train" / "checkpoints").iterdir()] == ["step_000002"]
    assert (before / "model.safetensors").read_bytes() == weights
    assert "nothing to learn" in run.text.getvalue()


def test_a_database_the_trainer_cannot_read_stops_the_train_stage_with_one_rl_error(tmp_path):
    """What the train stage finds in the run's DuckDB is the loop's error (one line and --resume), never a
    traceback: here a database of a schema version this OpenForge does not read."""
    from openforge.rl.errors import RLError

    run = Run(tmp_path / "run", [], fake=("rollout", "reconstruct"))
    run.out.mkdir()
    samples_db(run.db, {"t1": [1.0, 0.0]})
    with store.connect(run.db) as con:
        store.record_rl_iteration(con, 0, [("t1-e0", "t1", "tool-agent", 0, "ok", 1.0)], [])
        con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(RLError, match="training refused: .*schema version 99"):
        run.prepare_pass(0)


# --- warmup --------------------------------------------------------------------------------------------------

def test_the_loop_warms_up_by_default():
    cfg = load_rl_config().train_config("db", "model", "out")
    assert cfg.warmup_steps > 0 and cfg.min_lr_ratio == 1.0
    factors = [lr_factor(s, cfg, 10 * cfg.warmup_steps) for s in range(cfg.warmup_steps + 2)]
    assert factors[0] < 1.0 and factors == sorted(factors) and factors[-1] == factors[-2] == 1.0


# --- precision -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("native", "sets", "expected"), [
    (True, {}, "bf16-autocast"),  # AVX512-BF16 / AMX: bf16 matmuls are native, several times faster
    (False, {}, "fp32"),  # the trainer's own choice on CPU
    (True, {"train.precision": "fp32"}, "fp32"),  # what the user set stays
    (True, {"train.cpu_bf16": "false"}, "fp32"),  # the loop's bf16 wish turned off
])
def test_the_loop_trains_in_bf16_where_the_cpu_has_it(tmp_path, monkeypatch, native, sets, expected):
    """The loop asks for bf16 on CPUs with native bf16 (`cpu_bf16`); the trainer decides, and logs, the rest."""
    from openforge.trainer import dist

    monkeypatch.setattr(dist, "cpu_has_bf16", lambda: native)
    run = Run(tmp_path / "run", [], sets={"train.device": "cpu", **sets})
    run._base_model = tmp_path / "model"  # the starting weights, never converted here
    assert dist.resolve_precision(run.trainer_config(), torch.device("cpu"))[0] == expected
