"""`openforge export`: the selected samples in the input shape of veRL, slime or TRL, or as flat parquet."""

from __future__ import annotations

from pathlib import Path

import typer

from openforge.choices import ExportFormat
from openforge.commands import SAMPLES_DB, fail, one_command


def export_command(
    db: Path = SAMPLES_DB,
    fmt: ExportFormat = typer.Option(..., "--format",
                               help="parquet (our columns, images included), verl, slime or trl (text samples only)."),
    out: Path = typer.Option(..., "--out",
                             help="Output file (parquet, verl, trl) or directory of {k}.pt files (slime)."),
    where: str = typer.Option("", "--where", help="SQL filter on the samples table, e.g. \"reward > 0\"."),
    force: bool = typer.Option(False, "--force",
                               help="Overwrite an existing --out (never the database itself)."),
) -> None:
    """Write the samples with trainable tokens (and --where) for a distributed trainer; docs/export.md maps
    every column."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from openforge.export import ExportError, export

    console = Console(stderr=True)
    bar = Progress(TextColumn("Exporting samples"), BarColumn(), MofNCompleteColumn(), console=console,
                   transient=True)
    task = bar.add_task("export", total=None)

    def progress(done: int, total: int) -> None:
        bar.start()  # on the first batch: an input error is then one line, with no bar before it
        bar.update(task, completed=done, total=total)

    try:
        n = export(db, fmt.value, out, where, progress=progress, force=force)
    except ExportError as e:
        fail(str(e))
    finally:
        if bar.live.is_started:
            bar.stop()
    console.print(f"{n} samples -> {out} ({fmt.value})")


register = one_command("export", export_command)
