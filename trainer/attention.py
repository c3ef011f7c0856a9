"""Which attention the trainer runs (`attention` in TrainConfig), and FlexAttention's masks for its rows.

One mask serves every row: query q sees key k iff k <= q < end[k], where end[k] is one past the last position
allowed to see k. In a packed chain row that is the end of k's sample (a causal document mask: no attention
across samples); in a tree row (preorder, trainer/tree.py) the end of k's subtree, so q sees itself and its
ancestors only. A chain is a tree without branches. The mask is a [B, L] tensor of ends captured by a
`mask_mod`, never the dense [B, 1, T, T] mask sdpa takes; `create_block_mask` turns it into a BlockMask whose
fully masked 128x128 blocks FlexAttention skips (most of a packed or tree row).

Rows are padded to a few fixed lengths (`row_length`): powers of two from 128, at most `row_tokens` rounded up
to 128. A compiled FlexAttention kernel (and the compiled mask builder) is specialised to its sequence length,
so one per length is compiled, once per run: 7 lengths for 8192-token rows, and packed rows, filled close to
`row_tokens` by first-fit packing, mostly take the largest with under 128 tokens of padding. Padding has end 0
(nothing sees it) and sees nothing (every real end is <= the real length); it trains nothing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from openforge.settings import ConfigError
from openforge.trainer.packing import Row
from openforge.trainer.tree import subtree_ends

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask, _mask_mod_signature
    from transformers import PreTrainedModel

BLOCK = 128  # FlexAttention's sparse block size (its default): padded lengths are multiples of it


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401  (variable-length kernels for packed rows)
    except ImportError:
        return False
    return True


def choose_attention(setting: str, device: torch.device, tree: bool | str, vision: bool) -> tuple[str, str]:
    """transformers' attn_implementation for `attention = setting` on `device`, and why (the trainer says both).

    sdpa is the exact path on CPU (FlexAttention has no backward there); flash-attention takes no tree mask,
    and flex is not wired for vision-language models, whose vision tower has attention of its own."""
    cuda = device.type == "cuda"
    if setting == "sdpa":
        return "sdpa", "attention = sdpa"
    if setting == "flex":
        if not cuda:
            raise ConfigError("attention = flex needs CUDA (FlexAttention has no backward on CPU): use auto or sdpa")
        if not flex_available():
            raise ConfigError("attention = flex: torch.nn.attention.flex_attention does not import in this torch")
        if vision:
            raise ConfigError("attention = flex takes text-only models: use auto or sdpa for a vision-language model")
        return "flex_attention", "attention = flex"
    if setting == "flash":
        if not cuda or not flash_available():
            raise ConfigError("attention = flash needs CUDA and the flash_attn package: use auto, flex or sdpa")
        if tree is not False:
            raise ConfigError("attention = flash takes no tree mask: set tree = false, or use auto, flex or sdpa")
        return "flash_attention_2", "attention = flash"
    if not cuda:
        return "sdpa", "auto on CPU: the exact path"
    if flex_available() and not vision:
        return "flex_attention", "auto on CUDA: FlexAttention block masks, no attention across samples or branches"
    if flash_available() and tree is False:
        return "flash_attention_2", "auto on CUDA: flash_attn's variable-length kernels"
    return "sdpa", "auto on CUDA: " + ("a vision-language model" if vision else "no FlexAttention in this torch")


def row_length(n: int, row_tokens: int) -> int:
    """The padded length of an n-token row: the next power of two from BLOCK, at most row_tokens rounded up to
    BLOCK (one compiled kernel per length, see the module's docstring)."""
    cap = -(-max(n, row_tokens) // BLOCK) * BLOCK
    return min(max(BLOCK, 1 << (n - 1).bit_length()), cap)


def chain_ends(position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, T] ends of a chain row: a sample ends where the next one starts (position 0) or where padding (0 in
    the [B, T] attention_mask of a padded row) or the row begins; padding's end is 0."""
    b, t = position_ids.shape
    real = torch.ones(b, t, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    sample = ((position_ids == 0) | ~real).cumsum(1)  # each padding token its own segment: no sample runs into it
    last = torch.zeros(b, t + 1, dtype=torch.long).scatter_reduce(1, sample, torch.arange(1, t + 1).expand(b, t),
                                                                   "amax")
    return torch.where(real, last.gather(1, sample), 0)


def row_ends(row: Row) -> torch.Tensor:
    """[B, T] ends of a CPU row: a tree row's subtree ends (`tree.subtree_ends`), a chain row's sample ends."""
    if row.parent is not None:
        return torch.from_numpy(subtree_ends(row.parent[0].numpy()))[None]
    mask = row.attention_mask  # a CPU row's: a tensor or None (BlockMasks are made on the device)
    return chain_ends(row.position_ids, mask if isinstance(mask, torch.Tensor) else None)


def interval_mask(ends: torch.Tensor) -> _mask_mod_signature:
    """The mask_mod of `ends` [B, L]: key kv is visible to query q iff kv <= q < ends[b, kv]."""
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (q < ends[b, kv])
    return mask_mod


def block_mask(ends: torch.Tensor) -> BlockMask:
    """The BlockMask of `interval_mask(ends)` for a [B, L] row, built on ends' device (compiled on CUDA, where
    the uncompiled builder would materialise every row's L x L mask)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, n = ends.shape
    return create_block_mask(interval_mask(ends), b, None, n, n, device=ends.device, _compile=ends.is_cuda,
                             BLOCK_SIZE=BLOCK)


def flex_row(row: Row, row_tokens: int, device: torch.device) -> Row:
    """A CPU row padded to `row_length` (id 0, position 0, nothing trained) on `device`, its attention_mask the
    BlockMask of its ends."""
    n = row.input_ids.shape[1]
    pad = row_length(n, row_tokens) - n
    grow = lambda t, value=0: F.pad(t, (0, pad), value=value)  # noqa: E731  (the last dim: tokens)
    padded = replace(row, input_ids=grow(row.input_ids), position_ids=grow(row.position_ids), attention_mask=None,
                     loss_mask=grow(row.loss_mask), behaviour=grow(row.behaviour),
                     has_behaviour=grow(row.has_behaviour), advantage=grow(row.advantage), coef=grow(row.coef),
                     parent=None if row.parent is None else grow(row.parent, -1)).to(device)
    padded.attention_mask = block_mask(grow(row_ends(row)).to(device))
    return padded


def to_device(row: Row, model: PreTrainedModel, device: torch.device, row_tokens: int) -> Row:
    """The row on `device` in the form the model's attention takes: `flex_row` for a model loaded with
    flex_attention, the row as it is otherwise."""
    if model.config._attn_implementation == "flex_attention":
        return flex_row(row, row_tokens, device)
    return row.to(device)
