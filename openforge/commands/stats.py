"""`openforge stats`: the totals people check first in a reconstruct database."""

from __future__ import annotations

from pathlib import Path

from openforge.commands import SAMPLES_DB, fail, one_command


def stats_command(
    db: Path = SAMPLES_DB,
) -> None:
    """Print episodes, calls, samples, tokens, trainable tokens, merge ratio, branches and skipped records."""
    from rich.console import Console
    from rich.table import Table

    if not db.is_file():
        fail(f"No database at {db}", hint="write one with `openforge reconstruct ... --db FILE`")
    from openforge.reconstruct.stats import collect
    from openforge.samples import SchemaError

    try:
        figures = collect(db)
    except SchemaError as e:
        fail(str(e))
    table = Table(title=f"OpenForge stats: {db}", show_header=False)
    for key, value in figures.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v}" for k, v in value.items()) or "none"
        elif isinstance(value, float):
            value = f"{value:.2f}"
        table.add_row(key.replace("_", " "), str(value))
    Console().print(table)


register = one_command("stats", stats_command)
