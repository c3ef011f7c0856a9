"""Write a trained Llama-architecture checkpoint back to GGUF so llama.cpp serves the updated policy.

Metadata and tokenizer fields are copied from the GGUF the model came from (same vocabulary, same chat
template, same hyper-parameters); the weights are written in f16 (matrices) and f32 (norms) under
llama.cpp's tensor names. llama.cpp's converter permutes the rows of Llama's q/k projections (its RoPE
pairs dimensions differently from transformers') and transformers undoes that on load, so export
permutes again.

`served_gguf` gives the starting GGUF the same treatment, so an RL run serves every policy, the first
included, at the precision export writes (SmolLM2's shipped GGUF is Q4_1).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

SKIPPED_FIELDS = {"general.architecture", "general.file_type", "general.quantization_version"}
FILE_TYPES = {"f16": 1, "f32": 0}  # llama_ftype: LLAMA_FTYPE_MOSTLY_F16 / ALL_F32


class ExportError(ValueError):
    """The checkpoint does not match the template GGUF (other architecture, other shapes)."""


def llama_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py): interleave each head's rotary halves."""
    split = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
    return split.swapaxes(1, 2).reshape(weight.shape)


def export_gguf(
    state_dict: Mapping[str, torch.Tensor],
    template_gguf: Path | str,
    out_path: Path | str,
    *,
    dtype: str = "f16",
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write `state_dict` (a transformers LlamaForCausalLM's) as a GGUF next to `out_path`, atomically.

    `template_gguf` provides every metadata key (architecture hyper-parameters, tokenizer, chat template).
    `progress(done, total)` is called per tensor. Returns `out_path`.
    """
    import gguf
    import torch

    if dtype not in FILE_TYPES:
        raise ExportError(f"dtype must be one of {sorted(FILE_TYPES)}, not {dtype!r}")
    reader = gguf.GGUFReader(str(template_gguf))
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ExportError(f"only the llama architecture is supported, the template GGUF is {arch!r}")
    n_blocks = int(reader.fields["llama.block_count"].contents())
    n_head = int(reader.fields["llama.attention.head_count"].contents())
    n_head_kv = int(reader.fields["llama.attention.head_count_kv"].contents())
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_blocks)
    expected = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = out_path.with_name(out_path.name + ".partial")
    writer = gguf.GGUFWriter(str(tmp_path), arch)
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in SKIPPED_FIELDS:
                continue
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
        writer.add_file_type(FILE_TYPES[dtype])

        written: set[str] = set()
        no_output_tensor = "output.weight" not in expected
        items = [(k, v) for k, v in state_dict.items() if not (k == "lm_head.weight" and no_output_tensor)]
        for done, (hf_name, tensor) in enumerate(items, 1):
            base, _, suffix = hf_name.rpartition(".")
            mapped = name_map.get_name(base)
            if mapped is None:
                raise ExportError(f"no llama.cpp name for tensor {hf_name!r}")
            name = f"{mapped}.{suffix}"
            data = tensor.detach().to(torch.float32).cpu().numpy()
            if name not in expected or expected[name] != data.shape:
                raise ExportError(f"{hf_name} {data.shape} does not match the template's {name} {expected.get(name)}")
            if name.endswith("attn_q.weight"):
                data = llama_permute(data, n_head)
            elif name.endswith("attn_k.weight"):
                data = llama_permute(data, n_head_kv)
            if data.ndim > 1 and dtype == "f16":
                data = data.astype(np.float16)
            writer.add_tensor(name, np.ascontiguousarray(data))
            written.add(name)
            if progress:
                progress(done, len(items))
        missing = set(expected) - written
        if missing:
            raise ExportError(f"checkpoint lacks tensors the template has: {sorted(missing)[:5]}")

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp_path, out_path)
    finally:
        writer.close()
        tmp_path.unlink(missing_ok=True)
    return out_path


def stored_as_exported(gguf_path: Path | str, dtype: str = "f16") -> bool:
    """Whether every tensor of the GGUF is stored as `export_gguf` writes it: matrices in `dtype`, the rest f32."""
    import gguf

    matrix = gguf.GGMLQuantizationType[dtype.upper()]
    reader = gguf.GGUFReader(str(gguf_path))
    return all(t.tensor_type == (matrix if len(t.shape) > 1 else gguf.GGMLQuantizationType.F32)
               for t in reader.tensors)


def served_gguf(gguf_path: Path | str, dtype: str = "f16") -> Path:
    """The GGUF an RL run serves as its first policy: `gguf_path` itself when it is stored as every later
    (exported) policy is, else its weights as the trainer starts from them (transformers' dequantised
    conversion, `models.hf_dir`) exported to `dtype` with the same metadata: so policy 0 and policy 1 differ
    by the training step alone, not by quantisation too. Made once, cached beside the conversion."""
    from safetensors.torch import load_file

    from openforge.models import cache_dir, hf_dir

    path = Path(gguf_path)
    if stored_as_exported(path, dtype):
        return path
    target = cache_dir(path).with_name(f"{cache_dir(path).name}.{dtype}.gguf")
    if target.is_file():
        return target
    weights = {k: v for file in sorted(hf_dir(path).glob("*.safetensors")) for k, v in load_file(str(file)).items()}
    return export_gguf(weights, path, target, dtype=dtype)
