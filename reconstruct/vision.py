"""Vision-language calls: image grids from the model's image processor, and the image pad tokens they expand to.

A Qwen2.5-VL / Qwen3-VL chat template renders each image as `<|vision_start|><|image_pad|><|vision_end|>`; the
processor (transformers' `Qwen2_5_VLProcessor`) then repeats the one pad `grid_t * grid_h * grid_w /
merge_size**2` times, where the grid is what the image processor makes of the image after its resize. vLLM
does the same, so an engine's prompt ids hold one run of pads per image, of exactly that length.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from openforge.reconstruct.calls import Image, Skip
from openforge.reconstruct.tokenize import Retokenizer

PROCESSOR_CONFIG = "preprocessor_config.json"
IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"


class ProcessorError(ValueError):
    """A processor directory that cannot be used, with the sentence that says why."""


@dataclass(frozen=True)
class Grid:
    """One image as the processor sees it: its patch grid, the pad tokens it becomes, its size in pixels."""

    t: int
    h: int
    w: int
    n_tokens: int
    width: int
    height: int


def is_processor_dir(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / PROCESSOR_CONFIG).is_file()


def chat_template(path: str | os.PathLike[str]) -> str | None:
    """The chat template a processor directory ships (the one that renders image parts), or None."""
    d = Path(path)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text(encoding="utf-8")
    for name in ("chat_template.json", "processor_config.json", "tokenizer_config.json"):
        try:
            template = json.loads((d / name).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(template, str):
            return template
    return None


class Vision:
    """An image processor plus the tokenizer's vision token ids: grids per image, pad runs per prompt.

    `retok` renders calls with images: the policy's tokenizer with the VL chat template. Grids are cached by
    image hash: an agent resends every earlier screenshot on each turn.
    """

    def __init__(self, image_processor: Any, retok: Retokenizer) -> None:
        self.image_processor, self.retok = image_processor, retok
        tokenizer = retok.tok
        self.merge_size = int(getattr(image_processor, "merge_size", None) or 1)
        pad_id = image_pad_id(tokenizer)
        if pad_id is None or None in (_token_id(tokenizer, VISION_START), _token_id(tokenizer, VISION_END)):
            raise ProcessorError(f"the tokenizer has no {IMAGE_PAD}, {VISION_START} or {VISION_END} token "
                                 "(give the tokenizer of the vision-language model)")
        self.pad_id = pad_id
        # what the trainer rebuilds the image processor from (`image_processor_type` names its class)
        self.settings = json.dumps(json.loads(image_processor.to_json_string()), sort_keys=True)
        self._grids: dict[str, Grid] = {}

    @classmethod
    def load(cls, path: str | os.PathLike[str], retok: Retokenizer) -> Vision:
        """The image processor of a processor directory, and its chat template unless `retok` was given one
        (--chat-template: the engine's); ProcessorError when the directory has no usable processor."""
        if not is_processor_dir(path):
            raise ProcessorError(f"{path} has no {PROCESSOR_CONFIG} (give a vision-language model's directory)")
        from transformers import AutoImageProcessor

        try:
            image_processor = AutoImageProcessor.from_pretrained(os.fspath(path))
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad processor directory
            raise ProcessorError(f"cannot load the image processor from {path}: {type(e).__name__}: {e}") from None
        template = retok.chat_template or chat_template(path)
        return cls(image_processor, Retokenizer(retok.tok, chat_template=template))

    def grid(self, index: int, image: Image) -> Grid:
        """The image's grid (cached by hash), or Skip `bad_image` for bytes that are no image the processor reads."""
        grid = self._grids.get(image.sha256)
        if grid is not None:
            return grid
        from PIL import Image as PILImage

        try:
            pil = PILImage.open(io.BytesIO(image.data))
            pil.load()
            [(t, h, w)] = np.asarray(self.image_processor(images=[pil])["image_grid_thw"]).tolist()
        except Exception as e:  # noqa: BLE001 - PIL and the processor raise many classes for bad bytes
            what = f"a URL ({image.data[:80].decode('utf-8', 'replace')}), not its bytes" \
                if image.mime == "text/uri-list" else f"{image.mime or 'unknown type'}"
            raise Skip("bad_image", f"image {index} ({what}) cannot be processed: {type(e).__name__}: {e}") from None
        grid = Grid(int(t), int(h), int(w), int(t * h * w) // self.merge_size**2, *pil.size)
        self._grids[image.sha256] = grid
        return grid

    def expand(self, ids: list[int], grids: list[Grid]) -> list[int]:
        """Each image pad of a rendered prompt repeated into its image's tokens, as the VL processor does.

        Skip `image_token_mismatch` when the render holds another number of pads than there are images.
        """
        n_pads = ids.count(self.pad_id)
        if n_pads != len(grids):
            raise Skip("image_token_mismatch",
                       f"the chat template rendered {n_pads} image pad tokens for {len(grids)} images")
        out: list[int] = []
        k = 0
        for i in ids:
            if i == self.pad_id:
                out.extend([i] * grids[k].n_tokens)
                k += 1
            else:
                out.append(i)
        return out

    def check_runs(self, ids: list[int] | np.ndarray, grids: list[Grid]) -> list[int]:
        """The start of each image's pad run in `ids`; Skip `image_token_mismatch` naming what was expected
        and found when the runs are not one per image, of its number of tokens, in order."""
        runs = pad_runs(ids, self.pad_id)
        expected = [g.n_tokens for g in grids]
        if [n for _, n in runs] != expected:
            raise Skip("image_token_mismatch",
                       f"expected {len(expected)} image pad runs of {expected} tokens (the processor's grids), "
                       f"found {len(runs)} of {[n for _, n in runs][:20]}")
        return [start for start, _ in runs]


def pad_runs(ids: list[int] | np.ndarray, pad_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `pad_id` in `ids`."""
    is_pad = np.asarray(ids) == pad_id
    if not is_pad.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_pad.astype(np.int8), [0]])))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def image_pad_id(tokenizer: Any) -> int | None:
    """The id of the tokenizer's image pad token (its `image_token`, else `<|image_pad|>`), None without one."""
    return _token_id(tokenizer, getattr(tokenizer, "image_token", None) or IMAGE_PAD)


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of an added token, or None when the tokenizer does not have it."""
    i = tokenizer.convert_tokens_to_ids(token)
    return None if i is None or i == getattr(tokenizer, "unk_token_id", None) else int(i)
