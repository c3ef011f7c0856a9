"""Inputs for an `openforge train` smoke run on a device: a randomly initialised Qwen3-shaped model directory
(the real Qwen3 tokenizer beside it) and a DuckDB of chat samples, as bench/gpu_check.sh needs them.

    PYTHONPATH=. python3 bench/train_inputs.py OUT [--shape 0.6b] [--samples 192]

Writes OUT/model and OUT/runs.duckdb. The model is built on CUDA when there is one, never on the CPU first.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import Qwen3ForCausalLM

from bench.trainer_throughput import QWEN3_SHAPES, qwen3_config
from openforge.testing.reconstruct_flows import qwen_path
from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, tiny_config, write_samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=[*sorted(QWEN3_SHAPES), "tiny"], default="0.6b")
    p.add_argument("--samples", type=int, default=192)
    args = p.parse_args()
    config = tiny_config() if args.shape == "tiny" else qwen3_config(args.shape, 8192)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(args.out / "model")
    for file in Path(qwen_path()).iterdir():
        shutil.copy(file, args.out / "model" / file.name)
    write_samples(args.out / "runs.duckdb", make_samples(qwen_tokenizer(), args.samples, seed=0, episodes=48))
    print(f"{args.out}: {args.shape} model ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params), "
          f"{args.samples} samples")


if __name__ == "__main__":
    main()
