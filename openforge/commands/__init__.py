"""One module per `openforge` subcommand; each exposes `register(app)` and imports heavy things lazily.

Every command reports a user error the same way, through `fail`: one `error: ...` line (and a `hint: ...`
line where one helps) on stderr, exit code USAGE (2) for bad usage or input, FAILED (1) for a run that
failed; never a traceback. Choice options are `enum.StrEnum`s, so typer lists them in --help and
refuses anything else with its own usage message (also exit 2); tests/e2e/test_first_hour.py checks that each
offers exactly what the module it feeds accepts.
"""

from __future__ import annotations

from typing import NoReturn

import typer

USAGE = 2  # bad usage or bad input: nothing was run
FAILED = 1  # the run started and failed


def fail(message: str, *, hint: str | None = None, code: int = USAGE) -> NoReturn:
    """Print the one-line error (and hint) on stderr and exit with `code`."""
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(f"hint: {hint}", err=True)
    raise typer.Exit(code)
