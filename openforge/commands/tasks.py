"""`openforge tasks`: the task forge's commands (docs/tasks.md), one module each."""

from __future__ import annotations

import typer

from openforge.commands import tasks_calibrate, tasks_check, tasks_mutate, tasks_synth


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        help="Make RL tasks and keep the good ones: `mutate` (bugs injected into your repository), `synth` "
             "(a model writes them, through the proxy), `check` (execution checks), `calibrate` (keep what the "
             "policy solves sometimes). Task files in and out, the format of docs/rollouts.md.",
        no_args_is_help=True,
    )
    for module in (tasks_mutate, tasks_synth, tasks_check, tasks_calibrate):
        module.register(group)
    app.add_typer(group, name="tasks")
