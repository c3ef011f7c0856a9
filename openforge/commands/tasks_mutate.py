"""`openforge tasks mutate` (docs/tasks.md)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Adds `mutate` to the `openforge tasks` group."""
