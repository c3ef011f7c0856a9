"""The proximal policy of decoupled PPO: each sample's logprobs under the weights a run starts from, kept per
sample (by sample id and token position) so that every later step, however it packs its rows, clips against
them.

A sample is packed into different rows at different steps (another global batch, another epoch's order,
a tree of other samples), so the logprobs cannot be kept per row. Each row's trainable targets are traced
back to (sample, token position) without knowing the layout: the rows are built a second time from copies
of the samples whose engine logprobs are their token positions and whose advantage is their index (both
exact in float32 below 2^24), and row building depends on neither.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from openforge.trainer.data import Sample
from openforge.trainer.loss import targets
from openforge.trainer.packing import Row

Sources = tuple[np.ndarray, np.ndarray]  # per trainable target of a row: (sample index, token position)


def target_sources(samples: list[Sample], build: Callable[[list[Sample]], list[Row]]) -> list[Sources]:
    """For each row `build(samples)` makes, where each of its trainable targets comes from, in `targets` order."""
    coded = [dataclasses.replace(s, behaviour_logprobs=np.arange(len(s), dtype=np.float32), advantage=float(k))
             for k, s in enumerate(samples)]
    return [(targets(row.advantage, row).long().numpy(), targets(row.behaviour, row).long().numpy())
            for row in build(coded)]


class ProximalLogprobs:
    """float32 CPU logprobs of each sample's trainable tokens only (4 bytes per trainable token)."""

    def __init__(self, logp: dict[str, torch.Tensor] | None = None) -> None:
        self.logp: dict[str, torch.Tensor] = logp or {}

    @classmethod
    def load(cls, checkpoint: Path | None, rank: int) -> ProximalLogprobs:
        """What this rank saved beside a checkpoint taken mid-run (`save`); empty when there is none (another
        rank count, a checkpoint at a run's end, a file damaged): those samples are computed again."""
        path = checkpoint / f"proximal_rank{rank}.pt" if checkpoint else None
        if path is None or not path.is_file():
            return cls()
        try:
            logp = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError):
            return cls()
        return cls(logp) if isinstance(logp, dict) else cls()

    def save(self, checkpoint: Path, rank: int) -> None:
        """Beside a checkpoint that a run goes on from: `--resume` then clips against the same proximal policy."""
        torch.save(self.logp, checkpoint / f"proximal_rank{rank}.pt")

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.logp

    def __len__(self) -> int:
        return len(self.logp)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.logp.values())

    def put(self, samples: list[Sample], sources: Sources, logp: torch.Tensor) -> None:
        """Keep one row's logprobs (`logp` in `targets` order; a sample's tokens may span several rows)."""
        values = logp.detach().float().cpu()
        for k, mine, at in _by_sample(sources):
            s = samples[k]
            slot = self.logp.setdefault(s.sample_id, torch.full((int(s.loss_mask.sum()),), float("nan")))
            slot[_trainable_index(s)[at]] = values[mine]

    def gather(self, samples: list[Sample], sources: Sources) -> torch.Tensor:
        """One row's proximal logprobs, in `targets` order."""
        out = torch.empty(len(sources[0]))
        for k, mine, at in _by_sample(sources):
            s = samples[k]
            out[mine] = self.logp[s.sample_id][_trainable_index(s)[at]]
        return out

    def missing(self) -> int:
        """Trainable tokens no row gave a logprob for (0 unless rows and samples disagree)."""
        return sum(int(t.isnan().sum()) for t in self.logp.values())


def _by_sample(sources: Sources) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(sample index, which targets are its, their token positions) for each sample of a row."""
    index, position = sources
    return [(int(k), torch.from_numpy(index == k), torch.from_numpy(position[index == k])) for k in np.unique(index)]


def _trainable_index(s: Sample) -> torch.Tensor:
    """Token position -> its index among the sample's trainable tokens."""
    return torch.from_numpy(np.cumsum(s.loss_mask) - 1)
