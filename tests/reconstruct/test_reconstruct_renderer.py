"""`load_renderer`: the one loader of tokenizer, engine chat template and image processor."""

from __future__ import annotations

from pathlib import Path

import pytest

from openforge.reconstruct.renderer import load_renderer
from openforge.reconstruct.tokenize import Retokenizer
from openforge.reconstruct.vision import ProcessorError, Vision
from openforge.testing.reconstruct_flows import qwen_path, qwen_retokenizer
from openforge.testing.vision import processor_dir

TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"


def test_a_tokenizer_directory_gives_its_tokenizer_and_no_processor():
    renderer = load_renderer(qwen_path())
    assert renderer.retok.chat_template is None and renderer.vision is None
    assert renderer.retok.vocab_size == qwen_retokenizer().vocab_size


def test_a_template_file_is_the_one_prompts_are_rendered_with(tmp_path: Path):
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    renderer = load_renderer(qwen_retokenizer(), tmp_path / "t.jinja")
    assert renderer.retok.chat_template == TEMPLATE
    assert renderer.retok.render([{"role": "user", "content": "hi"}], None, generation=False) == "hi|"


def test_the_processor_is_found_in_the_tokenizer_directory_and_keeps_the_given_template(tmp_path: Path):
    pdir = processor_dir(tmp_path / "vl")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    found = load_renderer(pdir)
    assert isinstance(found.vision, Vision)
    given = load_renderer(pdir, tmp_path / "t.jinja")
    assert given.vision is not None and given.vision.retok.chat_template == TEMPLATE


def test_a_directory_without_an_image_processor_is_refused(tmp_path: Path):
    with pytest.raises(ProcessorError, match="preprocessor_config.json"):
        load_renderer(qwen_retokenizer(), processor=tmp_path)


def test_a_retokenizer_is_used_as_it_is():
    retok = qwen_retokenizer()
    assert isinstance(retok, Retokenizer) and load_renderer(retok).retok is retok
