"""One module per `openforge` subcommand; each exposes `register(app)` (`one_command` makes it for a module
with one subcommand) and imports heavy things lazily.

Every command reports a user error the same way, through `fail`: one `error: ...` line (and a `hint: ...`
line where one helps) on stderr, exit code USAGE (2) for bad usage or input, FAILED (1) for a run that
failed; never a traceback. Choice options are the `StrEnum`s of `openforge.choices`, the objects the modules
check, so typer lists them in --help and refuses anything else with its own usage message (also exit 2). An
option that sets a config field is `option(Config, "field")`: its help and default are the field's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import typer

from openforge.settings import describe

USAGE = 2  # bad usage or bad input: nothing was run
FAILED = 1  # the run started and failed

# `--db` of the commands that read a reconstruct database (`stats`, `export`, `train`)
SAMPLES_DB = typer.Option(..., "--db", help="DuckDB database written by `openforge reconstruct`.")


def fail(message: str, *, hint: str | None = None, code: int = USAGE) -> NoReturn:
    """Print the one-line error (and hint) on stderr and exit with `code`."""
    typer.echo(f"error: {message}", err=True)
    if hint:
        typer.echo(f"hint: {hint}", err=True)
    raise typer.Exit(code)


def one_command(name: str, command: Callable[..., Any], **settings: Any) -> Callable[[typer.Typer], None]:
    """The `register(app)` of a module whose one subcommand is `command`."""

    def register(app: typer.Typer) -> None:
        app.command(name, **settings)(command)

    return register


def option(config: type, name: str, *flags: str, key: str | None = None, default: Any = None, **described: Any) -> Any:
    """A typer option that sets field `name` of the dataclass `config`: its help (and the default it names)
    come from the field; `default` (None: unset, the config's own applies) is what typer passes when absent."""
    return typer.Option(default, *flags, help=describe(config, name, key, **described), show_default=False)
