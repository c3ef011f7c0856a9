"""End to end on a real DuckDB and a tiny Qwen3 with the real Qwen3 vocabulary: the loop, checkpoints,
resume, 2 gloo processes, and the CLI's errors.

One 2-step run (`baseline`, a checkpoint after each step) serves three tests: its checkpoint is loaded in
transformers, it is interrupted and resumed, and the 2-rank run must reproduce it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from openforge.commands import train as train_command
from tests.support.trainer_samples import (  # noqa: F401  (fixtures)
    make_samples,
    one_torch_thread,
    qwen_tokenizer,
    tiny_qwen_dir,
    train_on_ranks,
    write_samples,
)
from trainer.config import load_config
from trainer.train import train


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_qwen_dir):
    base = tmp_path_factory.mktemp("trainer")
    samples = make_samples(qwen_tokenizer(), 8, seed=0, episodes=4)
    db = write_samples(base / "runs.duckdb", samples)
    return base, tiny_qwen_dir, db, samples


def config(setup, out: str, **kw):
    base, model, db, _ = setup
    values = dict(db=str(db), model=str(model), out=str(base / out), step_tokens=160, row_tokens=160,
                  lr=3e-3, steps=2, progress=False) | kw
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
    missing = run_cli("--db", str(no_logprobs), *common[2:])
    assert missing.exit_code == 1
    assert "3 of 3 selected samples have no behaviour_logprobs" in missing.output and "s0000" in missing.output
    assert run_cli("--db", str(no_logprobs), *common[2:], "--objective", "sft", "--steps", "1",
                   "--set", "progress=false").exit_code == 0

    other_vocab = write_samples(tmp_path / "vocab.duckdb", samples[:2], tokenizer_name="smollm2", vocab_size=49152)
    mismatch = run_cli("--db", str(other_vocab), *common[2:])
    assert mismatch.exit_code == 1 and "tokenizer/model mismatch" in mismatch.output and "49152" in mismatch.output

    bad_key = run_cli(*common, "--set", "learning_rate=1")
    assert bad_key.exit_code == 1 and "unknown config key(s): learning_rate" in bad_key.output
