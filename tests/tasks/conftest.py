"""The task-forge tests' fixtures: the real Qwen3 tokenizer the scripted engines answer with."""

from openforge.testing.reconstruct_fixtures import qwen_tok, retok  # noqa: F401 - fixtures, used by name
