"""Vision-language training on a tiny random Qwen2.5-VL: pixel values rebuilt from the recorded processor
settings, packed rows with mrope positions, gradients into the vision tower, end to end with a checkpoint,
and the samples whose image records disagree with their tokens or bytes refused before step 1."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import duckdb
import numpy as np
import pytest
import torch

from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, train_on_ranks, write_samples
from openforge.testing.trainer_tree import assert_same_run, assert_same_step, run_metrics, run_rows
from openforge.testing.vision import (
    IMAGE_PAD_ID,
    VISION_END_ID,
    VISION_START_ID,
    image_processor,
    screenshot,
    tiny_vl_model_dir,
)
from openforge.trainer.config import TrainConfig, load_config
from openforge.trainer.data import DataError, SampleSource
from openforge.trainer.model import load_model
from openforge.trainer.packing import coefficients, make_row
from openforge.trainer.train import train
from openforge.trainer.vision import attach_pixels, mrope

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PADS = 16  # a 112x112 screenshot: grid 1x8x8, merge 2 -> 16 pad tokens
SETTINGS = json.dumps(image_processor().to_dict())


def vl_sample(tok, sample_id: str, episode: str, texts: list[str], reply: str, rng: np.random.Generator) -> dict:
    """A user turn with one image per text (vision start, 16 pads, vision end), then a trainable reply."""
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    ids = enc("<|im_start|>system\nYou are a computer-use agent.<|im_end|>\n<|im_start|>user\n")
    for text in texts:
        ids += [VISION_START_ID] + [IMAGE_PAD_ID] * PADS + [VISION_END_ID] + enc(f"screen: {text}\n")
    ids += enc("<|im_end|>\n<|im_start|>assistant\n")
    completion = enc(reply) + enc("<|im_end|>")
    mask = [0] * len(ids) + [1] * len(completion)
    ids += completion
    lp = np.where(np.array(mask) == 1, -rng.uniform(0.5, 4.0, len(ids)), np.nan).astype(np.float32)
    return {"sample_id": sample_id, "episode_id": episode, "input_ids": ids, "loss_mask": mask,
            "behaviour_logprobs": lp.tolist(), "reward": 1.0, "advantage": 0.5, "weight": 1.0, "texts": texts}


def write_vl_db(db: Path, samples: list[dict], grids: dict[tuple[str, int], tuple[int, int, int]] | None = None,
                settings: str = SETTINGS) -> Path:
    """The samples through schema.sql, plus images / sample_images as reconstruct records them (`grids`
    overrides the recorded grid of (sample_id, image index); `settings` the processor's)."""
    write_samples(db, samples)
    con = duckdb.connect(str(db))
    for s in samples:
        starts = [i for i, t in enumerate(s["input_ids"]) if t == VISION_START_ID]
        for idx, (text, start) in enumerate(zip(s.get("texts", []), starts)):
            data = screenshot(text)
            digest = hashlib.sha256(data).hexdigest()
            con.execute("INSERT OR IGNORE INTO images VALUES (?, 'image/png', ?, 112, 112)", [digest, data])
            grid = (grids or {}).get((s["sample_id"], idx), (1, 8, 8))
            con.execute("INSERT INTO sample_images VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [s["sample_id"], idx, digest, start + 1, PADS, *grid])
        if s.get("texts"):
            con.execute("UPDATE samples SET n_images = ?, processor = ? WHERE sample_id = ?",
                        [len(s["texts"]), settings, s["sample_id"]])
    con.close()
    return db


def vl_samples() -> list[dict]:
    """Two turns of one episode sharing a screenshot, a sample with two images, and a text-only one."""
    tok, rng = qwen_tokenizer(), np.random.default_rng(0)
    text_only = make_samples(tok, 1, seed=3)[0] | {"sample_id": "vt", "episode_id": "e9"}  # sorts last
    return [
        vl_sample(tok, "v0", "e0", ["login page"], "click the login button", rng),
        vl_sample(tok, "v1", "e0", ["login page"], "type the password and press enter", rng),
        vl_sample(tok, "v2", "e1", ["settings", "dialog open"], "close the dialog", rng),
        text_only,
    ]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = tmp_path_factory.mktemp("vision")
    model = tiny_vl_model_dir(base / "model")
    return base, model, write_vl_db(base / "runs.duckdb", vl_samples())


@pytest.fixture(scope="module")
def packed_vs_single(setup):
    """One sft step (its gradients are large enough to compare; ppo's engine weights make them tiny) of all
    samples on one packed row, on one padded row, and on one row per sample."""
    base, model_dir, db = setup
    model = load_model(str(model_dir), torch.device("cpu"))
    cfg = TrainConfig(objective="sft", logit_chunk=16)
    with SampleSource(str(db), shuffle=False) as source:
        samples = list(source.samples(0))
        attach_pixels(source, samples)
    coef, rope = coefficients(samples, cfg.aggregation), mrope(model)
    packed = run_rows(model, [make_row(samples, coef, True, rope)], cfg)
    single = run_rows(model, [make_row([s], coef, True, rope) for s in samples], cfg)
    padded = run_rows(model, [make_row(samples, coef, False, rope)], cfg)
    return samples, packed, single, padded


def test_samples_carry_their_images_in_sequence_order(packed_vs_single):
    samples = {s.sample_id: s for s in packed_vs_single[0]}
    assert [len(s.images) for s in samples.values()] == [1, 1, 2, 0]
    assert samples["v0"].images[0].hash == samples["v1"].images[0].hash  # the episode's shared screenshot
    two = samples["v2"].images
    assert two[0].token_start < two[1].token_start and two[0].hash != two[1].hash
    for im in two:
        assert im.pixels.shape == (64, 1176) and im.grid == (1, 8, 8)
        assert (samples["v2"].input_ids[im.token_start:im.token_start + im.n_tokens] == IMAGE_PAD_ID).all()


def test_packed_and_padded_rows_equal_one_sample_per_row(packed_vs_single):
    _, packed, single, padded = packed_vs_single
    assert_same_step(packed, single)
    assert_same_step(padded, single)


def test_gradients_reach_the_vision_tower(packed_vs_single):
    grads = packed_vs_single[1][2]
    visual = {n: g for n, g in grads.items() if ".visual." in f".{n}"}
    assert visual and all(torch.isfinite(g).all() for g in visual.values())
    assert all(g.abs().sum() > 0 for n, g in visual.items() if "blocks.0." in n or "merger" in n), \
        [n for n, g in visual.items() if not g.abs().sum()]


def test_mrope_positions_restart_per_packed_sample(setup, packed_vs_single):
    samples = packed_vs_single[0]
    model = load_model(str(setup[1]), torch.device("cpu"))
    row = make_row(samples, coefficients(samples, "token-mean"), True, mrope(model))
    pos = row.position_ids[:, 0]
    assert pos.shape == (4, sum(len(s) for s in samples))
    starts = np.cumsum([0] + [len(s) for s in samples[:-1]])
    assert (pos[:, starts] == 0).all()
    v0 = samples[0]
    first = v0.images[0].token_start
    image = pos[1:, first:first + PADS]  # t, h, w of a 1x4x4 merged grid
    assert (image[0] == first).all() and image[1].tolist() == [first + i // 4 for i in range(PADS)]
    assert image[2].tolist() == [first + i % 4 for i in range(PADS)]
    text_only = pos[:, starts[3]:]
    assert (text_only == torch.arange(text_only.shape[1])).all()
    assert row.image_grid_thw.tolist() == [[1, 8, 8]] * 4 and row.pixel_values.shape == (4 * 64, 1176)


def config(setup, out: str, db: Path | None = None, **kw):
    base, model, default_db = setup
    values = dict(db=str(db or default_db), model=str(model), out=str(base / out), step_tokens=160,
                  row_tokens=160, lr=3e-3, steps=2, progress=False, shuffle=False, device="cpu") | kw
    return load_config(None, values)


def test_train_runs_and_the_checkpoint_serves(setup):
    """Two steps (vision blocks checkpointed too); the checkpoint loads whole, with the processor files."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    cfg = config(setup, "run", grad_checkpointing=True)
    final = train(cfg, say=lambda _: None)
    metrics = run_metrics(cfg)
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)
    assert sum(m["samples"] for m in metrics) == 4
    for name in ("preprocessor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (final / name).read_bytes() == (setup[1] / name).read_bytes(), name
    loaded, info = AutoModelForImageTextToText.from_pretrained(final, dtype=torch.float32, output_loading_info=True)
    assert type(loaded).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    saved = load_file(final / "model.safetensors")
    for name, tensor in loaded.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    start = AutoModelForImageTextToText.from_pretrained(setup[1], dtype=torch.float32)
    name = "model.visual.blocks.0.mlp.up_proj.weight"
    assert not torch.equal(loaded.state_dict()[name], start.state_dict()[name])  # the vision tower trained


def refused(setup, tmp_path: Path, samples: list[dict], **kw) -> str:
    db = tmp_path / f"bad{len(list(tmp_path.glob('*.duckdb')))}.duckdb"  # a refused run leaves its file open
    write_vl_db(db, samples, kw.pop("grids", None), kw.pop("settings", SETTINGS))
    if "sql" in kw:  # what a faulty writer would leave
        with duckdb.connect(str(db)) as con:
            con.execute(kw.pop("sql"))
    cfg = config(setup, str(tmp_path / "out"), db=db, **kw)
    with pytest.raises(DataError) as e:
        train(cfg, say=lambda _: None)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # before step 1
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    return str(e.value)


def test_a_grid_the_image_does_not_give_is_refused(setup, tmp_path):
    message = refused(setup, tmp_path, vl_samples(), grids={("v2", 1): (1, 4, 16)})  # 16 tokens, wrong shape
    assert "differs from the recorded one: v2." in message


def test_image_records_that_disagree_with_the_tokens_are_refused(setup, tmp_path):
    samples = vl_samples()
    ids = samples[1]["input_ids"]
    ids[ids.index(IMAGE_PAD_ID) + 3] = 42  # a pad position holding another token
    assert "image positions holding other tokens than the image pad (151655): v1." in refused(setup, tmp_path, samples)
    message = refused(setup, tmp_path, vl_samples(), grids={("v0", 0): (1, 8, 16)})
    assert "n_tokens is not grid_t * grid_h * grid_w / merge_size^2" in message and ": v0." in message


def test_an_image_that_does_not_decode_is_refused(setup, tmp_path):
    data = screenshot("dialog open")
    sql = f"UPDATE images SET data = 'not a png' WHERE hash = '{hashlib.sha256(data).hexdigest()}'"
    message = refused(setup, tmp_path, vl_samples(), sql=sql)
    assert "of 1 selected samples (v2) cannot be processed" in message


def test_processor_settings_that_do_not_fit_the_vision_tower_are_refused(setup, tmp_path):
    settings = json.dumps(json.loads(SETTINGS) | {"patch_size": 16})
    message = refused(setup, tmp_path, vl_samples(), settings=settings)
    assert "3 selected samples (first: v0)" in message and "patch_size 16 (the model's patch_size: 14)" in message


def test_fsdp_finds_the_vision_blocks(setup):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(setup[1])
    present = {type(m).__name__ for m in model.modules()}
    assert {"Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock"} <= set(model._no_split_modules) & present


def test_images_are_refused_in_tree_mode_and_for_a_text_only_model(setup, tmp_path, tiny_qwen_dir):
    assert "tree mode does not train images" in refused(setup, tmp_path, vl_samples(), tree=True)
    message = refused(setup, tmp_path, vl_samples(), model=str(tiny_qwen_dir))
    assert "3 selected samples have images but the model has no vision tower" in message


def test_two_gloo_processes_shard_a_vl_model_like_one_process(setup, tmp_path):
    """FSDP2 wraps the vision blocks too; text-only samples on a VL model train the same on 2 ranks as on 1
    (a rank short of rows runs an empty one with [4, 1, 2] positions), and so do samples with images: a rank's
    row without an image carries the idle image segment, so every rank runs the sharded vision tower."""
    samples = make_samples(qwen_tokenizer(), 3, seed=1)
    text_db = write_samples(tmp_path / "text.duckdb", samples)
    rows = dict(row_tokens=max(len(s["input_ids"]) for s in samples), step_tokens=4096)  # a sample per row
    one = config(setup, str(tmp_path / "one"), db=text_db, **rows)
    train(one, say=lambda _: None)
    two = config(setup, str(tmp_path / "two"), db=text_db, **rows)
    train_on_ranks(two, world_size=2)
    assert_same_run(one, two)
    rows = dict(row_tokens=max(len(s["input_ids"]) for s in vl_samples()), step_tokens=4096)  # one text-only row
    one = config(setup, str(tmp_path / "one-images"), **rows)
    train(one, say=lambda _: None)
    two = config(setup, str(tmp_path / "two-images"), **rows)
    train_on_ranks(two, world_size=2)
    assert_same_run(one, two)
