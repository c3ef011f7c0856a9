"""Trainer throughput: packed rows vs one-bucketed-padded-batch-per-row, on agent-trace-like lengths.

    .venv/bin/python bench/trainer_throughput.py [--samples 96] [--row-tokens 2048] [--hidden 256]

Lengths are long-tailed like agent traces (log-normal: many short single-call samples, a few long
multi-turn ones). Both modes train the same samples with the same objective; the table shows tokens/s
of real (non-pad) tokens, the share of computed tokens that are real, and on CUDA the model FLOPs utilisation.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.config import TrainConfig
from trainer.data import Sample
from trainer.packing import coefficients, make_row, plan_rows
from trainer.train import forward_loss


def agent_lengths(n: int, row_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """Log-normal lengths (median ~ row_tokens/8, long tail), clipped to [32, row_tokens]."""
    return np.clip(rng.lognormal(np.log(row_tokens / 8), 0.9, n), 32, row_tokens).astype(int)


def make_batch(lengths: np.ndarray, vocab: int, rng: np.random.Generator) -> list[Sample]:
    out = []
    for i, n in enumerate(lengths):
        mask = np.arange(n) >= n // 3
        out.append(Sample(f"s{i:05d}", f"e{i}", rng.integers(0, vocab, n), mask,
                          np.where(mask, -1.0, np.nan).astype(np.float32), float(rng.normal()), 1.0, 1.0))
    return out


def naive_rows(batch: list[Sample], per_row: int) -> list[list[Sample]]:
    """The usual padded baseline: fixed-size groups in arrival order, each padded to its longest."""
    return [batch[i:i + per_row] for i in range(0, len(batch), per_row)]


def run(model, batch, cfg: TrainConfig, device, rows: list[list[Sample]] | None = None) -> dict[str, float]:
    coef = coefficients(batch, cfg.aggregation)
    rows = rows or plan_rows(batch, cfg.row_tokens, cfg.packing)
    real = computed = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for group in rows:
        row = make_row(group, coef, cfg.packing).to(device)
        loss, _ = forward_loss(model, row, cfg)
        loss.backward()
        real += row.n_real
        computed += row.input_ids.numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return {"rows": len(rows), "real": real, "computed": computed, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--row-tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="accelerator bf16 dense peak, for MFU")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
                         num_key_value_heads=max(args.hidden // 128, 1), head_dim=64,
                         max_position_embeddings=args.row_tokens, use_cache=False)
    model = Qwen3ForCausalLM(config).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    lengths = agent_lengths(args.samples, args.row_tokens, rng)
    batch = make_batch(lengths, args.vocab, rng)
    print(f"{device.type}: {n_params / 1e6:.1f}M params, {len(batch)} samples, {lengths.sum()} tokens, "
          f"lengths median {int(np.median(lengths))} p90 {int(np.percentile(lengths, 90))} max {lengths.max()}, "
          f"row_tokens {args.row_tokens}")

    warm = TrainConfig(row_tokens=args.row_tokens, step_tokens=1 << 30)
    run(model, batch[:4], warm, device)  # warm-up (allocator, kernels)
    padded = TrainConfig(row_tokens=args.row_tokens, step_tokens=1 << 30, packing=False)
    packed = TrainConfig(row_tokens=args.row_tokens, step_tokens=1 << 30, packing=True)
    per_row = max(1, args.row_tokens // int(lengths.max()))  # as many as fit at the longest length
    results = {
        f"padded (B={per_row})": run(model, batch, padded, device, naive_rows(batch, per_row)),
        "padded+bucketed": run(model, batch, padded, device),
        "packed": run(model, batch, packed, device),
    }

    header = f"{'mode':<18} {'rows':>5} {'real tok':>9} {'computed':>9} {'real share':>10} {'tok/s':>9} {'speedup':>8}"
    if device.type == "cuda":
        header += f" {'MFU':>6}"
    print(header)
    first = next(iter(results.values()))
    base = first["real"] / first["seconds"]
    for name, r in results.items():
        tps = r["real"] / r["seconds"]
        line = (f"{name:<18} {r['rows']:>5} {r['real']:>9} {r['computed']:>9} {r['real'] / r['computed']:>10.1%} "
                f"{tps:>9.0f} {tps / base:>7.2f}x")
        if device.type == "cuda":
            line += f" {6 * n_params * tps / (args.peak_tflops * 1e12):>6.1%}"
        print(line)


if __name__ == "__main__":
    main()
