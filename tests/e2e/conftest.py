"""The end-to-end tests' fixtures: the Qwen3 tokenizer and Retokenizer, one tiny Qwen3 model directory."""

from openforge.testing.reconstruct_fixtures import qwen_tok, retok  # noqa: F401 - fixtures, used by name
from openforge.testing.trainer_samples import one_torch_thread, tiny_qwen_dir  # noqa: F401 - fixtures, used by name
