"""`openforge tasks calibrate` (docs/tasks.md)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds `calibrate` to the `openforge tasks` group."""
