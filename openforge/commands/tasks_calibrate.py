"""`openforge tasks calibrate` (docs/tasks.md): run the policy k times per task, keep the tasks in a pass-rate band.

The options it shares with `openforge rollout` are that command's own definitions, so the two never drift
apart; their values are checked by the rollout itself (`openforge.rollout.run`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from openforge.commands import FAILED, fail
from openforge.commands import rollout as rollout_command

if TYPE_CHECKING:
    from openforge.taskforge.calibrate import Calibration


def register(app: typer.Typer) -> None:
    """Adds `calibrate` to the `openforge tasks` group."""
    app.command("calibrate")(calibrate)


def calibrate(
    tasks: Path = typer.Argument(..., help="Task file to calibrate (docs/rollouts.md)."),
    proxy: str = rollout_command.PROXY,
    toolchain: list[str] = rollout_command.TOOLCHAIN,
    attempts: int = typer.Option(8, "--attempts", help="Attempts per task and toolchain (k): the pass rate is "
                                                       "over these, less the failures that are not the policy's."),
    out: Path = typer.Option(..., "--out", help="Task file to write: the tasks inside the band, each with "
                                                "pass_rate, mean_reward, attempts and calibrated_at_policy in "
                                                "its metadata."),
    band: str = typer.Option("0.1,0.9", "--band", help="LO,HI: keep a task when LO <= pass rate <= HI (bounds "
                                                       "inclusive); above HI is too easy, below LO too hard."),
    rollout_dir: Path | None = typer.Option(None, "--rollout-dir", help="Directory for the episodes, summary.json "
                                            "and calibration.json (every task's figures). Default: OUT.rollout "
                                            "beside --out."),
    pass_threshold: float = rollout_command.PASS_THRESHOLD,
    on_failure: list[str] = rollout_command.ON_FAILURE,
    concurrency: int = rollout_command.CONCURRENCY,
    no_sandbox: bool = rollout_command.NO_SANDBOX,
) -> None:
    """Run the policy on every task `--attempts` times through the proxy (as `openforge rollout` does; the
    same tokens: $OPENFORGE_CLIENT_TOKEN and $OPENFORGE_REWARD_TOKEN) and keep the tasks it solves sometimes
    but not always. An episode whose failure class is dropped (by default: timeout, verifier, engine, infra)
    is not an attempt of the policy; one scored zero (the agent's own failure) is a failed attempt."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from openforge.rollout.runner import RolloutError
    from openforge.rollout.spec import EpisodeResult
    from openforge.taskforge.calibrate import CalibrationFailed, parse_band
    from openforge.taskforge.calibrate import calibrate as run_calibration

    try:
        lo_hi = parse_band(band)
    except ValueError as e:
        fail(f"--band: {e}")
    if attempts < 1:
        fail(f"--attempts must be >= 1, not {attempts}")
    if not tasks.is_file():
        fail(f"no such task file: {tasks}")
    if out.resolve() == tasks.resolve():
        fail("--out must be another file than the task file")
    if not out.parent.is_dir():
        fail(f"--out: no such directory {out.parent}")
    client_token, reward_token = rollout_command.take_tokens(no_sandbox)
    console = Console(stderr=True)
    counts: dict[str, int] = {}
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            bar = progress.add_task(f"calibrate {tasks.name}", total=None)

            def done(result: EpisodeResult) -> None:
                counts[result.status] = counts.get(result.status, 0) + 1
                state = " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                progress.update(bar, advance=1, description=f"calibrate {tasks.name}: {state}")

            result = run_calibration(
                tasks, toolchain, proxy=proxy, out=out, attempts=attempts, band=lo_hi, rollout_dir=rollout_dir,
                on_start=lambda n: progress.update(bar, total=n), on_done=done, concurrency=concurrency,
                on_failure=",".join(on_failure) or "default", pass_threshold=pass_threshold,
                sandbox="none" if no_sandbox else "bwrap", client_token=client_token, reward_token=reward_token)
    except RolloutError as e:
        fail(str(e))
    except CalibrationFailed as e:
        fail(f"{e}; nothing written to {out}", code=FAILED)
    out_console = Console()
    out_console.print(calibration_table(result))
    out_console.print(f"{len(result.kept)} of {len(result.rates)} tasks in the band {lo_hi[0]:g}..{lo_hi[1]:g} "
                      f"written to {out}; every task's figures: {result.rollout_dir / 'calibration.json'}, "
                      f"episodes: {result.rollout_dir / 'episodes'}")


def calibration_table(result: Calibration) -> Any:
    """A row per task: episodes, counted attempts, pass rate, mean reward, verdict (kept ones first)."""
    from rich.table import Table

    from openforge.taskforge.calibrate import KEPT

    lo, hi = result.band
    policy = "" if result.policy is None else f", policy version {result.policy}"
    table = Table(title=f"calibration (band {lo:g}..{hi:g}{policy})")
    for col in ("task", "episodes", "attempts", "pass rate", "mean reward", ""):
        table.add_column(col, justify="left" if col in ("task", "") else "right")
    for r in sorted(result.rates, key=lambda r: result.verdicts[r.task_id] != KEPT):
        verdict = result.verdicts[r.task_id]
        table.add_row(r.task_id, str(r.episodes), str(r.attempts),
                      "-" if r.pass_rate is None else f"{r.pass_rate:.2f}",
                      "-" if r.mean_reward is None else f"{r.mean_reward:.3f}",
                      f"[green]{verdict}[/]" if verdict == KEPT else verdict)
    return table
