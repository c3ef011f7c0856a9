"""Checkpoints an inference engine loads as-is (save_pretrained + tokenizer) plus what `--resume` needs.

out/checkpoints/step_000042/
    config.json, model.safetensors, tokenizer files   <- vLLM / SGLang / transformers load this directory
    trainer_state.pt                                   <- optimizer, scheduler, step, data position, RNG
    train.toml                                         <- the config that produced it

trainer_state.pt holds tensors and plain values only, and is read with torch.load(weights_only=True): a
checkpoint directory from elsewhere cannot run code. Weights are checked finite before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

from openforge.trainer.config import TrainConfig, dump_toml
from openforge.trainer.data import DataError, Position
from openforge.trainer.dist import barrier, broadcast_
from openforge.trainer.model import tokenizer_files

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def checkpoint_dir(out: str | Path, step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step:06d}"


STATE_KEYS = {"step", "position", "optimizer", "scheduler", "rng"}


class CheckpointDamaged(Exception):
    """A checkpoint directory `--resume` cannot continue from."""


def latest(out: str | Path, say: Callable[[str], None]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, with its trainer state; damaged newer ones are reported and skipped.

    Incomplete ones are still named *.tmp; a complete one may since have lost or broken a file.
    """
    done = sorted((p for p in (Path(out) / "checkpoints").glob("step_*") if p.suffix != ".tmp"), reverse=True)
    for path in done:
        try:
            check_weights(path)
            return path, load_state(path)
        except CheckpointDamaged as e:
            say(f"skipping checkpoint {path}: {e}")
    return None


def load_state(path: Path) -> dict[str, Any]:
    """trainer_state.pt as tensors and plain values: never unpickles code."""
    try:
        state = torch.load(path / "trainer_state.pt", weights_only=True)
    except OSError as e:
        raise CheckpointDamaged(f"cannot read trainer_state.pt ({e.strerror or e})") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError):
        raise CheckpointDamaged("trainer_state.pt does not load as tensors and plain values "
                                "(damaged, or it holds pickled objects)") from None
    missing = STATE_KEYS - set(state) if isinstance(state, dict) else STATE_KEYS
    if missing:
        raise CheckpointDamaged(f"trainer_state.pt lacks {', '.join(sorted(missing))}")
    return state


def check_weights(path: Path) -> None:
    """config.json and every safetensors file of the weights present, their headers matching their sizes."""
    if not (path / "config.json").is_file():
        raise CheckpointDamaged("no config.json")
    index = path / "model.safetensors.index.json"  # save_pretrained shards large models
    try:
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
        for name in files:
            with safe_open(path / name, "pt"):
                pass
    except (OSError, SafetensorError, ValueError, KeyError) as e:
        raise CheckpointDamaged(f"weights unreadable ({e})") from None


def save(out: str, step: int, position: Position, model: PreTrainedModel, tokenizer_dir: str,
         optimizer: torch.optim.Optimizer, scheduler: LRScheduler, cfg: TrainConfig, rank: int) -> Path:
    """Gather full weights and optimizer state onto rank 0 and write them; every rank must call this."""
    model_state = full_weights(model, step)
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
    barrier()
    return final


def full_weights(model: PreTrainedModel, step: int) -> dict[str, torch.Tensor]:
    """The model's full weights on CPU, gathered on rank 0 (tied ones once, as save_pretrained writes them);
    DataError when one is not finite. Every rank must call this."""
    state = drop_tied(model, cast(dict[str, torch.Tensor], get_model_state_dict(model, options=FULL)))  # full: tensors
    refuse_non_finite(state, step, next(model.parameters()).device)
    return state


def write_weights(state: Mapping[str, torch.Tensor], model_dir: Path, out: Path) -> Path:
    """`out` as a model directory an engine loads: `state` as model.safetensors beside `model_dir`'s
    config.json and tokenizer files (the configuration training does not change); written atomically."""
    from safetensors.torch import save_file

    tmp = out.with_suffix(".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    configs = [model_dir / name for name in ("config.json", "generation_config.json") if (model_dir / name).is_file()]
    for file in [*configs, *tokenizer_files(model_dir)]:
        shutil.copy(file, tmp / file.name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def refuse_non_finite(state: dict[str, torch.Tensor], step: int, device: torch.device) -> None:
    """The last line of defence: a checkpoint with a non-finite weight is never written."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    count = broadcast_(torch.tensor(len(bad), device=device))  # the full weights are gathered on rank 0 only
    if count.item():
        raise DataError(f"not saving step {step}: {count.item()} weight tensor(s) hold non-finite values "
                        f"({', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''})")


def drop_tied(model: PreTrainedModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gathered state dict holds tied weights twice (as copies); save them once, as save_pretrained does."""
    if getattr(model.config, "tie_word_embeddings", False):
        output = model.get_output_embeddings()
        name = next(n for n, m in model.named_modules() if m is output)
        state.pop(f"{name}.weight", None)
    return state


def restore(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LRScheduler
            ) -> tuple[int, Position]:
    """Load optimizer/scheduler/RNG state from `latest` (the weights came from its directory)."""
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optimizer"], options=FULL)
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["step"], Position(**state["position"])
