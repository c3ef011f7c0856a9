"""`tree = "auto"`: per batch, tree rows when they compute fewer tokens than packed chains (the same loss and
gradients), chains when nothing is shared; the choice said once in the log."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from openforge.settings import ConfigError
from openforge.testing.trainer_samples import qwen_tokenizer, tiny_model, write_samples
from openforge.testing.trainer_tree import assert_same_run, assert_same_step, computed, run_metrics, run_rows
from openforge.trainer.config import TrainConfig, load_config
from openforge.trainer.packing import coefficients
from openforge.trainer.train import rows_of, train
from openforge.trainer.tree import TreeChoice, kilo
from tests.trainer.test_trainer_tree import VOCAB, sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, hidden=32)


def choose(samples, cfg: TrainConfig):
    """rows_of with an auto TreeChoice: (rows, the chain rows of the same samples, what it said)."""
    said: list[str] = []
    coef = coefficients(samples, cfg.aggregation)
    rows = rows_of(samples, coef, cfg, trees=TreeChoice(cfg.tree, cfg.row_tokens, said.append))
    return rows, rows_of(samples, coef, TrainConfig(row_tokens=cfg.row_tokens)), said


def test_a_long_shared_prompt_is_trained_as_a_tree(model):
    """A GRPO group: four episodes over the same 120-token prompt, each its own reply."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, 120)
    group = [sample(i, np.r_[prompt, rng.integers(0, VOCAB, 10 + i)], 120, episode=f"e{i}") for i in range(4)]
    cfg = TrainConfig(tree="auto", row_tokens=256)
    rows, chains, said = choose(group, cfg)
    assert all(r.parent is not None for r in rows) and computed(rows) == 120 + 10 + 11 + 12 + 13
    assert said == [f"tree mode: {computed(rows)} tokens computed instead of {computed(chains)} "
                    f"({computed(chains) / computed(rows):.1f}x fewer)"]
    assert_same_step(run_rows(model, rows, cfg), run_rows(model, chains, cfg))


def test_nothing_shared_stays_chains(model):
    rng = np.random.default_rng(1)
    apart = [sample(i, np.r_[i, rng.integers(0, VOCAB, 30)], 5, episode=f"e{i}") for i in range(3)]
    cfg = TrainConfig(tree="auto", row_tokens=64)
    rows, chains, said = choose(apart, cfg)
    assert all(r.parent is None for r in rows) and computed(rows) == computed(chains) == 3 * 31
    assert len(said) == 1 and said[0].startswith("packed chains: 93 tokens computed (tree mode would compute 93")


def test_the_choice_is_said_once_per_mode():
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, VOCAB, 40)
    shared = [sample(i, np.r_[prompt, rng.integers(0, VOCAB, 5)], 40, episode=f"e{i}") for i in range(2)]
    apart = [sample(i, np.r_[i, rng.integers(0, VOCAB, 20)], 5, episode=f"e{i}") for i in range(2)]
    said: list[str] = []
    choice = TreeChoice("auto", 128, said.append)
    for batch in (shared, apart, shared, apart):
        coef = coefficients(batch, "token-mean")
        rows_of(batch, coef, TrainConfig(tree="auto", row_tokens=128), trees=choice)
    assert [line.split(":")[0] for line in said] == ["tree mode", "packed chains"]


def test_tree_takes_true_false_and_auto():
    assert [load_config(None, {"tree": v}).tree for v in ("auto", "true", "false", True)] == ["auto", True, False, True]
    with pytest.raises(ConfigError, match="'auto'"):
        load_config(None, {"tree": "sometimes"})


def grpo_group(tokenizer, n: int) -> list[dict]:
    """n episodes of one task: a long few-shot system prompt, the same question, different answers."""
    system = "You are a careful calculator. " + " ".join(f"Example {k}: {k} plus {k} is {2 * k}." for k in range(30))
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": system},
                                            {"role": "user", "content": "What is 17 plus 25?"}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        reply = tokenizer.encode(f"The answer is {40 + i}. " * int(rng.integers(1, 4)), add_special_tokens=False)
        full = ids + reply + [end]
        lp = [float("nan")] * len(ids) + (-rng.uniform(0.5, 4.0, len(reply) + 1)).tolist()
        out.append({"sample_id": f"s{i:04d}", "episode_id": f"e{i:03d}", "input_ids": full,
                    "loss_mask": [0] * len(ids) + [1] * (len(reply) + 1), "behaviour_logprobs": lp,
                    "reward": float(i % 2), "advantage": i % 2 - 0.5, "weight": 1.0})
    return out


def test_train_auto_equals_chains_and_says_so(tmp_path: Path, tiny_qwen_dir):
    db = write_samples(tmp_path / "group.duckdb", grpo_group(qwen_tokenizer(), 6))
    values = dict(db=str(db), model=str(tiny_qwen_dir), lr=3e-3, row_tokens=1024, step_tokens=4096, steps=1,
                  shuffle=False, progress=False)
    chains, auto = (load_config(None, values | {"out": str(tmp_path / name), "tree": tree})
                    for name, tree in (("chains", False), ("auto", "auto")))
    said: list[str] = []
    train(chains, say=lambda _: None)
    train(auto, say=said.append)
    assert_same_run(chains, auto)
    tree_tokens, chain_tokens = run_metrics(auto)[0]["computed_tokens"], run_metrics(chains)[0]["computed_tokens"]
    assert chain_tokens > 3 * tree_tokens
    assert [x for x in said if x.startswith("tree mode")] == [
        f"tree mode: {kilo(tree_tokens)} tokens computed instead of {kilo(chain_tokens)} "
        f"({chain_tokens / tree_tokens:.1f}x fewer)"]
