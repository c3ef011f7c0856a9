"""Load the policy (and the frozen reference), check it matches the samples, shard it across ranks."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig
from transformers.modeling_layers import GradientCheckpointingLayer

from openforge.trainer.data import DataError


def load_model(path: str, device: torch.device, grad_checkpointing: bool = False, attention: str = "sdpa"
               ) -> torch.nn.Module:
    """fp32 weights (the optimizer's master copy); on CUDA the forward runs under bf16 autocast/FSDP.

    A config with a vision config (Qwen2.5-VL, Qwen3-VL) loads the whole vision-language model, vision
    tower included. `attention`: transformers' attn_implementation (`attention.choose_attention`); sdpa takes
    tree rows' [B, 1, T, T] boolean mask as is, flex_attention the BlockMask of `attention.flex_row`."""
    if not (Path(path) / "config.json").is_file():
        raise DataError(f"--model {path} is not a Hugging Face model directory (no config.json)")
    auto = AutoModelForImageTextToText if vl_config(path) is not None else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    model.config.use_cache = False
    if grad_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.modules():  # transformers checkpoints a block only in training mode: the block's own
            if isinstance(layer, GradientCheckpointingLayer):  # flag, its submodules (dropout) stay in eval mode
                layer.training = True
    return model.to(device)


def vl_config(path: str) -> PretrainedConfig | None:
    """A vision-language model's config (its image_token_id, the image pad its vision tower's output replaces,
    and its vision_config); None for a text-only model."""
    config = AutoConfig.from_pretrained(path)
    return config if getattr(config, "vision_config", None) is not None else None


# What makes a tokenizer (and a vision-language model's processor) in a HF directory: copied verbatim into
# checkpoints so engines load them as-is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def tokenizer_files(path: str | Path) -> list[Path]:
    return [Path(path) / name for name in TOKENIZER_FILES if (Path(path) / name).is_file()]


def tokenizer_vocab_size(path: str | Path) -> int | None:
    """len(tokenizer) (added tokens included) from tokenizer.json; None if the directory has none."""
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    with file.open("rb") as f:
        digest = hashlib.file_digest(f, "blake2b").hexdigest()
    if digest not in _TOKENIZER_SIZES:  # parsing costs seconds; checkpoints copy the same file
        from tokenizers import Tokenizer  # the Rust tokenizer alone: seconds faster than AutoTokenizer

        _TOKENIZER_SIZES[digest] = Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    return _TOKENIZER_SIZES[digest]


_TOKENIZER_SIZES: dict[str, int] = {}


def check_vocab(model_path: str, sample_vocabs: list[tuple[int, str]]) -> int:
    """Samples tokenised for another model would train garbage (or index out of the embedding); returns the
    embedding's row count (every token id must be below it).

    Reads config.json and tokenizer.json only, so a mismatch is reported before any weights load.
    """
    if not (Path(model_path) / "config.json").is_file():
        raise DataError(f"--model {model_path} is not a Hugging Face model directory (no config.json)")
    rows = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
    tokenizer_size = tokenizer_vocab_size(model_path)
    for vocab_size, name in sample_vocabs:
        if vocab_size > rows:
            raise DataError(
                f"tokenizer/model mismatch: samples were tokenised with {name} (vocab_size {vocab_size}) "
                f"but the model's embedding has only {rows} rows. Train the model the samples were made for."
            )
        if tokenizer_size is not None and vocab_size != tokenizer_size:
            raise DataError(
                f"tokenizer/model mismatch: samples were tokenised with {name} (vocab_size {vocab_size}) "
                f"but the model directory's tokenizer has {tokenizer_size} tokens."
            )
    return rows


def shard_model(model: torch.nn.Module, device: torch.device) -> None:
    """FSDP2: each transformer block (a vision-language model's vision blocks too), then the root. bf16
    compute on CUDA, fp32 gradient reduction."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.type == "cuda" else MixedPrecisionPolicy()
    block_types = tuple(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in block_types:
            fully_shard(module, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
