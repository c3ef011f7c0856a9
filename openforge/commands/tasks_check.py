"""`openforge tasks check` (docs/tasks.md): the execution checks on every task of a task file."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from openforge.commands import FAILED, fail

STYLE = {"pass": "green", "fail": "bold red", "skip": "dim"}
NOT_CONFINED = ("warning: --no-sandbox: setup, solutions and verifiers run as plain processes of your user, with "
                "the network and your files; check only task files you trust")


def register(app: typer.Typer) -> None:
    """Adds `check` to the `openforge tasks` group."""
    app.command("check")(check)


def results_path(tasks: Path) -> Path:
    """Where the results go: beside the task file, `tasks.jsonl` -> `tasks.check.json`."""
    return tasks.with_suffix(".check.json")


def write_results(path: Path, document: dict[str, Any]) -> None:
    """Write `document` as JSON to a temporary file beside `path`, then rename it: never half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def results_tables(reports: list[Any]) -> list[Any]:
    """A row per task (each check's pass, fail or skip), then a row per failed check with its reason."""
    from rich.table import Table

    from openforge.taskforge.check import CHECKS

    table = Table(title="task checks")
    table.add_column("task")
    for name in CHECKS:  # one word a line: narrow enough for an 80-column terminal
        table.add_column(name.replace("_", "\n"), justify="center", no_wrap=True)
    for report in reports:
        table.add_row(report.task_id, *(f"[{STYLE[r.status]}]{r.status}[/]" for r in report.results))
    failures = [(report.task_id, r) for report in reports for r in report.failures]
    if not failures:
        return [table]
    why = Table(title="failed checks")
    for col in ("task", "check", "reason"):
        why.add_column(col)
    for task_id, r in failures:
        why.add_row(task_id, r.name, r.detail)
    return [table, why]


def check(
    tasks: Path = typer.Argument(..., help="Task file, one JSON object per line (docs/rollouts.md)."),
    noop_max: float = typer.Option(
        0.0, "--noop-max", help="The most an untouched workspace may score (noop_fails); the reference solution "
                                "must score more (solution_passes)."),
    _strict: bool = typer.Option(False, "--strict", hidden=True, help="Kept for older scripts: exiting 1 when a task "
                                                                     "fails a check is the default."),
    no_sandbox: bool = typer.Option(
        False, "--no-sandbox", help="Run setup, solutions and verifiers as plain processes of your user instead of "
                                    "in a bubblewrap sandbox without network (only for task files you trust)."),
    jobs: int = typer.Option(1, "--jobs", min=1, help="Tasks checked at once."),
    work_dir: Path | None = typer.Option(
        None, "--work-dir", help="Keep each task's workspaces and logs in DIR/<task id>/ (default: a temporary "
                                 "directory, removed)."),
) -> None:
    """Run the execution checks on every task: the workspace builds; verify fails on the untouched workspace;
    the reference solution passes; verify gives the same reward twice; fakes in the files the agent writes do
    not pass; no copy of the original code is within the agent's reach; no known hack scores; everything ends
    within timeout_s. Prints a table and writes TASKS.check.json beside the file.

    Exit status: 0 when every task passes every check (warnings aside), 1 when a task fails one (the failed
    checks are listed), 2 for bad input (the task file, no usable sandbox)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from openforge.rollout import sandbox
    from openforge.rollout.tasks import TaskFileError, read_tasks
    from openforge.taskforge.check import TaskReport, check_tasks

    mode = "none" if no_sandbox else "bwrap"
    try:
        task_list = read_tasks(tasks)
    except TaskFileError as e:
        fail(str(e))
    if why := sandbox.unavailable(mode):
        fail(why)
    if no_sandbox:
        print(NOT_CONFINED, file=sys.stderr)
    failed: list[str] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True)) as progress:
        bar = progress.add_task("checking tasks", total=len(task_list))

        def done(report: TaskReport) -> None:
            if not report.passed:
                failed.append(report.task_id)
            progress.update(bar, advance=1, description=f"checking tasks: {len(failed)} failed")

        reports = check_tasks(task_list, noop_max=noop_max, sandbox=mode, work_root=work_dir, jobs=jobs,
                              on_done=done)
    out = results_path(tasks)
    try:
        write_results(out, {"tasks_file": str(tasks), "noop_max": noop_max, "sandbox": mode,
                            "passed": sum(r.passed for r in reports), "failed": len(failed),
                            "warned": sum(bool(r.warnings) for r in reports),
                            "tasks": [{"task_id": r.task_id, "passed": r.passed,
                                       "results": [asdict(c) for c in r.results], "warnings": list(r.warnings)}
                                      for r in reports]})
    except OSError as e:
        fail(f"cannot write the results to {out}: {e.strerror or e}", code=FAILED)
    console = Console()
    for table in results_tables(reports):
        console.print(table)
    for report in reports:
        for warning in report.warnings:
            console.print(f"warning: {report.task_id}: {warning}", highlight=False)
    console.print(f"{len(reports) - len(failed)} of {len(reports)} tasks pass every check; results: {out}")
    if failed:
        fail(f"{len(failed)} of {len(reports)} tasks failed a check: {', '.join(sorted(failed))}", code=FAILED)
