"""Global batch -> this rank's share -> rows, each row one forward/backward.

Packed rows hold several samples back to back with position ids restarting at 0 for each. Transformers
turns restarting position ids (with no attention_mask) into "no attention across samples": a
block-diagonal causal mask for sdpa/eager, variable-length kernels for flash-attention. So a packed row
computes exactly what one-sample-per-row would, without pad tokens.

The loss is aggregated over the *global* batch: every trainable token carries a coefficient `coef`
(e.g. 1 / trainable tokens of the whole global batch for token-mean), so summing coef * loss over all
rows of all ranks is the batch loss, whatever the packing and the number of ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from openforge.trainer.data import Sample

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

MRope = Callable[[Sample], np.ndarray]  # a sample -> its [3, n] (temporal, height, width) rope positions


@dataclass
class Row:
    input_ids: torch.Tensor        # long [B, T]
    position_ids: torch.Tensor     # long [B, T]; [4, B, T] for a vision-language model (text, then t/h/w rope)
    attention_mask: torch.Tensor | BlockMask | None  # long [B, T] for padded rows; None for packed (positions
                                   # say it); bool [1, 1, T, T] for tree rows (True: the key is self or an ancestor);
                                   # a FlexAttention BlockMask once on the device for flex (`attention.flex_row`)
    loss_mask: torch.Tensor        # bool [B, T]
    behaviour: torch.Tensor        # float [B, T]; the engine's logprob, 0 where unknown
    has_behaviour: torch.Tensor    # bool [B, T]; True on trainable tokens the engine gave a logprob for
    advantage: torch.Tensor        # float [B, T]; the sample's advantage on each of its tokens
    coef: torch.Tensor             # float [B, T]; aggregation weight of each trainable token
    n_real: int                    # tokens of samples the row trains (padding excluded; a tree row counts a
                                   # shared node once per sample through it)
    parent: torch.Tensor | None = None  # long [1, T], tree rows only: the position whose logits predict each
                                        # token (-1 for a root); chain rows: position i-1 predicts i
    pixel_values: torch.Tensor | None = None    # float [patches, patch values]: the row's images in sequence order
    image_grid_thw: torch.Tensor | None = None  # long [images, 3]; None when the row has no image

    def to(self, device: torch.device) -> Row:
        moved: dict[str, Any] = {f.name: value.to(device, non_blocking=True) for f in fields(self)
                                 if isinstance(value := getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def images(self) -> dict[str, torch.Tensor]:
        """The forward's image arguments: none for a row without images."""
        if self.pixel_values is None or self.image_grid_thw is None:
            return {}
        return {"pixel_values": self.pixel_values, "image_grid_thw": self.image_grid_thw}


def coefficients(batch: list[Sample], aggregation: str) -> dict[str, float]:
    """Per-sample weight of each trainable token so that the global batch loss is the chosen mean.

    token-mean: every trainable token counts the same; seq-mean: every sample counts the same;
    episode-mean: every episode counts the same (samples of a branched episode share it via `weight`).
    """
    n = {s.sample_id: int(s.loss_mask.sum()) for s in batch}
    if aggregation == "token-mean":
        total = sum(n.values())
        return {s.sample_id: 1.0 / total for s in batch}
    if aggregation == "seq-mean":
        return {s.sample_id: 1.0 / (n[s.sample_id] * len(batch)) for s in batch}
    total_weight = sum(s.weight for s in batch)
    return {s.sample_id: s.weight / (n[s.sample_id] * total_weight) for s in batch}


def rank_share(batch: list[Sample], rank: int, world_size: int, by_episode: bool = False) -> list[Sample]:
    """This rank's disjoint share: longest first, each to the rank with the fewest tokens so far.

    by_episode (tree mode): whole episodes are dealt out, so the samples sharing prefixes stay together.
    """
    groups: dict[str, list[Sample]] = {}
    for s in batch:
        groups.setdefault(s.episode_id if by_episode else s.sample_id, []).append(s)
    size = {k: sum(len(s) for s in g) for k, g in groups.items()}
    load = [0] * world_size
    mine = []
    for key in sorted(groups, key=lambda k: (-size[k], k)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += size[key]
        if r == rank:
            mine += groups[key]
    return mine


def plan_rows(samples: list[Sample], row_tokens: int, packing: bool) -> list[list[Sample]]:
    """Group samples into rows of at most `row_tokens` tokens.

    packing: first-fit decreasing, several samples per row. Otherwise length bucketing: samples sorted
    by length, as many per row as fit when each is padded to the row's longest.
    """
    ordered = sorted(samples, key=lambda s: (-len(s), s.sample_id))
    rows: list[list[Sample]] = []
    if packing:
        free: list[int] = []
        for s in ordered:
            i = next((i for i, f in enumerate(free) if f >= len(s)), None)
            if i is None:
                rows.append([])
                free.append(row_tokens)
                i = len(rows) - 1
            rows[i].append(s)
            free[i] -= len(s)
        return rows
    for s in ordered:  # longest first, so the first sample of a row is its width
        if rows and len(rows[-1][0]) * (len(rows[-1]) + 1) <= row_tokens:
            rows[-1].append(s)
        else:
            rows.append([s])
    return rows


def make_row(samples: list[Sample], coef: dict[str, float], packing: bool, rope: MRope | None = None) -> Row:
    """Tensors for one forward pass; an empty list gives a two-token row that trains nothing.

    `rope` (vision-language models, `vision.mrope`): position ids become [4, B, T], the text positions
    (which make the packing mask) followed by the sample's 3D rope positions."""
    if not samples:
        one = torch.zeros(1, 2)
        pos = one.long() if rope is None else torch.zeros(4, 1, 2, dtype=torch.long)
        return Row(one.long(), pos, None, one.bool(), one, one.bool(), one, one, 0)
    images = [im for s in samples for im in s.images]  # sequence order, as the model scatters them
    pixels = torch.from_numpy(np.concatenate([im.pixels for im in images])) if images else None
    grids = torch.tensor([im.grid for im in images]) if images else None
    if packing:
        cat = lambda xs: torch.from_numpy(np.concatenate(xs))[None]  # noqa: E731
        parts = [_sample_arrays(s, coef[s.sample_id]) for s in samples]
        ids, mask, beh, has_beh, adv, cf = (cat([p[k] for p in parts]) for k in range(6))
        pos = cat([np.arange(len(s)) for s in samples])
        if rope is not None:
            pos = torch.cat([pos[None], torch.from_numpy(np.concatenate([rope(s) for s in samples], 1))[:, None]])
        return Row(ids, pos, None, mask, beh, has_beh, adv, cf, trained_tokens(samples), None, pixels, grids)
    width = max(len(s) for s in samples)
    padded = []
    for s in samples:
        arrays = _sample_arrays(s, coef[s.sample_id])
        pad = width - len(s)
        padded.append([np.pad(a, (0, pad)) for a in arrays])  # pad id 0: masked out of attention and loss
    ids, mask, beh, has_beh, adv, cf = (torch.from_numpy(np.stack([p[k] for p in padded])) for k in range(6))
    attn = torch.from_numpy(np.stack([np.arange(width) < len(s) for s in samples])).long()
    pos = torch.arange(width).expand(len(samples), width).clone()
    if rope is not None:
        spatial = np.stack([np.pad(rope(s), ((0, 0), (0, width - len(s)))) for s in samples], 1)  # [3, B, T]
        pos = torch.cat([pos[None], torch.from_numpy(spatial)])
    return Row(ids, pos, attn, mask, beh, has_beh, adv, cf, trained_tokens(samples), None, pixels, grids)


def trained_tokens(samples: list[Sample]) -> int:
    """Tokens of the samples that train (a row's `vision.idle_sample` does not)."""
    return sum(len(s) for s in samples if s.loss_mask.any())


def _sample_arrays(s: Sample, coef: float) -> tuple[np.ndarray, ...]:
    n = len(s)
    known = s.behaviour_logprobs is not None
    behaviour = s.behaviour_logprobs if s.behaviour_logprobs is not None else np.zeros(n, np.float32)
    return (
        s.input_ids,
        s.loss_mask,
        np.where(s.loss_mask, behaviour, 0.0).astype(np.float32),
        s.loss_mask & known,
        np.full(n, s.advantage, np.float32),
        np.where(s.loss_mask, coef, 0.0).astype(np.float32),
    )
