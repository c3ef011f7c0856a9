"""Trainer memory: peak RSS (CPU) / peak allocated (CUDA) of one GRPO step of SmolLM2-135M on one full row.

    PYTHONPATH=. .venv/bin/python bench/trainer_memory.py [--row-tokens 4096] [--threads 2]

Each configuration (logit_chunk 0 = all positions at once, or 1024; grad_checkpointing off or on; glibc's
allocator as it comes, or as `train()` sets it: `trainer/allocator.py`) runs in a fresh process, so one's
peak does not hide another's. The step is the trainer's: old-policy logprobs (no grad), forward + loss +
backward, grad clip, AdamW step, on one synthetic sample of `--row-tokens` tokens (the first third a prompt,
the rest trainable, engine logprobs on it), timed from the old-policy pass to the AdamW step. The fp32 floor
beside it: weights, gradients and AdamW's two moments (4 x parameters x 4 bytes).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np
import torch

from openforge.models import hf_dir
from openforge.trainer.allocator import return_freed_memory
from openforge.trainer.attention import choose_attention, to_device
from openforge.trainer.config import TrainConfig
from openforge.trainer.data import Sample
from openforge.trainer.dist import resolve_precision
from openforge.trainer.model import load_model
from openforge.trainer.packing import coefficients, make_row
from openforge.trainer.train import forward_loss, old_logprobs

# (logit_chunk, grad_checkpointing, the trainer's allocator setting)
CONFIGS = [(0, False, False), (1024, False, False), (1024, True, False), (1024, False, True), (1024, True, True)]


def one_step(model_dir: str, row_tokens: int, logit_chunk: int, grad_checkpointing: bool,
             allocator: bool) -> dict[str, float]:
    """One trainer step in this process; its peak memory in MiB."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if allocator:
        return_freed_memory()
    attention = choose_attention("auto", device, False, False)[0]  # the trainer's own choice for chain rows
    model = load_model(model_dir, device, grad_checkpointing, attention)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rng = np.random.default_rng(0)
    mask = np.arange(row_tokens) >= row_tokens // 3
    sample = Sample("s0", "e0", rng.integers(0, model.config.vocab_size, row_tokens), mask,
                    np.where(mask, -1.0, np.nan).astype(np.float32), 1.0, 1.0, 1.0)
    cfg = TrainConfig(logit_chunk=logit_chunk, grad_checkpointing=grad_checkpointing)
    row = to_device(make_row([sample], coefficients([sample], cfg.aggregation), cfg.packing), model, device,
                    row_tokens)
    start = time.perf_counter()
    precision = resolve_precision(cfg, device)[0]  # as the trainer decides it
    old = old_logprobs(model, row, cfg.logit_chunk, precision)
    loss, _ = forward_loss(model, row, cfg, old_logp=old, precision=precision)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    seconds = time.perf_counter() - start
    n_params = sum(p.numel() for p in model.parameters())
    peak = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: KiB
    return {"device": device.type, "peak_mib": peak, "floor_mib": 4 * 4 * n_params / 2**20, "params": n_params,
            "step_s": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--row-tokens", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--one", help=argparse.SUPPRESS)  # "chunk,checkpointing,allocator": run that one here
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = str(hf_dir())
    if args.one:
        chunk, ckpt, allocator = args.one.split(",")
        print(json.dumps(one_step(model_dir, args.row_tokens, int(chunk), ckpt == "1", allocator == "1")))
        return
    print(f"SmolLM2-135M, one GRPO step on a {args.row_tokens}-token row (fresh process each)")
    print(f"{'logit_chunk':>11} {'grad_ckpt':>9} {'allocator':>9} {'peak MiB':>9} {'fp32 floor MiB':>15} {'step s':>7}")
    for chunk, ckpt, allocator in CONFIGS:
        out = subprocess.run([sys.executable, __file__, "--row-tokens", str(args.row_tokens), "--threads",
                              str(args.threads), "--one", f"{chunk},{int(ckpt)},{int(allocator)}"],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        kind = "allocated" if r["device"] == "cuda" else "RSS"
        setting = f"{chunk:>11} {'on' if ckpt else 'off':>9} {'trainer' if allocator else 'glibc':>9}"
        print(f"{setting} {r['peak_mib']:>9.0f} {r['floor_mib']:>15.0f} {r['step_s']:>7.1f}  ({kind})")


if __name__ == "__main__":
    main()
