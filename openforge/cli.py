"""The `openforge` command: one subcommand per pipeline step (capture, reconstruct, train, ...)."""

from __future__ import annotations

import typer

from openforge import __version__
from openforge.commands import (
    demo,
    engine,
    export,
    flows,
    preflight,
    proxy,
    reconstruct,
    replay,
    rl,
    rollout,
    stats,
    tasks,
    train,
)

app = typer.Typer(
    help=(
        "OpenForge: record what real agent toolchains send to your RL inference engine, turn it into "
        "token-exact training samples, and train on them.\n\n"
        "Pipeline: `openforge proxy` (mitmdump -s addons/openforge.py) -> flow files -> "
        "`openforge reconstruct` -> DuckDB -> `openforge train`; `openforge rl` runs it as the RL loop "
        "(rollouts, reconstruct, train, new weights into the engine, again)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"openforge {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    pass


for module in (proxy, preflight, flows, reconstruct, stats, export, train, engine, replay, rollout, rl, tasks, demo):
    module.register(app)


if __name__ == "__main__":
    app()
