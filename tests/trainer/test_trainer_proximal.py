"""The trust region binds (issue 27): the proximal policy's logprobs are computed once per run, before the
first update, and every later step clips against them, however its rows pack the samples (chains, trees,
two gloo ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, train_on_ranks, write_samples
from openforge.trainer.config import load_config
from openforge.trainer.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    samples = make_samples(qwen_tokenizer(), 6, seed=1, episodes=3)
    return write_samples(tmp_path_factory.mktemp("proximal") / "runs.duckdb", samples)


def run(db: Path, tiny_qwen_dir: Path, out: Path, **kw) -> list[dict]:
    """Several steps on the same selection at a rate that moves the tiny model far in one step."""
    values = dict(db=str(db), model=str(tiny_qwen_dir), out=str(out), step_tokens=4096, row_tokens=512, lr=5e-2,
                  min_lr_ratio=1.0, steps=3, grad_clip=100.0, progress=False, device="cpu") | kw
    train(load_config(None, values), say=lambda _: None)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("tree", [False, True])
def test_later_steps_clip_against_the_policy_before_the_first_update(db, tiny_qwen_dir, tmp_path, tree):
    steps = run(db, tiny_qwen_dir, tmp_path / "out", tree=tree)
    assert steps[0]["ratio_dev"] < 1e-5 and steps[0]["clip_frac"] == 0.0  # the first step's ratio is 1
    assert steps[1]["ratio_dev"] > 1e-3  # the policy moved: later steps see it against pi_prox
    assert max(m["clip_frac"] for m in steps[1:]) > 0.0, steps


def test_a_step_of_other_samples_and_another_epoch_clip_too(db, tiny_qwen_dir, tmp_path):
    """Two epochs of about half the selection per step: step 2 reads samples step 1 never trained, epoch 2
    packs them into other rows; all of them against the weights before step 1."""
    steps = run(db, tiny_qwen_dir, tmp_path / "out", step_tokens=160, row_tokens=160, steps=0, epochs=2)
    assert len(steps) >= 4 and steps[0]["ratio_dev"] < 1e-5
    assert all(m["ratio_dev"] > 1e-3 for m in steps[1:]) and max(m["clip_frac"] for m in steps[1:]) > 0


def test_two_gloo_ranks_compute_the_proximal_policy_of_their_own_shares(db, tiny_qwen_dir, tmp_path):
    one = run(db, tiny_qwen_dir, tmp_path / "one", step_tokens=160, row_tokens=160, steps=0, epochs=2)
    cfg = load_config(None, dict(db=str(db), model=str(tiny_qwen_dir), out=str(tmp_path / "two"), step_tokens=160,
                                 row_tokens=160, lr=5e-2, min_lr_ratio=1.0, epochs=2, grad_clip=100.0,
                                 progress=False, device="cpu"))
    train_on_ranks(cfg, world_size=2)
    two = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert len(one) == len(two)
    for a, b in zip(one, two):
        for key in ("loss", "clip_frac", "ratio_dev", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key
