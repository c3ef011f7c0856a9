"""Rollouts: tasks x toolchains x attempts, each verified and its reward reported through the proxy.

`openforge.rollout.run(...)` is `openforge rollout` as a Python API (docs/rollouts.md); imported lazily so
the episode entrypoint (`python -m openforge.rollout.episode`) loads only what it needs."""

from __future__ import annotations

from typing import Any


def run(*args: Any, **kwargs: Any) -> Any:
    """openforge.rollout.runner.run: returns a `Rollout` (run id, results, summary)."""
    from openforge.rollout.runner import run as run_rollout

    return run_rollout(*args, **kwargs)
