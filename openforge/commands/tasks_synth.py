"""`openforge tasks synth` (docs/tasks.md)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds `synth` to the `openforge tasks` group."""
