"""Calls with images become vision-language samples: pads expanded per the image processor's grid, checked
against the engine's prompt ids, stored with each image once and where its tokens sit in the sample.

Expected values are computed here from the real image processor and tokenizer (transformers' own expansion:
each `<|image_pad|>` of the template's render repeated grid_t * grid_h * grid_w / merge_size**2 times),
never through the code under test.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from transformers import Qwen2VLImageProcessorPil
from typer.testing import CliRunner

from openforge.reconstruct.api import reconstruct
from openforge.reconstruct.episodes import ChainHasher
from openforge.reconstruct.stats import collect
from openforge.reconstruct.tokenize import load_tokenizer
from openforge.testing.reconstruct_flows import FlowFactory, db_rows, qwen_path
from openforge.testing.vision import IMAGE_PAD_ID, expand_pads, image_processor, pad_runs, processor_dir, screenshot

RED = screenshot("red", color="red")  # 112x112: grid 1x8x8, 16 pads
WIDE = screenshot("wide", size=(112, 56))  # grid 1x4x8, 8 pads
BLUE = screenshot("blue", color="lightblue")


@pytest.fixture(scope="module")
def pdir(tmp_path_factory) -> Path:
    return processor_dir(tmp_path_factory.mktemp("vl") / "processor")


@pytest.fixture(scope="module")
def vl_tok(pdir) -> Any:
    """The Qwen3 tokenizer with the VL chat template (what the processor directory holds)."""
    return load_tokenizer(pdir)


def url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def image_part(png: bytes) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url(png)}}


def n_pads(png: bytes) -> tuple[int, list[int]]:
    """The image's placeholder count and grid, from the image processor alone."""
    [grid] = image_processor()(images=[Image.open(io.BytesIO(png))])["image_grid_thw"].tolist()
    return grid[0] * grid[1] * grid[2] // 4, grid


def expected_prompt(tok: Any, messages: list[dict[str, Any]], images: list[bytes]) -> list[int]:
    """The template's render with each image's pad repeated (as transformers' Qwen2.5-VL processor does), encoded."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(expand_pads(text, [n_pads(png)[0] for png in images]), add_special_tokens=False)


def build(tmp_path: Path, name: str, tokenizer: Any, **kw: Any) -> Path:
    db = tmp_path / f"{name}.duckdb"
    reconstruct([tmp_path / name], db, tokenizer, missing_reward="keep", **kw)
    return db


def check_images(db: Path, sample_id: str, pngs: list[bytes], ids: list[int]) -> None:
    """sample_images rows are the pad runs of `ids`, in order, with the processor's grids and the sent bytes."""
    rows = db_rows(db, f"SELECT * FROM sample_images WHERE sample_id = '{sample_id}' ORDER BY idx")
    runs = pad_runs(ids)
    assert [(r["token_start"], r["n_tokens"]) for r in rows] == runs
    assert [r["n_tokens"] for r in rows] == [n_pads(p)[0] for p in pngs]
    assert [[r["grid_t"], r["grid_h"], r["grid_w"]] for r in rows] == [n_pads(p)[1] for p in pngs]
    for r, png in zip(rows, pngs):
        [stored] = db_rows(db, f"SELECT * FROM images WHERE hash = '{r['hash']}'")
        assert hashlib.sha256(stored["data"]).hexdigest() == r["hash"] == hashlib.sha256(png).hexdigest()
        assert bytes(stored["data"]) == png and stored["mime"] == "image/png"
    [sample] = db_rows(db, f"SELECT n_images, processor FROM samples WHERE sample_id = '{sample_id}'")
    assert sample["n_images"] == len(pngs)
    settings = json.loads(sample["processor"])
    assert settings["image_processor_type"] == "Qwen2VLImageProcessor"
    assert (settings["merge_size"], settings["patch_size"], settings["temporal_patch_size"]) == (2, 14, 2)
    rebuilt = Qwen2VLImageProcessorPil.from_dict(settings)  # as the trainer does, for pixel values
    for r, png in zip(rows, pngs):
        grid = rebuilt(images=[Image.open(io.BytesIO(png))])["image_grid_thw"].tolist()
        assert grid == [[r["grid_t"], r["grid_h"], r["grid_w"]]]


def test_chat_call_with_two_images_expands_each_pad_by_its_grid(tmp_path, pdir, vl_tok):
    """Retokenized: the prompt is the VL template's render with each image's pads expanded; the sample's
    images are its two pad runs (16 and 8 tokens), in order, and their bytes round-trip by hash."""
    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Compare "}, image_part(RED),
                                              {"type": "text", "text": " with "}, image_part(WIDE)]}]
    prompt = expected_prompt(vl_tok, messages, [RED, WIDE])
    f.write(f.chat(messages, {"content": "They differ."}, engine_ids=False, reported_prompt_tokens=len(prompt)))
    f.close()
    db = build(tmp_path, "flows", qwen_path(), processor=pdir)
    [sample] = db_rows(db, "SELECT sample_id, input_ids, token_source FROM samples")
    assert sample["input_ids"][:len(prompt)] == prompt and sample["token_source"] == "retokenized"
    assert [n for _, n in pad_runs(prompt)] == [16, 8]
    check_images(db, sample["sample_id"], [RED, WIDE], sample["input_ids"])
    assert db_rows(db, "SELECT prompt_check FROM calls") == [{"prompt_check": "match"}]  # the engine's count
    assert db_rows(db, "SELECT count(*) AS n FROM skipped") == [{"n": 0}]


@pytest.mark.parametrize("engine_ids", [False, True])
def test_images_across_turns_land_where_their_pads_are(tmp_path, pdir, vl_tok, engine_ids):
    """A screenshot per turn (the first resent on each): one chain, its images at their pad runs; with the
    engine's (expanded) prompt ids the sample is the engine's."""
    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    messages: list[dict[str, Any]] = [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "Go"}]}]
    shots = [RED]
    for turn, png in enumerate([BLUE, WIDE, None]):
        answer = f"<think>\n\n</think>\n\nStep {turn}." if engine_ids else f"Step {turn}."
        prompt = expected_prompt(vl_tok, messages, shots)
        f.write(f.chat(messages, {"content": f"Step {turn}."}, episode="ep", engine_ids=engine_ids,
                       prompt_ids=prompt if engine_ids else None))
        messages.append({"role": "assistant", "content": answer})
        if png is not None:
            messages.append({"role": "user", "content": [{"type": "text", "text": "Now:"}, image_part(png)]})
            shots.append(png)
    f.close()
    db = build(tmp_path, "flows", qwen_path(), processor=pdir)
    [sample] = db_rows(db, "SELECT sample_id, input_ids, token_source, n_calls FROM samples")
    assert sample["n_calls"] == 3 and sample["token_source"] == ("engine" if engine_ids else "retokenized")
    assert sample["input_ids"][:len(prompt)] == prompt  # the last call's: the chain's images all in it
    check_images(db, sample["sample_id"], [RED, BLUE, WIDE], sample["input_ids"])
    columns = db_rows(db, "SELECT table_name t, column_name c FROM information_schema.columns "
                          "WHERE table_name IN ('call_images', 'images', 'sample_images') "
                          "OR column_name IN ('n_images', 'processor') ORDER BY ALL")
    assert collect(db)["images"] == {"stored": 3, "samples": 1, "in samples": 3}
    assert len(columns) == 9 + 5 + 8 + 2 and all(db_rows(db, f'SELECT count("{r["c"]}") n FROM "{r["t"]}"')[0]["n"]
                                      for r in columns)


def test_engine_prompt_ids_one_pad_short_are_skipped_as_a_mismatch(tmp_path, pdir, vl_tok):
    """The engine's ids are the truth, and checked: a pad run one short of the grid is drift, never a sample."""
    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    messages = [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "Read it"}]}]
    good = expected_prompt(vl_tok, messages, [RED])
    f.write(f.chat(messages, {"content": "OK"}, prompt_ids=good))
    short = list(good)
    short.remove(IMAGE_PAD_ID)
    f.write(f.chat(messages, {"content": "OK"}, prompt_ids=short))
    f.close()
    db = build(tmp_path, "flows", qwen_path(), processor=pdir)
    [sample] = db_rows(db, "SELECT sample_id, input_ids, token_source FROM samples")
    assert sample["token_source"] == "engine" and sample["input_ids"][:len(good)] == good
    check_images(db, sample["sample_id"], [RED], sample["input_ids"])
    [skip] = db_rows(db, "SELECT reason, detail FROM skipped")
    assert skip["reason"] == "image_token_mismatch"
    assert "[16]" in skip["detail"] and "[15]" in skip["detail"]


def anthropic_record(f: FlowFactory, body: dict[str, Any], translated: bool) -> dict[str, Any]:
    """A Claude-style request with an image block, answered by the engine (as Chat when the proxy translated)."""
    from openforge.protocols import anthropic
    from openforge.protocols.chat import Drops

    if translated:
        upstream = anthropic.request(body, Drops())
        answer = {"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "A"}}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    else:
        upstream = body
        answer = {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "A"}],
                  "stop_reason": "end_turn", "usage": {"input_tokens": 1, "output_tokens": 1}}
    response = {"status": 200, "headers": [["content-type", "application/json"]],
                "body": json.dumps(answer).encode(), "chunks": None, "streamed": False}
    rec = f._exchange("anthropic", body, upstream, response, None, False, path="/v1/messages")
    rec["translated"] = {"from": "anthropic", "to": "chat"} if translated else None
    return rec


@pytest.mark.parametrize("translated", [False, True])
def test_anthropic_image_blocks(tmp_path, pdir, vl_tok, translated):
    """An Anthropic image block (base64 source), forwarded or translated to an image_url part, renders and
    expands like the Chat call it becomes."""
    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    b64 = base64.b64encode(WIDE).decode()
    body = {"model": "claude", "max_tokens": 10, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "What is this?"}]}]}
    f.write(anthropic_record(f, body, translated))
    f.close()
    db = build(tmp_path, "flows", qwen_path(), processor=pdir)
    [sample] = db_rows(db, "SELECT sample_id, input_ids FROM samples")
    chat = [{"role": "user", "content": [image_part(WIDE), {"type": "text", "text": "What is this?"}]}]
    prompt = expected_prompt(vl_tok, chat, [WIDE])
    assert sample["input_ids"][:len(prompt)] == prompt
    check_images(db, sample["sample_id"], [WIDE], sample["input_ids"])


def test_anthropic_screenshot_in_a_tool_result(tmp_path, pdir, vl_tok):
    """A computer-use loop: the screenshot comes back in a tool_result; the tool message keeps its text (none
    here) and the screenshot follows in a user message, as the proxy translates it."""
    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(RED).decode()}}
    body = {"model": "claude", "max_tokens": 10, "messages": [
        {"role": "user", "content": "Take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t0", "name": "screenshot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t0", "content": [shot]}]}]}
    f.write(anthropic_record(f, body, translated=False))
    f.close()
    db = build(tmp_path, "flows", qwen_path(), processor=pdir)
    [sample] = db_rows(db, "SELECT sample_id, input_ids FROM samples")
    chat = [{"role": "user", "content": "Take a screenshot"}, {"role": "assistant", "content": ""},
            {"role": "tool", "content": ""}, {"role": "user", "content": [image_part(RED)]}]
    prompt = expected_prompt(vl_tok, chat, [RED])
    assert sample["input_ids"][:len(prompt)] == prompt
    check_images(db, sample["sample_id"], [RED], sample["input_ids"])


def test_without_a_processor_calls_with_images_stay_skipped(tmp_path, vl_tok):
    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    f.write(f.chat([{"role": "user", "content": [image_part(RED)]}], {"content": "OK"}, engine_ids=False))
    f.close()
    db = build(tmp_path, "flows", qwen_path())
    [skip] = db_rows(db, "SELECT reason, detail FROM skipped")
    assert skip["reason"] == "images_unsupported" and "--processor" in skip["detail"]
    assert db_rows(db, "SELECT count(*) AS n FROM samples") == [{"n": 0}]


def test_text_only_calls_are_unchanged_by_a_processor(tmp_path, pdir):
    """A text-only episode gives the same samples with and without --processor, with no images."""
    f = FlowFactory(tmp_path / "flows", seed=3)
    f.tool_loop("ep", turns=2, engine_ids=False)
    f.close()
    plain = build(tmp_path, "flows", qwen_path())
    (tmp_path / "flows").rename(tmp_path / "again")
    vl = build(tmp_path, "again", qwen_path(), processor=pdir)
    query = "SELECT input_ids, loss_mask, n_images, processor FROM samples ORDER BY sample_id"
    assert db_rows(plain, query) == db_rows(vl, query)
    assert {(r["n_images"], r["processor"]) for r in db_rows(vl, query)} == {(0, None)}


def test_conversation_hashes_tell_images_apart():
    """Two conversations with the same text and different images are different conversations."""
    def conv(sha: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "image", "sha256": sha}, {"type": "text", "text": "hi"}]}]

    done = {"role": "assistant", "content": "ok"}
    a, b = ChainHasher().hashes(conv("a" * 64), None, done), ChainHasher().hashes(conv("b" * 64), None, done)
    assert a[1] != b[1] and a[3] != b[3] and a[0][0] == b[0][0]


def test_cli_refuses_a_processor_dir_without_an_image_processor(tmp_path):
    from openforge.cli import app

    (tmp_path / "flows.flows").write_bytes(b"")
    result = CliRunner().invoke(app, ["reconstruct", str(tmp_path / "flows.flows"), "--db", str(tmp_path / "x.db"),
                                      "--tokenizer", qwen_path(), "--processor", str(tmp_path)])
    assert result.exit_code == 2
    assert "error: --processor" in result.output and "preprocessor_config.json" in result.output
    assert "Traceback" not in result.output


def test_responses_input_image(tmp_path, pdir, vl_tok):
    """A Responses `input_image` part is an image part too."""
    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    request = {"model": "m", "input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Look"}, {"type": "input_image", "image_url": url(BLUE)}]}]}
    output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]}]
    f.write(f.responses(request, output, {"content": "Blue."}, engine_ids=False))
    f.close()
    db = build(tmp_path, "flows", qwen_path(), processor=pdir)
    [sample] = db_rows(db, "SELECT sample_id, input_ids FROM samples")
    chat = [{"role": "user", "content": [{"type": "text", "text": "Look"}, image_part(BLUE)]}]
    prompt = expected_prompt(vl_tok, chat, [BLUE])
    assert sample["input_ids"][:len(prompt)] == prompt
    check_images(db, sample["sample_id"], [BLUE], sample["input_ids"])


def test_later_runs_rebuild_images_from_the_database_and_check_them(tmp_path, pdir, vl_tok):
    """A later run (no --processor) rebuilds an image episode from what pass 1 stored: the same sample and
    images. Stored image tokens that no longer match the sample's pad runs skip the sample, never write it."""
    import duckdb

    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    messages = [{"role": "user", "content": [image_part(RED), {"type": "text", "text": "Go"}]}]
    f.write(f.chat(messages, {"content": "OK"}, episode="ep", engine_ids=False))
    f.close()
    db = build(tmp_path, "flows", qwen_path(), processor=pdir)
    query = "SELECT s.*, i.* EXCLUDE (sample_id) FROM samples s JOIN sample_images i USING (sample_id)"
    before = db_rows(db, query)
    reconstruct([tmp_path / "flows"], db, qwen_path(), missing_reward="fill:1")  # the reward changed: rebuilt
    after = db_rows(db, query)
    assert len(after) == 1 and after[0]["reward"] == 1.0
    same = ("reward", "advantage", "created_at")
    assert json.dumps([{**r, **dict.fromkeys(same)} for r in after], default=str) == \
        json.dumps([{**r, **dict.fromkeys(same)} for r in before], default=str)
    con = duckdb.connect(str(db))
    con.execute("UPDATE call_images SET token_start = token_start + 1")
    con.close()
    # other build options: every episode is rebuilt
    reconstruct([tmp_path / "flows"], db, qwen_path(), missing_reward="fill:1", keep_prompt_mismatch=True)
    assert db_rows(db, "SELECT count(*) AS n FROM samples") == [{"n": 0}]
    assert db_rows(db, "SELECT count(*) AS n FROM sample_images") == [{"n": 0}]
    [skip] = db_rows(db, "SELECT reason, detail FROM skipped")
    assert skip["reason"] == "sample_image_mismatch" and "expected" in skip["detail"]


def test_unreadable_images_and_stray_pads_skip_their_call_only(tmp_path, pdir, vl_tok):
    """Bytes that are no image, an image given by URL (no bytes to process), and user text that spells the
    image pad token (the render then holds more pads than images) each skip their call; the good call is built."""
    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    notpng = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}}
    by_url = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    stray = {"type": "text", "text": "what is <|image_pad|>?"}
    for parts in ([notpng], [by_url], [image_part(RED), stray], [image_part(RED)]):
        f.write(f.chat([{"role": "user", "content": parts}], {"content": "OK"}, engine_ids=False))
    f.close()
    db = build(tmp_path, "flows", qwen_path(), processor=pdir)
    skips = db_rows(db, "SELECT reason, detail FROM skipped ORDER BY reason, detail")
    assert [s["reason"] for s in skips] == ["bad_image", "bad_image", "image_token_mismatch"]
    assert "example.com" in skips[1]["detail"] + skips[0]["detail"]
    assert "2 image pad tokens for 1 images" in skips[2]["detail"]
    assert db_rows(db, "SELECT n_images FROM samples") == [{"n_images": 1}]


def test_cli_finds_the_processor_in_the_tokenizer_directory(tmp_path, pdir, vl_tok):
    """A VL model directory given as --tokenizer is its own processor."""
    from openforge.cli import app

    f = FlowFactory(tmp_path / "flows", tokenizer=vl_tok)
    f.write(f.chat([{"role": "user", "content": [image_part(WIDE)]}], {"content": "OK"}, engine_ids=False))
    f.close()
    db = tmp_path / "x.duckdb"
    result = CliRunner().invoke(app, ["reconstruct", str(tmp_path / "flows"), "--db", str(db), "--tokenizer",
                                      str(pdir), "--missing-reward", "keep"])
    assert result.exit_code == 0, result.output
    assert db_rows(db, "SELECT n_images FROM samples") == [{"n_images": 1}]
