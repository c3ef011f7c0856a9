"""Checkpoints an inference engine loads as-is (save_pretrained + tokenizer) plus what `--resume` needs.

out/checkpoints/step_000042/
    config.json, model.safetensors, tokenizer files   <- vLLM / SGLang / transformers load this directory
    trainer_state.pt                                   <- optimizer, scheduler, step, data position, RNG
    train.toml                                         <- the config that produced it
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from trainer.config import TrainConfig, dump_toml
from trainer.data import Position
from trainer.model import tokenizer_files

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def checkpoint_dir(out: str | Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step:06d}"


def latest(out: str | Path) -> Path | None:
    """The newest complete checkpoint (incomplete ones are still named *.tmp)."""
    done = sorted(p for p in (Path(out) / "checkpoints").glob("step_*") if p.suffix != ".tmp")
    return done[-1] if done else None


def save(out: str, step: int, position: Position, model: torch.nn.Module, tokenizer_dir: str, optimizer, scheduler,
         cfg: TrainConfig, rank: int) -> Path:
    """Gather full weights and optimizer state onto rank 0 and write them; every rank must call this."""
    model_state = drop_tied(model, get_model_state_dict(model, options=FULL))
    optim_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    final = checkpoint_dir(out, step)
    if rank == 0:
        tmp = final.with_suffix(".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=model_state, safe_serialization=True)
        for file in tokenizer_files(tokenizer_dir):
            shutil.copy(file, tmp / file.name)
        torch.save({
            "step": step,
            "position": dataclasses.asdict(position),
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
        }, tmp / "trainer_state.pt")
        (tmp / "train.toml").write_text(dump_toml(cfg))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    if dist.is_initialized():
        dist.barrier()
    return final


def drop_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gathered state dict holds tied weights twice (as copies); save them once, as save_pretrained does."""
    if getattr(model.config, "tie_word_embeddings", False):
        output = model.get_output_embeddings()
        name = next(n for n, m in model.named_modules() if m is output)
        state.pop(f"{name}.weight", None)
    return state


def restore(path: Path, model: torch.nn.Module, optimizer, scheduler) -> tuple[int, Position]:
    """Load optimizer/scheduler/RNG state (the weights came from `path` via from_pretrained)."""
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"], options=FULL)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["step"], Position(**state["position"])
