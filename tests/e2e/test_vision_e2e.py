"""Screenshots in, exact VL samples out, trained: the GUI agent solves screens through a real mitmdump over Chat
Completions and Anthropic Messages (translated, with Anthropic's computer-use tool) in front of an engine that
counts (and, as vLLM serving a Qwen-VL model, returns) prompt ids with each image's pads expanded; `openforge
reconstruct` with the policy's processor makes samples of them, from the engine's ids or rendered; the trainer
takes two steps on them with a tiny Qwen2.5-VL-shaped model and the real Qwen3 tokenizer."""

from __future__ import annotations

import hashlib
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from typer.testing import CliRunner

from openforge.cli import app
from openforge.examples.gui import GuiTask, after_click, score
from openforge.examples.gui_agent import run_episode
from openforge.protocols.control import ControlClient
from openforge.reconstruct.tokenize import load_tokenizer
from openforge.testing.gui_engine import GuiEngine
from openforge.testing.reconstruct_flows import db_rows
from openforge.testing.vision import image_processor, pad_runs, qwen3_vl_chat_template, tiny_vl_model_dir
from openforge.trainer.config import TrainConfig
from openforge.trainer.train import train


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The policy: its weights, tokenizer, image processor and a Qwen3-VL-style template (tools rendered)."""
    return tiny_vl_model_dir(tmp_path_factory.mktemp("vl") / "model", chat_template=qwen3_vl_chat_template())


@pytest.mark.parametrize("profile", ["vllm", "generic"])  # prompt and completion ids from the engine / rendered
def test_gui_episodes_become_exact_vl_samples_and_train(start_proxy: Any, model_dir: Path, tmp_path: Path,
                                                        profile: str) -> None:
    sent: dict[str, bytes] = {}  # every screenshot an agent sent, by sha256
    with GuiEngine(tokenizer=load_tokenizer(model_dir), image_processor=image_processor(), profile=profile) as engine:
        proxy = start_proxy(engine.url, f"openforge_engine_profile={profile}")
        for protocol in ("chat", "anthropic"):
            for seed in (0, 1):
                task, episode = GuiTask(seed), f"{protocol}-{seed}"
                done = run_episode(f"{proxy.url}/e/{episode}", task.instruction, task.screenshot(),
                                   protocol=protocol)
                assert done.error is None and done.n_calls == 2
                [[x, y]] = done.screen.clicks
                for png in (task.screenshot(), after_click(task.screenshot(), x, y)):
                    sent[hashlib.sha256(png).hexdigest()] = png
                ControlClient(proxy.url).reward(episode, score(task, done.screen.clicks) - 0.5 * seed)
        proxy.status()  # every answered exchange is on disk
        flows = proxy.flow_files()

    db = tmp_path / "vl.duckdb"
    result = CliRunner().invoke(app, ["reconstruct", *map(str, flows), "--db", str(db), "--tokenizer", str(model_dir)])
    assert result.exit_code == 0, result.output  # the processor is found beside the tokenizer
    assert db_rows(db, "SELECT reason, count(*) n FROM skipped GROUP BY 1") == []
    calls = db_rows(db, "SELECT protocol, token_source, prompt_check, count(*) n FROM calls GROUP BY ALL ORDER BY ALL")
    source, check = ("engine", "engine") if profile == "vllm" else ("retokenized", "match")  # pads counted alike
    assert calls == [{"protocol": p, "token_source": source, "prompt_check": check, "n": 4}
                     for p in ("anthropic", "chat")]

    # Each image's bytes once, by hash; each sample's images exactly at its pad runs, with the processor's grid.
    images = {r["hash"]: r["data"] for r in db_rows(db, "SELECT hash, data FROM images")}
    assert images == sent and all(hashlib.sha256(d).hexdigest() == h for h, d in images.items())
    samples = db_rows(db, "SELECT sample_id, input_ids, n_images, n_trainable, processor FROM samples")
    assert samples and all(s["n_images"] > 0 and s["n_trainable"] > 0 for s in samples)
    processor = image_processor()
    for s in samples:
        rows = db_rows(db, f"SELECT * FROM sample_images WHERE sample_id = '{s['sample_id']}' ORDER BY idx")
        assert [(r["token_start"], r["n_tokens"]) for r in rows] == pad_runs(s["input_ids"])
        for r in rows:
            [grid] = processor(images=[Image.open(io.BytesIO(images[r["hash"]]))])["image_grid_thw"].tolist()
            assert [r["grid_t"], r["grid_h"], r["grid_w"]] == grid and r["n_tokens"] == math.prod(grid) // 4
        assert json.loads(s["processor"])["merge_size"] == 2

    cfg = TrainConfig(db=str(db), model=str(model_dir), out=str(tmp_path / "run"), steps=2, step_tokens=2048,
                      row_tokens=2048, lr=1e-4, logit_chunk=64)
    final = train(cfg, say=lambda _: None)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in metrics)
    assert (final / "preprocessor_config.json").is_file() and (final / "model.safetensors").is_file()
