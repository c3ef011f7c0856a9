"""`openforge train`: policy-gradient (GRPO/PPO) or SFT training on reconstructed samples."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer

from openforge.commands import FAILED, SAMPLES_DB, fail, one_command


class Objective(StrEnum):
    """openforge.trainer.config.OBJECTIVES."""

    ppo = "ppo"
    sft = "sft"


def train(
    db: Path = SAMPLES_DB,
    model: Path = typer.Option(..., "--model", help="Local Hugging Face model directory to start from."),
    out: Path = typer.Option(..., "--out", help="Output directory: checkpoints/step_N/ and metrics.jsonl."),
    config: Path = typer.Option(None, "--config",
                                help="TOML file with any TrainConfig field (flat or under \\[train])."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint under --out."),
    where: str = typer.Option(None, "--where", help="SQL filter on the samples table, e.g. \"reward > 0\"."),
    objective: Objective | None = typer.Option(
        None, "--objective", show_default=False, help="ppo (GRPO/PPO clipped surrogate) or sft."),
    lr: float = typer.Option(None, "--lr", help="Peak learning rate (AdamW, warmup then cosine)."),
    steps: int = typer.Option(None, "--steps", help="Optimizer steps; 0 = `epochs` passes over the selection."),
    step_tokens: int = typer.Option(None, "--step-tokens", help="Global batch size in tokens (all ranks)."),
    row_tokens: int = typer.Option(None, "--row-tokens", help="Tokens per packed row; the longest sample allowed."),
    sets: list[str] = typer.Option([], "--set", help="Any other field as key=value, e.g. --set kl_coef=0.01."),
) -> None:
    """Train a policy on the selected samples (CPU or CUDA; multi-GPU with `torchrun --nproc_per_node N`).

    Precedence: defaults < --config file < --set < the named options. See docs/trainer.md for every field.
    """
    from rich.console import Console

    from openforge.trainer.config import ConfigError, load_config, parse_sets
    from openforge.trainer.data import DataError

    console = Console(stderr=True, soft_wrap=True)
    named = dict(db=str(db), model=str(model), out=str(out), where=where,
                 objective=objective.value if objective else None, lr=lr, steps=steps, step_tokens=step_tokens,
                 row_tokens=row_tokens)
    try:
        cfg = load_config(config, parse_sets(sets) | {k: v for k, v in named.items() if v is not None})
        from openforge.trainer.train import train as run  # torch + transformers: imported only when training

        run(cfg, resume=resume, say=console.print)
    except (ConfigError, DataError) as e:
        fail(str(e), code=FAILED)


register = one_command("train", train)
