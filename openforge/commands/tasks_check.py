"""`openforge tasks check` (docs/tasks.md)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds `check` to the `openforge tasks` group."""
