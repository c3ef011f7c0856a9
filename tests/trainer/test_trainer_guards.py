"""What the trainer refuses, and when: bad config values and bad samples before step 1, a non-finite loss or
gradient at the step it appears (nothing saved), non-finite weights in `checkpoint.save`, damaged or
unsafe checkpoints on `--resume` (skipped), and the demo's training stage (never a traceback)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from openforge.settings import ConfigError
from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, write_samples
from openforge.trainer import checkpoint
from openforge.trainer.config import load_config
from openforge.trainer.data import DataError, Position
from openforge.trainer.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    return make_samples(qwen_tokenizer(), 8, seed=0, episodes=4)


def config(tmp: Path, model: Path, db: Path, **kw):
    values = dict(db=str(db), model=str(model), out=str(tmp / "out"), step_tokens=160, row_tokens=160,
                  lr=3e-3, steps=2, progress=False, shuffle=False) | kw
    return load_config(None, values)


def nothing_written(out: Path) -> bool:
    return not (out / "metrics.jsonl").exists() and not list((out / "checkpoints").glob("*"))


def checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("*"))


# --- config ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("toml", [
    "train = 5", "lr = nan", "lr = inf", "lr = 0.0", "betas = [0.9]", "betas = [0.9, 1.0]", "steps = -3",
    "epochs = 0", "steps = true", "row_tokens = 1", "clip_low = 1.0", "clip_high = -0.1", "is_cap = inf",
    "kl_coef = -1.0", "min_lr_ratio = 1.5", "warmup_steps = -1", "weight_decay = nan", "grad_clip = 0.0",
    "save_every = -1", "[train]\nstep_tokens = 0",
])
def test_bad_config_values_are_one_clear_error(tmp_path, toml):
    path = tmp_path / "train.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError):
        load_config(path)


@pytest.mark.parametrize("overrides", [{"lr": "nan"}, {"betas": "0.9"}, {"epochs": "0"}, {"steps": "-3"}])
def test_bad_set_values_are_one_clear_error(overrides):
    with pytest.raises(ConfigError):
        load_config(None, overrides)


# --- samples refused before step 1 ------------------------------------------------------------------------

def damaged(samples: list[dict], damage: str) -> tuple[list[dict], str]:
    """A copy of the samples with one damaged the given way (the last one in sample_id order, so in a later
    global batch than the first step's), and its id."""
    out = [dict(s) for s in samples]
    bad = out[-1]
    lp = list(bad["behaviour_logprobs"])
    first = bad["loss_mask"].index(1, 1)  # a trainable token
    if damage == "nan_advantage":
        bad["advantage"] = math.nan
    elif damage == "inf_advantage":
        bad["advantage"] = math.inf
    elif damage == "-inf_logprob":
        lp[first] = -math.inf
    elif damage == "nan_logprob":
        lp[first] = math.nan
    elif damage == "positive_logprob":
        lp[first] = 0.5  # a probability above 1: no engine samples that, a forger might write it
    elif damage == "token_id":
        bad["input_ids"] = bad["input_ids"][:-1] + [151936]  # the tiny model's embedding has 151936 rows
    elif damage == "nothing_trainable":
        bad["loss_mask"] = [1] + [0] * (len(bad["input_ids"]) - 1)  # only mask[0], which nothing predicts
        bad["n_trainable"] = 1  # what a count over the whole mask gives: the sample is selected
    elif damage == "mask_length":
        bad["loss_mask"] = bad["loss_mask"][:-1]
    elif damage == "logprobs_length":
        lp = lp + [-1.0]
    elif damage == "n_tokens":
        bad["n_tokens"] = len(bad["input_ids"]) - 3
    bad["behaviour_logprobs"] = lp
    return out, bad["sample_id"]


@pytest.mark.parametrize("damage", ["nan_advantage", "inf_advantage", "-inf_logprob", "nan_logprob",
                                    "positive_logprob", "token_id", "nothing_trainable", "mask_length",
                                    "logprobs_length", "n_tokens"])
def test_bad_samples_are_refused_before_step_1(tmp_path, tiny_qwen_dir, samples, damage):
    rows, bad_id = damaged(samples, damage)
    db = write_samples(tmp_path / "runs.duckdb", rows)
    cfg = config(tmp_path, tiny_qwen_dir, db)
    with pytest.raises(DataError, match=bad_id):
        train(cfg, say=lambda _: None)
    assert nothing_written(Path(cfg.out))


# --- non-finite loss, gradient, weights ---------------------------------------------------------------------

def test_a_non_finite_loss_stops_training_without_saving(tmp_path, tiny_qwen_dir, samples, monkeypatch):
    """From step 2 on the loss is NaN: step 1's checkpoint stays, nothing of step 2 is written."""
    import openforge.trainer.train as loop

    calls = []
    forward_loss = loop.forward_loss

    def nan_from_step_2(*args, **kwargs):
        loss, stats = forward_loss(*args, **kwargs)
        calls.append(1)
        return (loss * math.nan, stats | {"loss": math.nan}) if len(calls) > 1 else (loss, stats)

    monkeypatch.setattr(loop, "forward_loss", nan_from_step_2)
    db = write_samples(tmp_path / "runs.duckdb", samples)
    # step_tokens == row_tokens: one row, so one forward_loss call, per step
    cfg = config(tmp_path, tiny_qwen_dir, db, save_every=1, steps=3)
    with pytest.raises(DataError, match="step 2.*not finite"):
        train(cfg, say=lambda _: None)
    assert checkpoints(Path(cfg.out)) == ["step_000001"]
    assert len((Path(cfg.out) / "metrics.jsonl").read_text().splitlines()) == 1


def test_a_non_finite_gradient_stops_training_without_saving(tmp_path, tiny_qwen_dir, samples, monkeypatch):
    import openforge.trainer.train as loop

    load_model = loop.load_model

    def with_inf_gradient(*args, **kwargs):
        model = load_model(*args, **kwargs)
        model.get_input_embeddings().weight.register_hook(lambda g: g * math.inf)
        return model

    monkeypatch.setattr(loop, "load_model", with_inf_gradient)
    db = write_samples(tmp_path / "runs.duckdb", samples)
    cfg = config(tmp_path, tiny_qwen_dir, db)
    with pytest.raises(DataError, match="step 1.*grad norm"):
        train(cfg, say=lambda _: None)
    assert nothing_written(Path(cfg.out))


def test_checkpoint_save_refuses_non_finite_weights(tmp_path, tiny_qwen_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = math.inf
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    cfg = load_config(None, {})
    with pytest.raises(DataError, match="model.layers.1.mlp.down_proj.weight"):
        checkpoint.save(str(tmp_path), 7, Position(), model, str(tiny_qwen_dir), optimizer, scheduler, cfg, 0)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").iterdir())


# --- resume -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, tiny_qwen_dir, samples) -> tuple[Path, Path]:
    """Two steps checkpointed after each: the run the damaged copies resume."""
    base = tmp_path_factory.mktemp("resume")
    db = write_samples(base / "runs.duckdb", samples)
    cfg = config(base, tiny_qwen_dir, db, save_every=1)
    train(cfg, say=lambda _: None)
    return Path(cfg.out), db


class RunsCode:
    """A pickle that creates a directory when loaded the unsafe way (full unpickling, weights_only off)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (str(self.path),)


@pytest.mark.parametrize("damage", ["no_state", "garbage_state", "pickled_code", "no_weights", "truncated_weights"])
def test_resume_skips_a_damaged_newest_checkpoint(tmp_path, tiny_qwen_dir, two_steps, damage):
    out, db = two_steps
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    newest = copy / "checkpoints" / "step_000002"
    marker = tmp_path / "pickle_ran"
    if damage == "no_state":
        (newest / "trainer_state.pt").unlink()
    elif damage == "garbage_state":
        (newest / "trainer_state.pt").write_bytes(b"\x80\x02garbage")
    elif damage == "pickled_code":
        torch.save({"step": 2, "position": {"epoch": 0, "offset": 8}, "rng": RunsCode(marker)},
                   newest / "trainer_state.pt")
    elif damage == "no_weights":
        (newest / "model.safetensors").unlink()
    elif damage == "truncated_weights":
        weights = newest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    said: list[str] = []
    train(config(tmp_path, tiny_qwen_dir, db, save_every=1), resume=True, say=said.append)
    assert not marker.exists()
    assert any("step_000002" in line and "skip" in line for line in said), said
    # it resumed from step 1 and redid step 2 exactly
    a, b = load_file(out / "checkpoints/step_000002/model.safetensors"), load_file(newest / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-7)


def test_trainer_state_loads_without_pickled_code(two_steps):
    state = torch.load(two_steps[0] / "checkpoints/step_000002/trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and isinstance(state["rng"], torch.Tensor)


# --- the RL loop's training stage (the demo's) ---------------------------------------------------------------

def loop_train(tmp_path: Path, model: Path, rows: list[dict]) -> list[dict]:
    """`openforge rl`'s train stage for iteration 0 on these samples (their episodes that iteration's)."""
    from openforge.reconstruct import store
    from openforge.rl.config import load_rl_config
    from openforge.rl.loop import RLRun

    cfg = load_rl_config(sets={"engine.backend": "vllm", "engine.model": str(model), "train.steps": "1",
                               "train.step_tokens": "160", "train.row_tokens": "160", "train.device": "cpu",
                               "train.progress": "false", "train.tree": "false"})  # one row per sample
    run = RLRun(cfg, tmp_path / "rl", Console(file=open(os.devnull, "w")))
    run.out.mkdir()
    run.db = write_samples(tmp_path / "rl.duckdb", rows)
    with store.connect(run.db) as con:
        store.record_rl_iteration(con, 0, [(e, "task1", "test", 1, "ok", 1.0)
                                           for e in sorted({r["episode_id"] for r in rows})], [])
    run.train(0)
    return [json.loads(x) for x in (run.train_out / "metrics.jsonl").read_text().splitlines()]


def test_loop_trains_on_samples_without_engine_logprobs(tmp_path, tiny_qwen_dir, samples):
    rows = [s | {"behaviour_logprobs": None} if i % 4 == 0 else s for i, s in enumerate(samples)]
    metrics = loop_train(tmp_path, tiny_qwen_dir, rows)
    assert [m["step"] for m in metrics] == [1] and math.isfinite(metrics[0]["loss"])
    assert 0 < metrics[0]["engine_logprob_share"] < 1


def test_loop_reports_a_data_error_as_one_error(tmp_path, tiny_qwen_dir, samples):
    from openforge.rl.errors import RLError

    rows, bad_id = damaged(samples, "nan_advantage")
    with pytest.raises(RLError, match=f"training refused: .*{bad_id}"):
        loop_train(tmp_path, tiny_qwen_dir, rows)


def test_nan_reward_group_gives_no_nan_checkpoint(tmp_path, tiny_qwen_dir, samples):
    """The issue's case: a NaN reward made every advantage of its group NaN and the run saved NaN weights."""
    rows = [s | {"reward": math.nan, "advantage": math.nan} if s["episode_id"] == "e001" else s for s in samples]
    db = write_samples(tmp_path / "runs.duckdb", rows)
    cfg = config(tmp_path, tiny_qwen_dir, db)
    with pytest.raises(DataError, match="s0001"):
        train(cfg, say=lambda _: None)
    assert nothing_written(Path(cfg.out))
