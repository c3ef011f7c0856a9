"""A real Qwen2-VL image processor and a tiny Qwen2.5-VL-shaped model, built locally (no hub).

The processor directory is what a user's VL model directory holds for reconstruct: the image processor's
`preprocessor_config.json`, the real Qwen3 tokenizer (it has the vision tokens) and a chat template that
renders each image part as `<|vision_start|><|image_pad|><|vision_end|>`: Qwen2-VL's (no tools; each turn
extends the last one's tokens), or Qwen3's made VL as Qwen3-VL's is (tools and tool calls).
Screenshots are small so every image is a few placeholder tokens: 112x112 px -> grid 1x8x8 -> 16 tokens.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

from openforge.testing.reconstruct_flows import qwen_path

# The Qwen2-VL chat template (image parts -> vision start, one image pad, vision end; the processor's
# expansion turns the pad into grid_t * grid_h * grid_w / merge_size**2 pads).
VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Message content as Qwen3-VL's chat template renders it: text parts as text, each image part as above.
_RENDER_CONTENT = (
    "{%- macro render_content(content) -%}{%- if content is string -%}{{- content -}}"
    "{%- elif content is iterable -%}{%- for item in content -%}"
    "{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif 'text' in item -%}{{- item.text -}}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
)


def qwen3_vl_chat_template() -> str:
    """The real Qwen3 template with each message's content rendered through `render_content` (what Qwen3-VL's
    template does): text-only conversations render exactly as Qwen3's own, tools and tool calls included
    (earlier assistant turns lose their reasoning, as in Qwen3's)."""
    qwen3 = json.loads((Path(qwen_path()) / "tokenizer_config.json").read_text())["chat_template"]
    return _RENDER_CONTENT + qwen3.replace("messages[0].content", "render_content(messages[0].content)").replace(
        "message.content", "render_content(message.content)")


IMAGE_PAD_ID, VISION_START_ID, VISION_END_ID, VIDEO_PAD_ID = 151655, 151652, 151653, 151656
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


def image_processor() -> Any:  # a transformers Qwen2VLImageProcessorPil
    """The real Qwen2-VL image processor (PIL backend: no torchvision), with small pixel limits."""
    from transformers import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def processor_dir(path: Path, chat_template: str = VL_CHAT_TEMPLATE) -> Path:
    """A VL processor directory: preprocessor_config.json + the Qwen3 tokenizer files + a VL chat template."""
    path.mkdir(parents=True, exist_ok=True)
    image_processor().save_pretrained(path)
    for f in Path(qwen_path()).iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    (path / "chat_template.jinja").write_text(chat_template)
    return path


def tiny_vl_model_dir(path: Path, seed: int = 0, chat_template: str = VL_CHAT_TEMPLATE) -> Path:
    """A randomly initialised Qwen2.5-VL-shaped model (~10M parameters, the Qwen3 vocabulary) with its
    processor files beside it, saved as a Hugging Face directory."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=151669, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, tie_word_embeddings=True),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE_PAD_ID, video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)
    return processor_dir(path, chat_template)


def screenshot(text: str = "OK", size: tuple[int, int] = (112, 112), color: str = "white") -> bytes:
    """A PNG 'screenshot': `text` drawn on a plain background (deterministic bytes for one input)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, color)
    ImageDraw.Draw(image).text((8, 8), text, fill="black")
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def expand_pads(text: str, n_tokens: list[int]) -> str:
    """A VL template's render with the k-th `<|image_pad|>` repeated n_tokens[k] times: transformers'
    Qwen2.5-VL processor's expansion (written here apart from reconstruct's, which the tests check)."""
    assert text.count("<|image_pad|>") == len(n_tokens)
    for n in n_tokens:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * n, 1)
    return text.replace("<|placeholder|>", "<|image_pad|>")


def pad_runs(ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of image pad tokens in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t == IMAGE_PAD_ID:
            if runs and sum(runs[-1]) == i:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
    return runs
