"""`precision` and `compile` on a tiny Qwen3, on CPU: what a CUDA run relies on, checked without a GPU.

bf16 trains with bf16 weights in forward/backward (FSDP2 on one rank) and checkpoints the fp32 master copy;
compile runs the same step compiled, or eager after one warning line when torch.compile cannot work here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openforge.settings import ConfigError
from openforge.testing.trainer_samples import make_samples, qwen_tokenizer, write_samples
from openforge.trainer import dist
from openforge.trainer.config import TrainConfig, load_config
from openforge.trainer.dist import resolve_precision
from openforge.trainer.train import train

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_qwen_dir):
    base = tmp_path_factory.mktemp("precision")
    db = write_samples(base / "runs.duckdb", make_samples(qwen_tokenizer(), 4, seed=0, episodes=2))
    return base, tiny_qwen_dir, db


def run(setup, out: str, **kw) -> tuple[Path, list[str]]:
    """One PPO step; the final checkpoint and what the run said."""
    base, model, db = setup
    lines: list[str] = []
    cfg = load_config(None, dict(db=str(db), model=str(model), out=str(base / out), step_tokens=320,
                                 row_tokens=160, lr=1e-3, steps=1, progress=False) | kw)
    return train(cfg, say=lines.append), lines


def first_loss(ckpt: Path) -> float:
    return json.loads((ckpt.parents[1] / "metrics.jsonl").read_text().splitlines()[0])["loss"]


@pytest.fixture(scope="module")
def fp32(setup) -> tuple[Path, list[str]]:
    return run(setup, "fp32")


def test_auto_is_fp32_on_cpu_and_said_once(fp32):
    assert resolve_precision(TrainConfig(), torch.device("cpu"))[0] == "fp32"
    assert resolve_precision(TrainConfig(), torch.device("cuda"))[0] == "bf16-autocast"
    said = [line for line in fp32[1] if line.startswith("precision")]
    assert said == ["precision: fp32 (auto on CPU: exact fp32, the reference the tests compare against)"]


@pytest.mark.parametrize(("native", "settings", "device", "expected"), [
    (True, {"cpu_bf16": True}, "cpu", "bf16-autocast"),  # AVX512-BF16 / AMX: bf16 matmuls are native
    (False, {"cpu_bf16": True}, "cpu", "fp32"),  # emulated bf16 is slower than fp32
    (True, {}, "cpu", "fp32"),  # `openforge train`'s default: exact fp32 on CPU
    (True, {"cpu_bf16": True, "precision": "fp32"}, "cpu", "fp32"),  # what the user set stays
    (False, {"cpu_bf16": True}, "cuda", "bf16-autocast"),
    (True, {"precision": "bf16"}, "cuda", "bf16"),
])
def test_the_precision_is_decided_in_one_place(monkeypatch, native, settings, device, expected):
    monkeypatch.setattr(dist, "cpu_has_bf16", lambda: native)
    precision, reason = resolve_precision(TrainConfig(**settings), torch.device(device))
    assert precision == expected and reason


def test_bf16_checkpoints_finite_fp32_master_weights_close_to_fp32(setup, fp32, tiny_qwen_dir):
    ckpt, lines = run(setup, "bf16", precision="bf16")
    assert "precision: bf16 (set in the config)" in lines
    start, exact, bf16 = (load_file(p / "model.safetensors") for p in (tiny_qwen_dir, fp32[0], ckpt))
    assert exact.keys() == bf16.keys()
    for name, w in bf16.items():
        assert w.dtype == torch.float32 and torch.isfinite(w).all(), name
        moved = exact[name] - start[name]
        # Adam's first step moves each weight by ~lr; bf16 gradients may flip the sign of the smallest ones
        assert (w - exact[name]).abs().max() <= 2e-3, name  # 2 x lr
        if moved.abs().max() > 0:
            cos = torch.nn.functional.cosine_similarity((w - start[name]).flatten(), moved.flatten(), dim=0)
            assert cos > 0.95, (name, cos)
    assert first_loss(ckpt) == pytest.approx(first_loss(fp32[0]), rel=2e-2, abs=2e-3)
    assert not torch.distributed.is_initialized()  # the one-rank group is gone with the trainer


def test_an_unknown_precision_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"precision must be auto, fp32, bf16-autocast, bf16, not 'fp16'"):
        load_config(None, {"precision": "fp16"})


def test_compiled_step_gives_the_eager_loss(setup, fp32):
    ckpt, lines = run(setup, "compiled", compile=True)
    fell_back = [line for line in lines if line.startswith("warning: compile")]
    assert len(fell_back) <= 1  # compiled here, or eager after one line
    assert first_loss(ckpt) == pytest.approx(first_loss(fp32[0]), rel=1e-4, abs=1e-6)


def test_compile_that_fails_falls_back_with_one_warning_line(setup, fp32, monkeypatch):
    def no_toolchain(*args, **kwargs):
        raise RuntimeError("no C compiler found\nlong details")

    monkeypatch.setattr(torch, "compile", no_toolchain)
    ckpt, lines = run(setup, "fallback", compile=True)
    warnings = [line for line in lines if "compile" in line]
    assert warnings == ["warning: compile = true, but torch.compile fails on cpu (RuntimeError: no C compiler "
                        "found); training uncompiled"]
    assert first_loss(ckpt) == first_loss(fp32[0])
