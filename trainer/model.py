"""Load the policy (and the frozen reference), check it matches the samples, shard it across ranks."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.modeling_layers import GradientCheckpointingLayer

from openforge.trainer.data import DataError
from openforge.trainer.dist import init_one_rank_group


def load_model(path: str, device: torch.device, grad_checkpointing: bool = False, attention: str = "sdpa"
               ) -> PreTrainedModel:
    """fp32 weights (the optimizer's master copy); on CUDA the forward runs under bf16 autocast/FSDP.

    A config with a vision config (Qwen2.5-VL, Qwen3-VL) loads the whole vision-language model, vision
    tower included. `attention`: transformers' attn_implementation (`attention.choose_attention`); sdpa takes
    tree rows' [B, 1, T, T] boolean mask as is, flex_attention the BlockMask of `attention.flex_row`."""
    if not (Path(path) / "config.json").is_file():
        raise DataError(f"--model {path} is not a Hugging Face model directory (no config.json)")
    auto = AutoModelForImageTextToText if vl_config(path) is not None else AutoModelForCausalLM
    model: PreTrainedModel = auto.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    model.config.use_cache = False
    if grad_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.modules():  # transformers checkpoints a block only in training mode: the block's own
            if isinstance(layer, GradientCheckpointingLayer):  # flag, its submodules (dropout) stay in eval mode
                layer.training = True
    cast(torch.nn.Module, model).to(device)  # in place; transformers' wrapper of `to` is typed wrongly
    return model


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


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks (a vision-language model's vision blocks too): the units FSDP2 shards and
    torch.compile compiles."""
    block_types = tuple(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in block_types]


def shard_model(model: torch.nn.Module, precision: str) -> None:
    """FSDP2: each transformer block, then the root; the sharded parameters stay fp32 (the optimizer's master
    copy), gathered as bf16 for compute unless the precision is fp32; gradients reduced in fp32.

    One rank with precision bf16 is sharded too: FSDP2's MixedPrecisionPolicy is the least code that keeps
    bf16 weights for forward/backward and fp32 ones in the optimizer and in `get_model_state_dict`
    (checkpoints), the same path several ranks take. `precision`: resolved (`dist.resolve_precision`)."""
    mp = MixedPrecisionPolicy() if precision == "fp32" else MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32)
    for module in transformer_blocks(model):
        fully_shard(module, mp_policy=mp)
    fully_shard(model, mp_policy=mp)


def prepare_model(model: torch.nn.Module, device: torch.device, precision: str, world_size: int, compile: bool,
                  say: Callable[[str], None]) -> bool:
    """Shard the model (several ranks, or precision bf16 on one) and compile its blocks when asked; True when
    this made the process group (one rank, bf16: FSDP2 needs a group, of one), which the caller destroys.
    `precision`: resolved (`dist.resolve_precision`)."""
    own_group = init_one_rank_group(device) if precision == "bf16" else False
    if world_size > 1 or precision == "bf16":
        shard_model(model, precision)
    if compile:
        compile_blocks(model, device, say)
    return own_group


def compile_blocks(model: torch.nn.Module, device: torch.device, say: Callable[[str], None]) -> bool:
    """torch.compile each transformer block's forward (FSDP2's hooks around it stay eager; the state dict's
    names do not change). Compilation is lazy, so a small forward and backward is compiled on `device` first:
    where that fails (no C compiler, no Triton) the model stays eager and one warning line says why."""
    try:
        probe = torch.compile(lambda x: (x * 2).sin())
        probe(torch.ones(4, device=device, requires_grad=True)).sum().backward()
    except Exception as e:  # noqa: BLE001  (any failure means: train eager)
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        say(f"warning: compile = true, but torch.compile fails on {device.type} "
            f"({type(e).__name__}: {reason}); training uncompiled")
        return False
    for block in transformer_blocks(model):
        block.forward = torch.compile(block.forward)
    return True
