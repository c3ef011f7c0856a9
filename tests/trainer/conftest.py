"""The trainer tests' fixtures: one tiny Qwen3 model directory per session, one torch thread per module."""

from openforge.testing.trainer_samples import one_torch_thread, tiny_qwen_dir  # noqa: F401 - fixtures, used by name
