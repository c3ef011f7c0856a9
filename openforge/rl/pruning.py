"""What a run keeps on disk as it goes: the newest trainer checkpoints that load, and the one policy the
engine serves."""

from __future__ import annotations

import shutil
from pathlib import Path


def prune_checkpoints(train_out: Path, keep: int, keep_also: str = "") -> None:
    """Keep the newest `keep` trainer checkpoints that load (weights and optimizer state: 1.6 GB each for
    135M), and `keep_also` (the one served); damaged ones go, so they never crowd out the last good one."""
    from openforge.trainer.checkpoint import CheckpointDamaged, check_weights

    good: list[Path] = []
    for path in sorted((p for p in (train_out / "checkpoints").glob("step_*") if p.suffix != ".tmp"), reverse=True):
        try:
            check_weights(path)
            good.append(path)
        except CheckpointDamaged:
            shutil.rmtree(path, ignore_errors=True)
    for old in good[keep:]:
        if str(old) != keep_also:
            shutil.rmtree(old, ignore_errors=True)


def prune_policies(policies: Path, served: str) -> None:
    """Every exported policy in `policies` but the one the engine serves (`served`)."""
    for old in policies.glob("policy-*"):
        if str(old) == served:
            continue
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
