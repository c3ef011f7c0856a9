"""Tree rows vs chain rows of the same samples: one trainer step on each, compared (the test modules of tree
mode on hand-built, random and reconstructed trees share it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from openforge.trainer.config import TrainConfig
from openforge.trainer.data import Sample
from openforge.trainer.packing import coefficients, make_row, plan_rows
from openforge.trainer.train import forward_loss, old_logprobs
from openforge.trainer.tree import tree_rows

Step = tuple[float, dict[str, float], dict[str, torch.Tensor]]  # a step: loss, stat sums, gradients


def run_rows(model: Any, rows: list[Any], cfg: TrainConfig, ref: Any = None) -> Step:
    """A trainer step's rows: old policy first (no grad, ppo), then forward/backward; loss, stat sums, grads."""
    model.zero_grad()
    old = [old_logprobs(model, row, cfg.logit_chunk) if cfg.objective == "ppo" else None for row in rows]
    total, sums = 0.0, dict[str, float]()
    for row, old_logp in zip(rows, old):
        loss, stats = forward_loss(model, row, cfg, ref, old_logp)
        loss.backward()
        total += loss.item()
        for k, v in stats.items():
            sums[k] = max(sums.get(k, v), v) if k == "is_ratio_max" else sums.get(k, 0.0) + v
    return total, sums, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_step(a: Step, b: Step) -> None:
    """Two `run_rows` results: the same loss, every stat and every gradient, within fp32 tolerance."""
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = a, b
    assert loss_a == pytest.approx(loss_b, rel=1e-5, abs=1e-7)
    assert stats_a.keys() == stats_b.keys()
    for key in stats_a:
        assert stats_a[key] == pytest.approx(stats_b[key], rel=1e-5, abs=1e-6), key
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-4, atol=1e-6, msg=name)


def assert_tree_equals_chains(model: Any, samples: list[Sample], cfg: TrainConfig, row_tokens: int,
                              ref: Any = None) -> tuple[list[Any], list[Any]]:
    """Loss, every stat and every gradient of tree rows == packed chain rows; returns both row lists."""
    coef = coefficients(samples, cfg.aggregation)
    chains = [make_row(g, coef, True) for g in plan_rows(samples, row_tokens, True)]
    trees = tree_rows(samples, coef, row_tokens)
    assert_same_step(run_rows(model, trees, cfg, ref), run_rows(model, chains, cfg, ref))
    assert sum(r.n_real for r in trees) == sum(r.n_real for r in chains) == sum(len(s) for s in samples)
    assert all(r.input_ids.shape[1] <= row_tokens for r in trees)
    return chains, trees


def computed(rows: list[Any]) -> int:
    return sum(r.input_ids.numel() for r in rows)


def run_metrics(cfg: TrainConfig) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]


def final_weights(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    return load_file(sorted((Path(cfg.out) / "checkpoints").iterdir())[-1] / "model.safetensors")


def assert_same_run(a: TrainConfig, b: TrainConfig, rtol: float = 1e-4) -> None:
    for ma, mb in zip(run_metrics(a), run_metrics(b), strict=True):
        assert mb["samples"] == ma["samples"] and mb["tokens"] == ma["tokens"]
        for key in ("loss", "grad_norm", "entropy", "is_ratio_mean", "clip_frac", "engine_gap_mean"):
            assert mb[key] == pytest.approx(ma[key], rel=rtol, abs=1e-7), key
    wa, wb = final_weights(a), final_weights(b)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=rtol, atol=1e-5, msg=name)
