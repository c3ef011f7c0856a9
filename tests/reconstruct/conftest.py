"""The reconstruct tests' fixtures: the real Qwen3 tokenizer and one Retokenizer, per session."""

from openforge.testing.reconstruct_fixtures import qwen_tok, retok  # noqa: F401 - fixtures, used by name
