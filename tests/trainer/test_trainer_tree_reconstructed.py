"""Tree mode on trees the real reconstructor builds: flow files (real FlowWriter, Qwen3 tokenizer and chat
template) of a retry, a subagent and a template fork -> `reconstruct` -> DuckDB -> `SampleSource` -> tree rows
equal to chain rows (loss, metrics, gradients) on a tiny Qwen3 of the real vocabulary, on fewer tokens."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from openforge.reconstruct import reconstruct
from openforge.testing.reconstruct_flows import BASH, FlowFactory, db_rows, qwen_retokenizer
from openforge.testing.trainer_samples import tiny_model
from openforge.testing.trainer_tree import assert_same_run, assert_tree_equals_chains, computed, run_metrics
from openforge.trainer.config import TrainConfig, load_config
from openforge.trainer.data import Sample, SampleSource
from openforge.trainer.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EPISODES = ("retry", "subagent", "fork")


def write_flows(flows: Path) -> None:
    """One task, three episodes, each a tree of several samples:
    - retry: a 2-tool-call loop whose final answer is asked for again (same prompt, another completion);
    - subagent: a loop, then a second conversation in the same episode with the same system prompt and tools;
    - fork: a loop with a user turn after each tool result, whose prompts drop the earlier turns' reasoning
      (Qwen3's template): template drift, each later call a new sample sharing the prefix up to the drift."""
    f = FlowFactory(flows, seed=21)
    last = json.loads(f.tool_loop("retry", turns=2)[-1]["upstream_request"]["body"])
    f.write(f.chat(last["messages"], {"content": "Three test files.", "reasoning_content": "Count again."},
                   tools=[BASH], episode="retry"))
    f.tool_loop("subagent", turns=2)
    f.tool_loop("subagent", turns=1, task="Read setup.py and list its dependencies")
    f.tool_loop("fork", turns=2, new_user_turns=True)
    for episode, reward in zip(EPISODES, (1.0, 0.0, 1.0)):  # one task: GRPO advantages of both signs
        f.write(f.reward(episode, reward, "task"))
    f.close()


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree_reconstructed")
    write_flows(root / "flows")
    summary = reconstruct([root / "flows"], root / "runs.duckdb", qwen_retokenizer())
    assert (summary.episodes, summary.samples, summary.drift) == (3, 7, {"template": 2})
    return root / "runs.duckdb"


@pytest.fixture(scope="module")
def episodes(db: Path) -> dict[str, list[Sample]]:
    """The samples as the trainer reads them in tree mode (an episode's samples together)."""
    with SampleSource(str(db), shuffle=False, tree=True) as source:
        samples = list(source.samples(0))
    out: dict[str, list[Sample]] = {}
    for s in samples:
        out.setdefault(s.episode_id, []).append(s)
    assert [len(out[e]) for e in EPISODES] == [2, 2, 3]
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model(hidden=32)


def shared(a: Sample, b: Sample) -> int:
    """How long a prefix two samples share in the tree: equal tokens, none trainable in both (a completion
    is trained once; two samples each generating the same token train it twice, as chains do)."""
    n = min(len(a), len(b))
    split = (a.input_ids[:n] != b.input_ids[:n]) | (a.loss_mask[:n] & b.loss_mask[:n])
    return int(np.argmax(split)) if split.any() else n


def tree_tokens(samples: list[Sample]) -> int:
    """The nodes of the samples' tree: each sample adds what it does not share with an earlier one."""
    return sum(len(s) - max((shared(s, t) for t in samples[:i]), default=0) for i, s in enumerate(samples))


@pytest.mark.parametrize("episode", EPISODES)
@pytest.mark.parametrize("aggregation,objective", [("token-mean", "ppo"), ("seq-mean", "ppo"), ("token-mean", "sft")])
def test_a_reconstructed_tree_trains_as_its_chains(model, episodes, episode, aggregation, objective):
    samples = episodes[episode]
    row_tokens = sum(len(s) for s in samples)  # one row: the whole tree, or all chains packed
    cfg = TrainConfig(aggregation=aggregation, objective=objective)
    chains, trees = assert_tree_equals_chains(model, samples, cfg, row_tokens)
    assert computed(trees) == tree_tokens(samples) < computed(chains)


def test_the_retry_computes_its_prompt_once(episodes):
    """The retried call's whole prompt (the loop up to its last turn) is computed once."""
    first, retry = episodes["retry"]
    prompt = len(retry) - int(retry.loss_mask.sum())  # the retry trains its own completion only
    assert shared(first, retry) == prompt and tree_tokens([first, retry]) == len(first) + len(retry) - prompt


def test_the_subagent_shares_the_system_prompt_and_tools(episodes):
    parent, sub = episodes["subagent"]
    start = int(np.argmax(sub.loss_mask))  # the subagent's first completion: its prompt ends here
    assert 100 < shared(parent, sub) < start  # system prompt and tools, not the task


def test_a_template_fork_shares_the_prefix_up_to_the_drift(episodes):
    """Each drifted call starts a sample whose prompt differs from the previous sample's tokens where the
    template dropped the reasoning: shared up to there, so less than the earlier sample but more than nothing."""
    a, b, c = episodes["fork"]
    assert 0 < shared(a, b) < len(a) and 0 < shared(b, c) < len(b)
    assert tree_tokens([a, b, c]) < len(a) + len(b) + len(c)


def test_all_episodes_in_rows_smaller_than_a_tree_split_at_branch_points(model, episodes):
    samples = [s for e in EPISODES for s in episodes[e]]
    row_tokens = max(len(s) for s in samples) + 16  # no episode's tree fits one row
    chains, trees = assert_tree_equals_chains(model, samples, TrainConfig(aggregation="episode-mean"), row_tokens)
    assert len(trees) > 1 and computed(trees) < computed(chains)


def test_train_in_tree_mode_on_reconstructed_samples_equals_chains(db, tiny_qwen_dir):
    """`train` end to end on the reconstructed DuckDB: two steps, chains vs tree."""
    tokens = sum(r["n_tokens"] for r in db_rows(db, "SELECT n_tokens FROM samples"))
    common = dict(db=str(db), model=str(tiny_qwen_dir), lr=3e-3, row_tokens=1024, step_tokens=tokens, steps=2,
                  shuffle=False, progress=False)
    chains = load_config(None, common | dict(out=str(db.parent / "chains")))
    tree = load_config(None, common | dict(out=str(db.parent / "tree"), tree=True))
    train(chains, say=lambda _: None), train(tree, say=lambda _: None)
    assert_same_run(chains, tree)
    assert all(t["computed_tokens"] < c["computed_tokens"] for c, t in zip(run_metrics(chains), run_metrics(tree)))
