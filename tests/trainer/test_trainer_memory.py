"""Memory options compute what the plain path computes: log-probs projected `logit_chunk` positions at a time
(each chunk recomputed in backward) and activation checkpointing give the same loss, metrics and gradients."""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch

from openforge.settings import ConfigError
from openforge.testing.trainer_samples import tiny_model
from openforge.testing.trainer_tree import assert_same_step, run_rows
from openforge.trainer.config import TrainConfig
from openforge.trainer.data import Sample
from openforge.trainer.loss import logit_positions, target_logprobs
from openforge.trainer.model import load_model
from openforge.trainer.packing import coefficients, make_row, plan_rows
from openforge.trainer.tree import tree_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 96


def sample(i: int, ids: np.ndarray, start: int, seed: int = 0) -> Sample:
    """Tokens from `start` on trainable, with engine-like logprobs there."""
    mask = np.arange(len(ids)) >= start
    rng = np.random.default_rng(seed * 100 + i)
    return Sample(f"s{i:02d}", f"e{i % 2}", np.asarray(ids, dtype=np.int64), mask,
                  np.where(mask, -rng.uniform(0.5, 6, len(ids)), np.nan).astype(np.float32), float(rng.normal()),
                  1.0, float(rng.uniform(0.2, 1.0)))


def batch() -> list[Sample]:
    """Chains of several lengths, and a retry and a fork sharing their prefixes (a tree of 4 leaves)."""
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, VOCAB, 30)
    samples = [sample(i, rng.integers(0, VOCAB, n), n // 3) for i, n in enumerate([41, 17, 58, 9])]
    samples += [sample(4 + i, np.concatenate([trunk[:cut], rng.integers(0, VOCAB, extra)]), cut - 5)
                for i, (cut, extra) in enumerate([(30, 12), (30, 20), (22, 15), (12, 3)])]
    return samples


def rows_of(kind: str, samples: list[Sample], cfg: TrainConfig) -> list:
    coef = coefficients(samples, cfg.aggregation)
    if kind == "tree":
        return tree_rows(samples, coef, 64)
    packing = kind == "packed"
    return [make_row(g, coef, packing) for g in plan_rows(samples, 64, packing)]


def tiny_llama(seed: int = 0):
    """A 2-layer Llama with an untied LM head (SmolLM2's architecture family)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        tie_word_embeddings=False)).eval()


@pytest.fixture(scope="module")
def models():
    return {"qwen3": (tiny_model(VOCAB, hidden=32), tiny_model(VOCAB, hidden=32, seed=1).requires_grad_(False)),
            "llama": (tiny_llama(), tiny_llama(seed=1).requires_grad_(False))}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["packed", "padded", "tree"])
@pytest.mark.parametrize("objective, kl_coef", [("ppo", 0.0), ("ppo", 0.3), ("sft", 0.0)])
def test_chunked_logprobs_equal_all_at_once(models, arch, kind, objective, kl_coef):
    model, ref = models[arch]
    samples = batch()
    base = TrainConfig(objective=objective, kl_coef=kl_coef, aggregation="episode-mean", logit_chunk=0)
    rows = rows_of(kind, samples, base)
    assert max(len(logit_positions(r)) for r in rows) > 7  # several chunks, the last one partial
    ref = ref if kl_coef else None
    whole = run_rows(model, rows, base, ref)
    assert whole[1]["trainable"] == sum(int(s.loss_mask[1:].sum()) for s in samples)
    for chunk in (1, 7, 4096):
        assert_same_step(run_rows(model, rows, dataclasses.replace(base, logit_chunk=chunk), ref), whole)


def test_one_chunk_of_logits_at_a_time_recomputed_in_backward(models):
    """The head sees at most `chunk` positions per call, and backward projects each chunk once more
    (its logits were not kept)."""
    model = models["qwen3"][0]
    samples = batch()
    row = rows_of("packed", samples, TrainConfig())[0]
    positions = logit_positions(row)
    with torch.no_grad():
        hidden = model(input_ids=row.input_ids, position_ids=row.position_ids, use_cache=False,
                       output_hidden_states=True).hidden_states[-1][:, positions]
    hidden.requires_grad_()
    head, seen = model.get_output_embeddings(), []
    handle = head.register_forward_hook(lambda _m, args, _out: seen.append(len(args[0])))
    try:
        logp, _ = target_logprobs(hidden, head, row, positions, chunk=7)
        chunks = -(-len(positions) // 7)
        assert max(seen) == 7 and len(seen) == chunks
        logp.sum().backward()
        assert len(seen) == 2 * chunks
    finally:
        handle.remove()


def test_grad_checkpointing_recomputes_blocks_and_gives_the_same_step(tiny_qwen_dir):
    cfg = TrainConfig(kl_coef=0.0)
    samples = batch()
    rows = rows_of("packed", samples, cfg)
    plain = load_model(str(tiny_qwen_dir), torch.device("cpu"))
    checkpointed = load_model(str(tiny_qwen_dir), torch.device("cpu"), grad_checkpointing=True)
    calls = []
    checkpointed.model.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    assert_same_step(run_rows(checkpointed, rows, cfg), run_rows(plain, rows, cfg))
    assert len(calls) == 2 * len(rows) + len(rows)  # old policy (no grad): once; with grad: forward + recompute


def test_logit_chunk_must_not_be_negative():
    with pytest.raises(ConfigError, match="logit_chunk must be >= 0"):
        TrainConfig(logit_chunk=-1).validate()


FRAGMENTS = """
import sys, torch
from openforge.trainer.allocator import return_freed_memory
if sys.argv[1] == "1":
    assert return_freed_memory()
def anon_mib():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon")) // 1024
torch.empty(16 << 20, dtype=torch.uint8).fill_(1)  # freed at once: glibc's mmap threshold rises to 16 MiB
before = anon_mib()
big, small = [], []
for _ in range(64):  # 4 MiB transients between small long-lived tensors, as a step's activations and metrics
    big.append(torch.ones(4 << 20, dtype=torch.uint8))
    small.append(torch.ones(64))
del big
print(anon_mib() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator setting")
def test_freed_tensors_leave_the_process() -> None:
    """With the trainer's allocator setting, 256 MiB of freed 4 MiB tensors no longer stay resident behind
    small live ones (glibc as it comes keeps them: its raised mmap threshold serves them from the heap)."""
    def kept_mib(setting: str) -> int:
        out = subprocess.run([sys.executable, "-c", FRAGMENTS, setting], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    assert kept_mib("0") >= 128
    assert kept_mib("1") <= 16
