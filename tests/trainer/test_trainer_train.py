"""End to end on a real DuckDB and a tiny Qwen3 with the real Qwen3 vocabulary: the loop, checkpoints,
resume, 2 gloo processes, and the CLI's errors.

One 2-step run (`baseline`, a checkpoint after each step) serves three tests: its checkpoint is loaded in
transformers, it is interrupted and resumed, and the 2-rank run must reproduce it.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from openforge.commands import train as train_command
from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, train_on_ranks, write_samples
from openforge.trainer.config import load_config
from openforge.trainer.data import DataError
from openforge.trainer.train import lr_factor, train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_qwen_dir):
    base = tmp_path_factory.mktemp("trainer")
    samples = make_samples(qwen_tokenizer(), 8, seed=0, episodes=4)
    db = write_samples(base / "runs.duckdb", samples)
    return base, tiny_qwen_dir, db, samples


def config(setup, out: str, **kw):
    base, model, db, _ = setup
    values = dict(db=str(db), model=str(model), out=str(base / out), step_tokens=160, row_tokens=160,
                  lr=3e-3, steps=2, progress=False, device="cpu") | kw
    return load_config(None, values)


@pytest.fixture(scope="module")
def baseline(setup) -> Path:
    """Two PPO steps of ~4 samples each on one process, checkpointed after each step."""
    cfg = config(setup, "baseline", save_every=1)
    train(cfg, say=lambda _: None)
    return Path(cfg.out)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(ckpt / "model.safetensors")


def test_sft_overfits_a_fixed_batch(setup):
    cfg = config(setup, "overfit", objective="sft", where="sample_id IN ('s0000', 's0001')", step_tokens=4096,
                 row_tokens=256, steps=5, lr=2e-2, grad_clip=100.0, min_lr_ratio=1.0)
    train(cfg, say=lambda _: None)
    losses = [m["loss"] for m in metrics(Path(cfg.out))]
    assert all(m["samples"] == 2 for m in metrics(Path(cfg.out)))  # the same global batch every step
    assert losses[-1] < 0.7 * losses[0] and losses[-1] == min(losses), losses


def test_checkpoint_loads_in_transformers_with_identical_logits(setup, baseline):
    from transformers import AutoModelForCausalLM

    model_dir = setup[1]
    ckpt = baseline / "checkpoints" / "step_000002"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "trainer_state.pt").is_file()
    assert (ckpt / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    # the saved tensors are the trained ones (not the start), and loading them reproduces their logits
    trained = weights(ckpt)
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained[name], weights(model_dir)[name])
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference.load_state_dict(trained, strict=False)
    reference.tie_weights()
    ids = torch.tensor([setup[3][0]["input_ids"]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_resume_gives_the_same_next_step(setup, baseline):
    # an "interrupted" run: the baseline stopped after step 1's checkpoint
    cut = setup[0] / "interrupted"
    shutil.copytree(baseline, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000002")
    train(config(setup, "interrupted", save_every=1), resume=True, say=lambda _: None)
    a, b = metrics(baseline), metrics(cut)
    assert [m["step"] for m in b] == [1, 2]
    for key in ("loss", "grad_norm", "lr", "samples", "tokens", "is_ratio_mean"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-6), key
    wa, wb = weights(baseline / "checkpoints" / "step_000002"), weights(cut / "checkpoints" / "step_000002")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=0, atol=1e-7)


def test_two_gloo_processes_match_one_process(setup, baseline):
    two = config(setup, "two_ranks")
    train_on_ranks(two, world_size=2)
    a, b = metrics(baseline), metrics(Path(two.out))
    assert len(a) == len(b) == 2
    for ma, mb in zip(a, b):
        assert mb["samples"] == ma["samples"] and mb["tokens"] == ma["tokens"]
        for key in ("loss", "grad_norm", "entropy", "is_ratio_mean", "clip_frac"):
            assert mb[key] == pytest.approx(ma[key], rel=1e-4, abs=1e-7), key
    wa = weights(baseline / "checkpoints" / "step_000002")
    wb = weights(Path(two.out) / "checkpoints" / "step_000002")
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-4, atol=1e-5)


def run_cli(*args: str):
    app = typer.Typer()
    train_command.register(app)
    app.command(name="noop")(lambda: None)  # with two commands typer keeps the `train` name
    return CliRunner().invoke(app, ["train", *args])


def test_cli_explains_bad_input(setup, tmp_path):
    base, model, db, samples = setup
    common = ["--db", str(db), "--model", str(model), "--out", str(tmp_path / "out")]

    empty = run_cli(*common, "--where", "reward > 100")
    assert empty.exit_code == 1 and "no samples selected" in empty.output and "Traceback" not in empty.output

    too_long = run_cli(*common, "--row-tokens", "20", "--step-tokens", "40")
    longest = max(len(s["input_ids"]) for s in samples)
    assert too_long.exit_code == 1
    assert "8 of 8 selected samples are longer than row_tokens=20" in too_long.output
    assert f"longest: {longest}" in too_long.output and "--where 'n_tokens <= 20'" in too_long.output

    no_logprobs = write_samples(tmp_path / "nolp.duckdb", make_samples(qwen_tokenizer(), 3, logprobs=False))
    missing = run_cli("--db", str(no_logprobs), *common[2:], "--set", "old_policy=engine")
    assert missing.exit_code == 1
    assert "3 of 3 selected samples have no behaviour_logprobs" in missing.output and "s0000" in missing.output
    assert run_cli("--db", str(no_logprobs), *common[2:], "--objective", "sft", "--steps", "1",
                   "--set", "progress=false").exit_code == 0

    other_vocab = write_samples(tmp_path / "vocab.duckdb", samples[:2], tokenizer_name="smollm2", vocab_size=49152)
    mismatch = run_cli("--db", str(other_vocab), *common[2:])
    assert mismatch.exit_code == 1 and "tokenizer/model mismatch" in mismatch.output and "49152" in mismatch.output

    bad_key = run_cli(*common, "--set", "learning_rate=1")
    assert bad_key.exit_code == 1 and "unknown config key(s): learning_rate" in bad_key.output

    not_a_table = tmp_path / "train.toml"
    not_a_table.write_text("train = 5\n")
    for bad_config in (run_cli(*common, "--config", str(not_a_table)), run_cli(*common, "--lr", "nan"),
                       run_cli(*common, "--set", "betas=0.9")):
        assert bad_config.exit_code == 1 and "error:" in bad_config.output, bad_config.output
        assert isinstance(bad_config.exception, SystemExit), bad_config.exception


def test_cli_help_shows_the_train_table():
    help_text = run_cli("--help").output
    assert "(flat or )" not in help_text and "[train]" in help_text, help_text


def test_logged_lr_is_the_rate_the_step_used(baseline):
    cfg = load_config(None, {"lr": 3e-3, "steps": 2})
    assert [m["lr"] for m in metrics(baseline)] == pytest.approx([3e-3 * lr_factor(s, cfg, 2) for s in (0, 1)])
    assert metrics(baseline)[0]["lr"] == pytest.approx(3e-3)  # no warmup: the first step runs at the peak rate


def test_ppo_recomputes_the_old_policy_when_engine_logprobs_are_missing(setup, tmp_path):
    """Samples without engine logprobs train (importance weight 1); the metrics say how many had them."""
    rows = [s | {"behaviour_logprobs": None} if i % 3 == 0 else s for i, s in enumerate(setup[3])]
    db = write_samples(tmp_path / "mixed.duckdb", rows)
    cfg = config(setup, str(tmp_path / "out"), db=str(db), step_tokens=4096, row_tokens=256, steps=1)
    train(cfg, say=lambda _: None)
    (m,) = metrics(Path(cfg.out))
    trainable = [sum(s["loss_mask"][1:]) for s in rows]
    known = sum(n for n, s in zip(trainable, rows) if s["behaviour_logprobs"] is not None)
    assert m["trainable_tokens"] == sum(trainable)
    assert m["engine_logprob_share"] == pytest.approx(known / sum(trainable))
    assert 0 < m["engine_gap_mean"] < 10 and m["clip_frac"] == 0.0  # r == 1 at the step's first forward
    assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) and m["grad_norm"] > 0

    with pytest.raises(DataError, match="have no behaviour_logprobs"):
        train(config(setup, str(tmp_path / "engine"), db=str(db), old_policy="engine"), say=lambda _: None)


def test_a_fixed_step_count_says_which_samples_it_left_untrained(setup, tmp_path):
    """8 samples at ~4 a step: 1 step leaves about half untrained, and says so (it once said nothing)."""
    said: list[str] = []
    train(config(setup, str(tmp_path / "one"), steps=1), say=said.append)
    (line,) = [x for x in said if "were not trained" in x]
    left = int(line.split()[0])
    assert 0 < left < 8 and line.startswith(f"{left} of 8 samples") and "steps = 0" in line
    said.clear()
    train(config(setup, str(tmp_path / "pass"), steps=0), say=said.append)
    assert not [x for x in said if "were not trained" in x], said
