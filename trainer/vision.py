"""Images of vision-language samples: pixel values rebuilt from the stored bytes, and mrope positions.

Reconstruct records, per image, the placeholder tokens it expanded into and the grid the engine's image
processor computed, plus that processor's settings (`samples.processor`, its to_dict()). The trainer
rebuilds the same processor (PIL backend, no torchvision) from those settings, so the vision tower sees the
pixels the engine saw, and refuses an image whose processed grid differs from the recorded one.
"""

from __future__ import annotations

import io
import json
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from openforge.trainer.data import DataError, Sample, SampleImage, SampleSource
from openforge.trainer.packing import MRope

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.image_processing_utils import BaseImageProcessor


@lru_cache(maxsize=8)
def image_processor(settings: str) -> BaseImageProcessor:
    """The image processor the settings describe, PIL backend (torchvision may be absent)."""
    import transformers

    values = json.loads(settings)
    name = str(values.get("image_processor_type", "")).removesuffix("Fast")
    cls = (getattr(transformers, f"{name}Pil", None) or getattr(transformers, name, None)) if name else None
    if cls is None:
        raise DataError(f"samples name the image processor {name or '(none)'!r}, which this transformers "
                        f"({transformers.__version__}) does not have. Re-run `openforge reconstruct` with a "
                        "processor it knows, or leave them out (--where 'n_images = 0').")
    return cls.from_dict(values)


def process(settings: str, data: bytes) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image's pixel values (float32 [t * h * w, patch values]) and its (t, h, w) grid."""
    from PIL import Image

    image: Image.Image = Image.open(io.BytesIO(data))
    image.load()
    out = image_processor(settings)(images=[image], return_tensors="np")
    t, h, w = (int(x) for x in out["image_grid_thw"][0])
    return np.asarray(out["pixel_values"], dtype=np.float32), (t, h, w)


def attach_pixels(source: SampleSource, samples: list[Sample]) -> None:
    """Set the pixel values of every image of these samples (one rank's share of a global batch); an image
    used by several samples (an episode's turns) is read and processed once."""
    wanted = {(im.hash, settings_of(s)) for s in samples for im in s.images}
    if not wanted:
        return
    data = source.image_bytes(sorted({h for h, _ in wanted}))
    done = {(h, settings): process(settings, data[h]) for h, settings in wanted}
    bad = []
    for s in samples:
        for im in s.images:
            im.pixels, grid = done[im.hash, settings_of(s)]
            if grid != im.grid:
                bad.append(s.sample_id)
    if bad:
        raise DataError(grid_error(sorted(set(bad))))


def settings_of(s: Sample) -> str:
    """An image sample's processor settings (reconstruct records them with its images)."""
    if s.processor is None:
        raise DataError(f"sample {s.sample_id} has images but no processor settings. Re-run `openforge reconstruct`.")
    return s.processor


def check_pixels(source: SampleSource, vision: PretrainedConfig) -> None:
    """Before step 1: refuse samples whose processor settings do not fit the model's vision tower (`vision`,
    its vision_config), then process each distinct (image, settings) of the selection once and refuse the
    samples whose recorded grid differs (reconstructed with other settings, or the wrong image)."""
    for settings, n, first in source.rows(
        f"SELECT processor, count(*), min(sample_id) FROM samples WHERE {source.filter} AND n_images > 0 "
        "GROUP BY processor ORDER BY 3"
    ):
        values = json.loads(settings)
        wrong = [f"{key} {values.get(key)} (the model's {name}: {getattr(vision, name)})" for key, name in FITS
                 if values.get(key) != getattr(vision, name)]
        if wrong:
            raise DataError(f"{n} selected samples (first: {first}) were processed with settings that do not fit "
                            f"the model's vision tower: {', '.join(wrong)}. Train the model they were "
                            "reconstructed for, or leave them out with --where.")
    groups = source.rows(
        "SELECT i.hash, s.processor, [i.grid_t, i.grid_h, i.grid_w], list(DISTINCT s.sample_id ORDER BY s.sample_id) "
        f"FROM samples s JOIN sample_images i USING (sample_id) WHERE {source.filter} AND s.n_images > 0 "
        "GROUP BY ALL ORDER BY 1, 2"
    )
    bad: set[str] = set()
    grids: dict[tuple[str, str], tuple[int, int, int]] = {}
    for digest, settings, recorded, sample_ids in groups:
        if (digest, settings) not in grids:
            try:
                grids[digest, settings] = process(settings, source.image_bytes([digest])[digest])[1]
            except (OSError, ValueError) as e:  # PIL's UnidentifiedImageError is an OSError
                raise DataError(f"image {digest} of {len(sample_ids)} selected samples ({', '.join(sample_ids[:5])}) "
                                f"cannot be processed: {e}. Re-run `openforge reconstruct`, or leave them out "
                                "with --where.") from None
        if grids[digest, settings] != tuple(recorded):
            bad.update(sample_ids)
    if bad:
        raise DataError(grid_error(sorted(bad)))


# (processor setting, the vision config's name for it): pixel values of other sizes do not fit the tower
FITS = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size"))


def grid_error(sample_ids: list[str]) -> str:
    return (f"{len(sample_ids)} selected samples have an image whose grid, processed with the sample's processor "
            f"settings, differs from the recorded one: {', '.join(sample_ids[:5])}"
            f"{' ...' if len(sample_ids) > 5 else ''}. Re-run `openforge reconstruct`, or leave them out with "
            "--where.")


def mrope(model: PreTrainedModel) -> MRope | None:
    """The model's own 3D rope positions (`get_rope_index`) of one sample; None for a text-only model.

    Computed per sample, so they restart at 0 in a packed row like the text positions do."""
    config = model.config
    if getattr(config, "vision_config", None) is None:
        return None
    inner, pad = model.model, config.image_token_id

    def positions(s: Sample) -> np.ndarray:
        if not s.images:
            return np.broadcast_to(np.arange(len(s)), (3, len(s)))
        ids = torch.from_numpy(s.input_ids)[None]
        grid = torch.tensor([im.grid for im in s.images])
        pos, _ = inner.get_rope_index(ids, mm_token_type_ids=(ids == pad).int(), image_grid_thw=grid)
        return pos[:, 0].numpy()

    return positions


def idle_sample(config: PretrainedConfig) -> Sample:
    """An image segment that trains nothing, for the rows without an image when several ranks train images.

    FSDP2 shards the vision tower's blocks, so each pass gathers their weights on every rank together: every
    rank must run the tower in every pass. This segment (vision start, one image pad, vision end: a black
    image of one merged patch) is packed apart from the row's samples, so nothing computed from it reaches a
    loss and the tower's gradients from it are zero."""
    v, merge = config.vision_config, config.vision_config.spatial_merge_size
    ids = np.array([config.vision_start_token_id, config.image_token_id, config.vision_end_token_id])
    pixels = np.zeros((merge * merge, v.in_channels * v.temporal_patch_size * v.patch_size ** 2), np.float32)
    image = SampleImage("(idle)", 1, 1, (1, merge, merge), pixels)
    return Sample("(idle)", "(idle)", ids, np.zeros(len(ids), bool), None, 0.0, None, 0.0, images=[image])
