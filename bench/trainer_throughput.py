"""Trainer throughput: packed rows vs padded micro-batches, on agent-trace-like lengths.

    PYTHONPATH=. .venv/bin/python bench/trainer_throughput.py [--samples 96] [--row-tokens 2048] [--hidden 256]

Lengths are long-tailed like agent traces (log-normal: many short single-call samples, a few long
multi-turn ones). Every mode trains the same samples with the same objective and the same token budget
per forward pass (`row_tokens`):
- padded, batch max: the baseline RL trainers use without packing: micro-batches of B samples in arrival
  order, every sample padded to the longest of the global batch (B = row_tokens // that length);
- padded, micro-batch max: the same groups, each padded only to its own longest;
- padded+bucketed: length-sorted groups, as many per row as fit (the trainer's `packing = false`);
- packed: several samples per row, position ids restarting, no attention across samples.
The table shows tokens/s of real (non-pad) tokens (best of `--repeats` interleaved runs, the machine may be
shared), the share of computed tokens that are real, and on CUDA the model FLOPs utilisation.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from openforge.trainer.config import TrainConfig
from openforge.trainer.data import Sample
from openforge.trainer.packing import Row, coefficients, make_row, plan_rows
from openforge.trainer.train import forward_loss


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


def arrival_rows(batch: list[Sample], per_row: int) -> list[list[Sample]]:
    """Fixed-size groups in arrival order (no bucketing)."""
    return [batch[i:i + per_row] for i in range(0, len(batch), per_row)]


def pad_to(row: Row, width: int) -> Row:
    """Right-pad a padded row to `width` tokens (pads are masked out of attention and loss)."""
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]))  # noqa: E731
    positions = torch.arange(width).expand(row.input_ids.shape[0], width).clone()
    return Row(pad(row.input_ids), positions, pad(row.attention_mask), pad(row.loss_mask), pad(row.behaviour),
               pad(row.has_behaviour), pad(row.advantage), pad(row.coef), row.n_real)


def run(model, batch, cfg: TrainConfig, device, rows: list[list[Sample]], width: int = 0) -> dict[str, float]:
    """One forward/backward per row over the whole batch; real = non-pad tokens, computed = all tokens."""
    coef = coefficients(batch, cfg.aggregation)
    real = computed = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for group in rows:
        row = make_row(group, coef, cfg.packing)
        row = (pad_to(row, width) if width else row).to(device)
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
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per mode; the best is reported")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
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
          f"row_tokens {args.row_tokens}, {torch.get_num_threads()} thread(s)")

    padded = TrainConfig(row_tokens=args.row_tokens, step_tokens=1 << 30, packing=False)
    packed = TrainConfig(row_tokens=args.row_tokens, step_tokens=1 << 30, packing=True)
    longest = int(lengths.max())
    per_row = max(1, args.row_tokens // longest)  # as many as fit at the batch's longest length
    modes = {
        f"padded, batch max (B={per_row})": (padded, arrival_rows(batch, per_row), longest),
        f"padded, micro max (B={per_row})": (padded, arrival_rows(batch, per_row), 0),
        "padded+bucketed": (padded, plan_rows(batch, args.row_tokens, False), 0),
        "packed": (packed, plan_rows(batch, args.row_tokens, True), 0),
    }
    run(model, batch[:4], packed, device, plan_rows(batch[:4], args.row_tokens, True))  # warm-up
    results: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats):  # interleaved, best of: a shared machine's load hits every mode alike
        for name, (cfg, rows, width) in modes.items():
            r = run(model, batch, cfg, device, rows, width)
            if name not in results or r["seconds"] < results[name]["seconds"]:
                results[name] = r

    header = f"{'mode':<28} {'rows':>5} {'real tok':>9} {'computed':>9} {'real share':>10} {'tok/s':>9} {'speedup':>8}"
    if device.type == "cuda":
        header += f" {'MFU':>6}"
    print(header)
    first = next(iter(results.values()))
    base = first["real"] / first["seconds"]
    for name, r in results.items():
        tps = r["real"] / r["seconds"]
        line = (f"{name:<28} {r['rows']:>5} {r['real']:>9} {r['computed']:>9} {r['real'] / r['computed']:>10.1%} "
                f"{tps:>9.0f} {tps / base:>7.2f}x")
        if device.type == "cuda":
            line += f" {6 * n_params * tps / (args.peak_tflops * 1e12):>6.1%}"
        print(line)


if __name__ == "__main__":
    main()
