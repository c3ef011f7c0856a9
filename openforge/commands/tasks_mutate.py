"""`openforge tasks mutate` (docs/tasks.md): bug-fix tasks from a repository whose pytest suite passes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from openforge.choices import Sandbox, VerifierReward
from openforge.commands import FAILED, fail

NOT_CONFINED = ("warning: --no-sandbox: each task's checks (its verifier, solution and the known hacks) run as plain "
                "processes of your user")


def register(app: typer.Typer) -> None:
    """Adds `mutate` to the `openforge tasks` group."""
    app.command("mutate")(mutate)


def mutate(
    repo: Path = typer.Option(..., help="The repository: its text files become each task's workspace."),
    test: str = typer.Option(..., help="Its test command, run with bash in the repository (and in the sandbox, "
                                       "by each task's verifier); it must run pytest with a Python that has "
                                       "OpenForge (e.g. '\"$OPENFORGE_PYTHON\" -m pytest -q') and pass before "
                                       "any mutation."),
    out: Path = typer.Option(..., help="The task file to write (JSON lines, docs/rollouts.md); the rejected "
                                       "candidates go to OUT.rejected.jsonl."),
    n: int = typer.Option(10, "--n", min=1, help="Tasks to make; stops once it has them."),
    seed: int = typer.Option(0, help="Order in which candidates are tried: the same seed gives the same file."),
    timeout_s: float = typer.Option(60.0, "--timeout-s", min=1,
                                    help="Bound of one test run (the unmutated suite, each candidate, each "
                                         "task's verifier); a candidate over it is rejected."),
    reward: VerifierReward = typer.Option(
        VerifierReward.all, help="The verifier's reward: 'all' 1.0 when the whole suite passes, else 0.0; 'fraction' "
                                 "the fraction of the broken tests that pass, 0.0 when another test fails."),
    include: list[str] = typer.Option([], help="Glob of the files to mutate, relative to --repo, or PATH::FUNCTION "
                                               "globs (a method is Class.method); repeat for several; default every "
                                               "Python file that is not a test."),
    jobs: int = typer.Option(min(4, os.cpu_count() or 1), min=1, help="Candidates tested at once."),
    max_operator_share: float = typer.Option(
        0.5, "--max-operator-share", help="The most of the N tasks one operator may make (0.5: half) while "
                                          "candidates of other operators are left."),
    max_per_function: int = typer.Option(2, "--max-per-function", help="The most tasks one function may give "
                                                                       "while candidates elsewhere are left."),
    no_sandbox: bool = typer.Option(False, "--no-sandbox", help="Run each task's checks as plain processes of your "
                                                                "user instead of in a bubblewrap sandbox."),
) -> None:
    """Inject one bug at a time into REPO's Python code (operator swaps, off-by-one, negated conditions,
    dropped statements, wrong returns), keep each that makes passing tests fail and whose task passes every
    check of `openforge tasks check`, and write it as a task: the mutated repository, a prompt naming the
    failing tests, a verifier running the suite, and the reference fix as a diff. No model is needed."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from openforge.taskforge.mutate import MutateError, MutateOptions, write_rejected, write_tasks
    from openforge.taskforge.mutate import mutate as run_mutate

    options = MutateOptions(test=test, n=n, seed=seed, timeout_s=timeout_s, reward=reward,
                            include=tuple(include), jobs=jobs, max_operator_share=max_operator_share,
                            max_per_function=max_per_function, sandbox=Sandbox.none if no_sandbox else Sandbox.bwrap)
    if no_sandbox:
        print(NOT_CONFINED, file=sys.stderr)
    # started with the first candidate: a repository refused on its unmutated run prints only its error line
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    bar = progress.add_task("mutate", total=None)

    def advance(decided: int, candidates: int, accepted: int, doing: str) -> None:
        progress.start()
        progress.update(bar, completed=decided, total=candidates,
                        description=f"mutate: {accepted}/{n} tasks" + (f", {doing}" if doing else ""))

    try:
        result = run_mutate(repo, options, progress=advance)
    except MutateError as e:
        fail(str(e))
    finally:
        if progress.live.is_started:
            progress.stop()
    write_tasks(result.tasks, out)
    rejected_path = out.with_name(out.name + ".rejected.jsonl")
    write_rejected(result.rejected, rejected_path)

    table = Table(title=f"openforge tasks mutate: {repo}")
    table.add_column("")
    table.add_column("count", justify="right")
    table.add_row("files in the workspace", str(result.files))
    table.add_row("mutation sites", str(result.sites))
    table.add_row("candidates tried", str(result.tried))
    table.add_row("tasks written", str(len(result.tasks)))
    for reason, count in sorted(result.reasons.items()):
        table.add_row(f"rejected: {reason}", str(count))
    for reason, count in sorted(result.skipped.items()):
        table.add_row(f"left out of the workspace: {reason}", str(count))
    out_console = Console()
    out_console.print(table)
    out_console.print(f"{len(result.tasks)} tasks in {out}, {len(result.rejected)} rejected candidates in "
                      f"{rejected_path}; {result.wall_s:.1f} s (the unmutated suite: {result.baseline_s:.1f} s)")
    if len(result.tasks) < n:
        out_console.print(f"only {len(result.tasks)} of the {n} tasks asked for: every mutation site was tried")
    if not result.tasks:
        raise typer.Exit(FAILED)
