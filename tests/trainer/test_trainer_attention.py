"""FlexAttention's masks (trainer/attention.py) on CPU: `create_mask` from the same mask_mod equals the dense
mask the sdpa path uses, for packed, padded and tree rows with their fixed-length padding; a forward pass of the
tiny Qwen3 through transformers' flex_attention gives sdpa's log-probs (no grad: FlexAttention has no backward
on CPU); the `attention` setting's choices and refusals. The GPU kernels' speed is not measured here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_mask
from transformers.masking_utils import create_causal_mask

import openforge.trainer.attention as attention
from openforge.settings import ConfigError
from openforge.testing.trainer_samples import tiny_config
from openforge.trainer.attention import choose_attention, flex_row, interval_mask, row_ends, row_length
from openforge.trainer.config import TrainConfig, load_config
from openforge.trainer.data import Sample
from openforge.trainer.model import load_model
from openforge.trainer.packing import Row, coefficients, make_row
from openforge.trainer.train import policy_logprobs
from openforge.trainer.tree import tree_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a CUDA device object needs no GPU


def sample(i: int, ids: np.ndarray, trainable_from: int) -> Sample:
    mask = np.arange(len(ids)) >= trainable_from
    mask[0] = False
    return Sample(f"s{i:03d}", "e0", ids.astype(np.int64), mask, None, float(i % 3) - 1.0, None, 1.0)


def chains(lengths: tuple[int, ...]) -> list[Sample]:
    rng = np.random.default_rng(0)
    return [sample(i, rng.integers(0, 64, n), n // 2) for i, n in enumerate(lengths)]


def branched() -> list[Sample]:
    """A shared prompt, three replies to it, and two retries forking the first reply midway (depth 3)."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 64, 30)
    first = np.r_[prompt, rng.integers(0, 64, 20)]
    ids = [first, np.r_[prompt, rng.integers(0, 64, 12)], np.r_[prompt, rng.integers(0, 64, 25)],
           np.r_[first[:40], rng.integers(0, 64, 9)], np.r_[first[:40], rng.integers(0, 64, 15)]]
    return [sample(i, x, 30 if i < 3 else 40) for i, x in enumerate(ids)]


def flex_mask(row: Row, row_tokens: int) -> torch.Tensor:
    """[B, 1, L, L]: `create_mask` of the row's mask_mod at its padded length."""
    ends = row_ends(row)
    b, n = ends.shape
    length = row_length(n, row_tokens)
    return create_mask(interval_mask(torch.nn.functional.pad(ends, (0, length - n))), b, 1, length, length)


def sdpa_mask(row: Row) -> torch.Tensor:
    """[B, 1, T, T]: the mask today's sdpa path attends with (transformers' own, from the row's inputs)."""
    if row.parent is not None:
        return row.attention_mask
    config = tiny_config(64)
    config._attn_implementation = "sdpa"
    embeds = torch.zeros(*row.input_ids.shape, config.hidden_size)
    return create_causal_mask(config, embeds, row.attention_mask, None, position_ids=row.position_ids,
                              allow_is_causal_skip=False)


def padded_to(mask: torch.Tensor, length: int) -> torch.Tensor:
    n = mask.shape[-1]
    return torch.nn.functional.pad(mask, (0, length - n, 0, length - n))


@pytest.mark.parametrize("lengths,row_tokens", [((40, 70, 3, 60), 256), ((128,), 128), ((2, 2), 4096)])
def test_packed_rows_document_mask_is_sdpas(lengths, row_tokens):
    samples = chains(lengths)
    row = make_row(samples, coefficients(samples, "token-mean"), packing=True)
    flex = flex_mask(row, row_tokens)
    assert flex.shape[-1] == row_length(sum(lengths), row_tokens)
    assert torch.equal(flex, padded_to(sdpa_mask(row), flex.shape[-1]))


def test_padded_rows_mask_is_sdpas_on_real_queries():
    """packing = false: sdpa's padding queries attend too (nothing reads them); flex's attend to nothing."""
    samples = chains((50, 31, 7))
    row = make_row(samples, coefficients(samples, "token-mean"), packing=False)
    flex, sdpa = flex_mask(row, 4096)[:, 0], sdpa_mask(row)[:, 0]
    real = torch.nn.functional.pad(row.attention_mask.bool(), (0, flex.shape[-1] - row.input_ids.shape[1]))
    assert torch.equal(flex[real], padded_to(sdpa, flex.shape[-1])[real])
    assert not flex[~real].any() and not (flex & ~real[:, None, :]).any()


@pytest.mark.parametrize("row_tokens", [64, 100, 128])
def test_tree_rows_ancestor_mask_is_the_dense_one(row_tokens):
    samples = branched()
    rows = tree_rows(samples, coefficients(samples, "token-mean"), row_tokens)
    assert (len(rows) > 1) == (row_tokens < 111)  # the tree has 111 nodes: split at branch points
    for row in rows:
        flex = flex_mask(row, row_tokens)
        assert torch.equal(flex, padded_to(row.attention_mask, flex.shape[-1]))


def test_padded_lengths_are_few():
    assert [row_length(n, 4096) for n in (1, 128, 129, 2048, 2049, 4096)] == [128, 128, 256, 2048, 4096, 4096]
    assert [row_length(n, 5000) for n in (3000, 4097, 5000)] == [4096, 5120, 5120]
    assert len({row_length(n, 8192) for n in range(1, 8193)}) == 7


@pytest.fixture(scope="module")
def models(tiny_qwen_dir):
    """The tiny Qwen3 with sdpa and with transformers' flex_attention (compiled by transformers on first use)."""
    return {attn: load_model(str(tiny_qwen_dir), CPU, attention=attn).eval() for attn in ("sdpa", "flex_attention")}


@pytest.mark.parametrize("kind", ["packed", "tree"])
@torch.no_grad()
def test_a_flex_forward_gives_sdpas_logprobs(models, kind):
    """Through transformers' flex_attention with the row's BlockMask, padded to 128 (one compiled kernel)."""
    samples = chains((40, 25, 33)) if kind == "packed" else branched()
    coef = coefficients(samples, "token-mean")
    (row,) = [make_row(samples, coef, packing=True)] if kind == "packed" else tree_rows(samples, coef, 128)
    flexed = flex_row(row, 128, CPU)
    assert isinstance(flexed.attention_mask, BlockMask) and flexed.input_ids.shape == (1, 128)
    want, want_entropy = policy_logprobs(models["sdpa"], row, 0)
    got, entropy = policy_logprobs(models["flex_attention"], flexed, 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)


def test_attention_takes_four_words():
    assert TrainConfig().attention == "auto"
    assert load_config(overrides={"attention": "flex"}).attention == "flex"
    with pytest.raises(ConfigError, match="attention must be auto, sdpa, flex or flash, not 'flash_attention_2'"):
        load_config(overrides={"attention": "flash_attention_2"})


def test_auto_keeps_sdpa_on_cpu_and_takes_flex_on_cuda():
    assert choose_attention("auto", CPU, True, False)[0] == "sdpa"
    assert choose_attention("sdpa", CUDA, False, False)[0] == "sdpa"
    assert choose_attention("auto", CUDA, "auto", False)[0] == "flex_attention"
    assert choose_attention("flex", CUDA, True, False)[0] == "flex_attention"
    assert choose_attention("auto", CUDA, False, True) == ("sdpa", "auto on CUDA: a vision-language model")


def test_auto_without_flex_is_todays_cuda_path(monkeypatch):
    monkeypatch.setattr(attention, "flex_available", lambda: False)
    monkeypatch.setattr(attention, "flash_available", lambda: True)
    assert choose_attention("auto", CUDA, False, False)[0] == "flash_attention_2"
    assert choose_attention("auto", CUDA, "auto", False)[0] == "sdpa"  # flash-attention takes no tree mask
    assert choose_attention("flash", CUDA, False, False)[0] == "flash_attention_2"


@pytest.mark.parametrize("setting,device,tree,vision,refusal", [
    ("flex", CPU, False, False, "flex needs CUDA"),
    ("flex", CUDA, False, True, "flex takes text-only models"),
    ("flash", CPU, False, False, "flash needs CUDA and the flash_attn package"),
    ("flash", CUDA, "auto", False, "flash takes no tree mask"),
])
def test_attention_refusals(monkeypatch, setting, device, tree, vision, refusal):
    monkeypatch.setattr(attention, "flash_available", lambda: True)
    with pytest.raises(ConfigError, match=refusal):
        choose_attention(setting, device, tree, vision)
