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

Then tree mode (`tree = true`) against packed chains on a second corpus shaped like branched agent episodes
(`--episodes`, each 1-6 leaves forking off a long shared trunk: retries, subagents, template forks). The last
line compares them on the same samples and model: computed tokens (chains / tree), trained sample tokens per
second (tree / chains), and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import resource
import time
from collections.abc import Iterator

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from openforge.trainer.config import TrainConfig
from openforge.trainer.data import Sample
from openforge.trainer.packing import Row, coefficients, make_row, plan_rows
from openforge.trainer.train import forward_loss
from openforge.trainer.tree import tree_rows


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


def make_trees(episodes: int, row_tokens: int, vocab: int, rng: np.random.Generator) -> list[Sample]:
    """Branched episodes: a trunk (prompt, then turns: 1/3 prompt or tool output, 2/3 completion, trainable
    in the trunk's sample only), and 0-5 more leaves forking off it in its second half, each with its own
    continuation (its trainable tokens). Every leaf fits a row."""
    out = []
    for e in range(episodes):
        n_trunk = int(np.clip(rng.lognormal(np.log(row_tokens / 3), 0.5), 64, row_tokens - 32))
        trunk = rng.integers(0, vocab, n_trunk)
        turns = np.arange(n_trunk) % 96 >= 32  # 96-token turns: 32 tokens of input, 64 of completion
        turns[:n_trunk // 8] = False  # the task prompt
        leaves = [(trunk, turns)]
        for _ in range(int(rng.integers(0, 6))):
            fork = int(rng.integers(n_trunk // 2, n_trunk))
            n_own = int(np.clip(rng.lognormal(np.log(row_tokens / 12), 0.6), 8, row_tokens - fork))
            mask = np.r_[np.zeros(fork, bool), np.arange(n_own) >= n_own // 3]
            leaves.append((np.r_[trunk[:fork], rng.integers(0, vocab, n_own)], mask))
        for i, (ids, mask) in enumerate(leaves):
            out.append(Sample(f"e{e:04d}-{i}", f"e{e:04d}", ids, mask, np.where(mask, -1.0, np.nan).astype(np.float32),
                              float(rng.normal()), 1.0, 1.0 / len(leaves)))
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
    made = ((lambda r: pad_to(r, width) if width else r)(make_row(group, coef, cfg.packing)) for group in rows)
    return timed(model, cfg, device, made)


def run_tree(model, batch, cfg: TrainConfig, device) -> dict[str, float]:
    """Tree mode over the whole batch; real = sample tokens, computed = tree nodes in rows."""
    return timed(model, cfg, device, lazy_tree_rows(batch, coefficients(batch, cfg.aggregation), cfg.row_tokens))


def lazy_tree_rows(batch: list[Sample], coef: dict[str, float], row_tokens: int) -> Iterator[Row]:
    """The tree rows, built when first asked for: inside the timed loop, like make_row's rows."""
    yield from tree_rows(batch, coef, row_tokens)


def timed(model, cfg: TrainConfig, device, rows: Iterator[Row]) -> dict[str, float]:
    """Forward/backward of each row as it is made (making it is timed too)."""
    n_rows = real = computed = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for row in rows:
        row = row.to(device)
        loss, _ = forward_loss(model, row, cfg)
        loss.backward()
        n_rows, real, computed = n_rows + 1, real + row.n_real, computed + row.input_ids.numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return {"rows": n_rows, "real": real, "computed": computed, "seconds": seconds}


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
    p.add_argument("--episodes", type=int, default=24, help="branched episodes of the tree-mode corpus")
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
    compare_tree(model, make_trees(args.episodes, args.row_tokens, args.vocab, rng), packed, device, args.repeats)


def compare_tree(model, batch: list[Sample], packed: TrainConfig, device, repeats: int) -> None:
    """Packed chains vs tree mode on branched episodes; the last line is the comparison."""
    tree = TrainConfig(row_tokens=packed.row_tokens, step_tokens=packed.step_tokens, tree=True)
    leaves = np.bincount(np.unique([s.episode_id for s in batch], return_inverse=True)[1])
    print(f"tree corpus: {len(leaves)} episodes, {len(batch)} samples ({leaves.min()}-{leaves.max()} leaves per "
          f"episode), {sum(len(s) for s in batch)} tokens")
    rows = plan_rows(batch, packed.row_tokens, True)
    best: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, r in (("packed chains", run(model, batch, packed, device, rows)),
                        ("tree", run_tree(model, batch, tree, device))):
            if name not in best or r["seconds"] < best[name]["seconds"]:
                best[name] = r
    print(f"{'mode':<28} {'rows':>5} {'real tok':>9} {'computed':>9} {'tok/s':>9}")
    for name, r in best.items():
        print(f"{name:<28} {r['rows']:>5} {r['real']:>9} {r['computed']:>9} {r['real'] / r['seconds']:>9.0f}")
    chains, trees = best["packed chains"], best["tree"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(f"tree vs chains: computed_tokens x{chains['computed'] / trees['computed']:.2f} "
          f"tokens_per_s x{(trees['real'] / trees['seconds']) / (chains['real'] / chains['seconds']):.2f} "
          f"peak_rss_mb {peak_mb:.0f}")


if __name__ == "__main__":
    main()
