"""Tree mode computes what the chains compute: the same loss, gradients and metric sums (fp32 tolerance),
on fewer computed tokens; end to end through `train` on 1 and 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, tiny_model, train_on_ranks, write_samples
from openforge.testing.trainer_tree import assert_same_run, assert_tree_equals_chains, computed, run_metrics
from openforge.trainer.config import TrainConfig, load_config
from openforge.trainer.data import Sample, SampleSource
from openforge.trainer.train import train
from openforge.trainer.tree import build_tree

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 64


def sample(i: int, ids, trainable, episode: str = "e0", seed: int = 0) -> Sample:
    """A chain with engine-like logprobs on its trainable tokens; `trainable` is a mask or a start index."""
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.asarray(trainable, bool) if np.ndim(trainable) else np.arange(len(ids)) >= trainable
    mask[0] = False
    rng = np.random.default_rng(seed * 1000 + i)
    return Sample(f"s{i:03d}", episode, ids, mask, np.where(mask, -rng.uniform(0.5, 6, len(ids)), np.nan)
                  .astype(np.float32), float(rng.normal()), 1.0, float(rng.uniform(0.2, 1.0)))


def tokens(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, VOCAB, n)


@pytest.fixture(scope="module")
def model():
    return tiny_model(VOCAB, hidden=32)


def test_a_retry_computes_its_prompt_once(model):
    rng = np.random.default_rng(0)
    prompt = tokens(40, rng)
    retry = [sample(0, np.r_[prompt, tokens(12, rng)], 40), sample(1, np.r_[prompt, tokens(9, rng)], 40)]
    chains, trees = assert_tree_equals_chains(model, retry, TrainConfig(), row_tokens=128)
    assert computed(chains) == 40 + 12 + 40 + 9 and computed(trees) == 40 + 12 + 9


@pytest.mark.parametrize("aggregation,objective,kl", [("token-mean", "ppo", 0.0), ("seq-mean", "ppo", 0.1),
                                                      ("episode-mean", "ppo", 0.0), ("token-mean", "sft", 0.0)])
def test_a_three_way_branch_after_a_shared_turn(model, aggregation, objective, kl):
    """A first turn (trained in the first leaf only, as reconstruct marks it), then three different turns."""
    rng = np.random.default_rng(1)
    prompt, turn, tool = tokens(20, rng), tokens(8, rng), tokens(6, rng)
    head = np.r_[prompt, turn, tool]
    leaves = []
    for i, n in enumerate((10, 7, 12)):
        ids = np.r_[head, tokens(n, rng)]
        mask = np.arange(len(ids)) >= len(head)
        if i == 0:
            mask[20:28] = True  # the shared first turn is trainable in the first leaf below it
        leaves.append(sample(i, ids, mask, episode=f"e{i % 2}"))
    ref = tiny_model(VOCAB, hidden=32, seed=1) if kl else None
    cfg = TrainConfig(aggregation=aggregation, objective=objective, kl_coef=kl)
    _, trees = assert_tree_equals_chains(model, leaves, cfg, row_tokens=128, ref=ref)
    assert computed(trees) == len(head) + 10 + 7 + 12
    assert int(trees[0].loss_mask.sum()) == 8 + 10 + 7 + 12


def test_a_tree_larger_than_a_row_splits_at_branch_points(model):
    rng = np.random.default_rng(2)
    prompt = tokens(30, rng)
    leaves = [sample(i, np.r_[prompt, tokens(n, rng)], 30) for i, n in enumerate((8, 10, 12, 9, 11))]
    deep = np.r_[prompt, tokens(10, rng)]
    leaves += [sample(5 + i, np.r_[deep, tokens(n, rng)], 40) for i, n in enumerate((6, 7))]
    chains, trees = assert_tree_equals_chains(model, leaves, TrainConfig(), row_tokens=64)
    assert len(trees) > 1 and computed(trees) < computed(chains)


def test_a_single_chain_is_the_chain_row(model):
    rng = np.random.default_rng(3)
    one = [sample(0, tokens(50, rng), 20)]
    chains, trees = assert_tree_equals_chains(model, one, TrainConfig(), row_tokens=64)
    (chain,), (tree,) = chains, trees
    assert torch.equal(tree.input_ids, chain.input_ids) and torch.equal(tree.position_ids, chain.position_ids)
    assert torch.equal(tree.loss_mask, chain.loss_mask) and torch.equal(tree.coef, chain.coef)
    assert torch.equal(tree.attention_mask[0, 0], torch.ones(50, 50, dtype=torch.bool).tril())


def test_a_token_trainable_in_two_samples_is_not_merged(model):
    """Two identical samples (two episodes sampled the same reply) both train their reply, as chains do."""
    rng = np.random.default_rng(4)
    ids = tokens(30, rng)
    twins = [sample(0, ids, 10, episode="e0"), sample(1, ids, 10, episode="e1")]
    _, trees = assert_tree_equals_chains(model, twins, TrainConfig(), row_tokens=64)
    assert computed(trees) == 10 + 2 * 20


@st.composite
def trees(draw) -> list[Sample]:
    """Random episodes: each new leaf forks an earlier one at a random depth and adds turns of its own.

    A tiny alphabet makes accidental merges of the new tokens common; the forked prefix is trainable only
    in the first leaf (as reconstruct marks it), except sometimes (a duplicate sample: trained twice).
    """
    alphabet = draw(st.integers(2, VOCAB))
    chains: list[list[int]] = []
    masks: list[list[bool]] = []
    for _ in range(draw(st.integers(1, 6))):
        if chains:
            j = draw(st.integers(0, len(chains) - 1))
            cut = draw(st.integers(1, len(chains[j])))
            ids, mask = chains[j][:cut], [m and draw(st.booleans()) and draw(st.booleans())
                                          for m in masks[j][:cut]]
        else:
            ids, mask = [], []
        for _ in range(draw(st.integers(1, 3))):
            n_prompt, n_reply = draw(st.integers(0, 6)), draw(st.integers(1, 6))
            ids = ids + draw(st.lists(st.integers(0, alphabet - 1), min_size=n_prompt + n_reply,
                                      max_size=n_prompt + n_reply))
            mask = mask + [False] * n_prompt + [True] * n_reply
        mask[0] = False
        if not any(mask):
            ids, mask = ids + [0], mask + [True]
        chains.append(ids), masks.append(mask)
    episodes = draw(st.integers(1, 2))
    return [sample(i, ids, mask, episode=f"e{i % episodes}", seed=draw(st.integers(0, 99)))
            for i, (ids, mask) in enumerate(zip(chains, masks))]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(samples=trees(), row_tokens=st.sampled_from([48, 64, 256]),
       aggregation=st.sampled_from(["token-mean", "seq-mean", "episode-mean"]))
def test_random_trees_equal_their_chains(model, samples, row_tokens, aggregation):
    row_tokens = max(row_tokens, max(len(s) for s in samples))
    assert_tree_equals_chains(model, samples, TrainConfig(aggregation=aggregation), row_tokens)
    tree = build_tree(samples)
    assert len(tree) <= sum(len(s) for s in samples)
    assert sum(tree.count) == sum(len(s) for s in samples)


# --- end to end: the data order, and `train` on the real tiny Qwen3 (chains vs tree; 1 vs 2 gloo ranks)

def retries(tokenizer) -> list[dict]:
    """Chat samples, each with a retry in its episode: the same prompt, the reply's tokens reversed."""
    out = []
    for s in make_samples(tokenizer, 6, seed=3):
        start = s["loss_mask"].index(1)
        retry = dict(s, sample_id=s["sample_id"] + "r", input_ids=s["input_ids"][:start] + s["input_ids"][start:][::-1],
                     behaviour_logprobs=s["behaviour_logprobs"][:start] + s["behaviour_logprobs"][start:][::-1])
        out += [dict(s, weight=0.5), dict(retry, weight=0.5)]
    return out


@pytest.fixture(scope="module")
def tree_db(tmp_path_factory) -> Path:
    return write_samples(tmp_path_factory.mktemp("tree") / "runs.duckdb", retries(qwen_tokenizer()))


def test_tree_order_reads_episodes_together(tree_db):
    with SampleSource(str(tree_db), seed=7, tree=True) as source:
        episodes = [s.episode_id for s in source.samples(0)]
    assert len(episodes) == 12 and all(episodes.count(e) == 2 for e in episodes)
    assert all(episodes[i] == episodes[i + 1] for i in range(0, 12, 2))  # each episode's two samples adjacent


def tree_config(tree_db: Path, tiny_qwen_dir: Path, out: str, **kw) -> TrainConfig:
    values = dict(db=str(tree_db), model=str(tiny_qwen_dir), out=str(tree_db.parent / out), lr=3e-3, row_tokens=256,
                  step_tokens=4096, steps=1, shuffle=False, tree=True, progress=False, device="cpu") | kw
    return load_config(None, values)


def test_train_in_tree_mode_equals_chains(tree_db, tiny_qwen_dir):
    """One global batch of all 12 samples (episode order == sample_id order here), chains vs tree."""
    chains = tree_config(tree_db, tiny_qwen_dir, "chains", tree=False)
    tree = tree_config(tree_db, tiny_qwen_dir, "tree_one_step")
    train(chains, say=lambda _: None), train(tree, say=lambda _: None)
    assert_same_run(chains, tree)
    assert run_metrics(tree)[0]["computed_tokens"] < run_metrics(chains)[0]["computed_tokens"]


def test_tree_mode_on_two_gloo_processes_matches_one(tree_db, tiny_qwen_dir):
    one = tree_config(tree_db, tiny_qwen_dir, "tree_one_rank", step_tokens=600, steps=2, shuffle=True)
    two = tree_config(tree_db, tiny_qwen_dir, "tree_two_ranks", step_tokens=600, steps=2, shuffle=True)
    train(one, say=lambda _: None)
    train_on_ranks(two, world_size=2)
    assert_same_run(one, two)
