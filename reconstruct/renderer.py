"""What renders a call's prompt, loaded in one place: the tokenizer, the chat template the engine rendered
with (when it is not the tokenizer's own), and a vision-language model's image processor.

`reconstruct()`, the `openforge reconstruct` command and the RL loop all load it here, so the same inputs
give the same prompts everywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openforge.reconstruct.tokenize import Retokenizer, load_tokenizer
from openforge.reconstruct.vision import Vision, is_processor_dir


@dataclass(frozen=True)
class Renderer:
    """The tokenizer with its template, and the image processor (None: calls with images are skipped)."""

    retok: Retokenizer
    vision: Vision | None = None


def load_renderer(tokenizer: Any, chat_template: str | Path | None = None,
                  processor: str | Path | Vision | None = None) -> Renderer:
    """Load a renderer from a tokenizer directory (or a loaded tokenizer, or a `Retokenizer`).

    `chat_template`: a file with the template the engine rendered prompts with. `processor`: a
    vision-language model's directory, else the tokenizer directory when it holds an image processor.
    Raises `vision.ProcessorError` for a processor directory without a usable image processor, and the
    loader's own error for a tokenizer that does not load.
    """
    retok = tokenizer if isinstance(tokenizer, Retokenizer) else Retokenizer(load_tokenizer(tokenizer))
    if chat_template is not None:
        retok = Retokenizer(retok.tok, chat_template=Path(chat_template).read_text(encoding="utf-8"))
    if processor is None and isinstance(tokenizer, (str, os.PathLike)) and is_processor_dir(tokenizer):
        processor = Path(tokenizer)
    vision = processor if isinstance(processor, Vision) or processor is None else Vision.load(processor, retok)
    return Renderer(retok, vision)
