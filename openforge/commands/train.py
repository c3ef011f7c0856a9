"""`openforge train`: policy-gradient (GRPO/PPO) or SFT training on reconstructed samples."""

from __future__ import annotations

from pathlib import Path

import typer

from openforge.choices import Objective
from openforge.commands import FAILED, SAMPLES_DB, fail, one_command, option
from openforge.trainer.config import TrainConfig


def train(
    db: Path = SAMPLES_DB,
    model: Path = typer.Option(..., "--model", help="Local Hugging Face model directory to start from."),
    out: Path = typer.Option(..., "--out", help="Output directory: checkpoints/step_N/ and metrics.jsonl."),
    config: Path = typer.Option(None, "--config",
                                help="TOML file with any TrainConfig field (flat or under \\[train])."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint under --out."),
    where: str = option(TrainConfig, "where", "--where"),
    objective: Objective | None = option(TrainConfig, "objective", "--objective"),
    lr: float = option(TrainConfig, "lr", "--lr"),
    steps: int = option(TrainConfig, "steps", "--steps"),
    step_tokens: int = option(TrainConfig, "step_tokens", "--step-tokens"),
    row_tokens: int = option(TrainConfig, "row_tokens", "--row-tokens"),
    sets: list[str] = typer.Option([], "--set", help="Any other field as key=value, e.g. --set kl_coef=0.01."),
) -> None:
    """Train a policy on the selected samples (CPU or CUDA; multi-GPU with `torchrun --nproc_per_node N`).

    Precedence: defaults < --config file < --set < the named options. See docs/trainer.md for every field.
    """
    from rich.console import Console

    from openforge.settings import ConfigError, parse_sets
    from openforge.trainer.config import load_config
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
