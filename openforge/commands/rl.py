"""`openforge rl`: the RL loop (rollouts -> reconstruct -> train -> new weights in the engine), repeated."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from openforge.choices import EngineBackend, Sandbox
from openforge.commands import FAILED, fail, one_command, option
from openforge.rl.config import (
    TRAIN_DEFAULTS,
    EngineSettings,
    EvalSettings,
    LoopSettings,
    RolloutSettings,
    TrackingSettings,
)
from openforge.trainer.config import TrainConfig

if TYPE_CHECKING:
    from rich.console import Console

    from openforge.rl.loop import RLRun


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_loop(run: RLRun, console: Console) -> list[dict[str, Any]]:
    """`run.run()`, with `kill` stopping it as Ctrl-C does (episodes, engine and proxy first); a failure or an
    interruption is one message naming the command that continues the run."""
    from openforge.engines.process import EngineError
    from openforge.processes import ChildError
    from openforge.rl.errors import RLError

    again = f"openforge rl --out {run.out} --resume"
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run.run()
    except (RLError, EngineError, ChildError) as e:
        fail(f"{e} (resume with: {again})", code=FAILED)
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted[/]: episodes, engine and proxy stopped. Continue with `{again}`.")
        raise typer.Exit(130) from None


def rl(
    out: Path = typer.Option(..., "--out", help="The run's directory: rl.jsonl, rl.png, flows, DuckDB, episodes, "
                                                "checkpoints, logs (docs/rl.md)."),
    config: Path | None = typer.Option(None, "--config", help="rl.toml: \\[engine] \\[proxy] \\[rollout] "
                                                              "\\[reconstruct] \\[loop] \\[tasks] \\[train] "
                                                              "(docs/rl.md has every field)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out at the stage it stopped in "
                                                        "(its own rl.toml; --set and the options below still apply)."),
    iterations: int | None = option(LoopSettings, "iterations", "--iterations", key="loop.iterations"),
    engine: EngineBackend | None = option(EngineSettings, "backend", "--engine", key="engine.backend",
                                          more="(vllm: `make setup-vllm`)"),
    tasks: Path | None = option(RolloutSettings, "tasks", "--tasks", key="rollout.tasks"),
    toolchain: list[str] = option(RolloutSettings, "toolchains", "--toolchain", key="rollout.toolchains", default=[],
                                  more="Repeat for several."),
    attempts: int | None = option(RolloutSettings, "attempts", "--attempts", key="rollout.attempts"),
    concurrency: int | None = option(RolloutSettings, "concurrency", "--concurrency", key="rollout.concurrency"),
    steps: int | None = option(TrainConfig, "steps", "--steps", key="train.steps", value=TRAIN_DEFAULTS["steps"],
                               more="Per iteration."),
    lr: float | None = option(TrainConfig, "lr", "--lr", key="train.lr", value=TRAIN_DEFAULTS["lr"],
                              more="Constant: train.min_lr_ratio = 1."),
    window: int | None = option(LoopSettings, "window", "--window", key="loop.window"),
    no_sandbox: bool = typer.Option(False, "--no-sandbox", help="rollout.sandbox = none: agents run as plain "
                                    "processes of your user (prints what is then not protected; docs/rollouts.md, "
                                    "Sandbox)."),
    eval_tasks: Path | None = option(EvalSettings, "tasks", "--eval-tasks", key="eval.tasks",
                                     more="Evaluated every eval.every policy versions, n samples and greedy "
                                          "(docs/evaluation.md); or --set eval.split=0.2 to hold out a share of "
                                          "--tasks."),
    tracker: list[str] = option(TrackingSettings, "trackers", "--tracker", key="tracking.trackers", default=[],
                                more="wandb offline, mlflow local files, under DIR/tracking/; repeat for several."),
    sets: list[str] = typer.Option([], "--set", help="Any field as section.key=value, e.g. --set proxy.max_tokens=256 "
                                                     "--set train.kl_coef=0.01; repeat for several."),
) -> None:
    """Run the RL loop: for each iteration, rollouts of the toolchains on the tasks through the proxy (policy
    version i), reconstruct into one DuckDB, policy-gradient steps continuing the last iteration's optimizer
    state, then the new weights into the engine (the proxy holds new calls meanwhile) as policy version i+1.

    Precedence: defaults < --config (or, with --resume, the run's rl.toml) < --set < the named options.
    Ctrl-C stops every episode, the engine and the proxy; `--resume` continues."""
    from rich.console import Console

    from openforge.rl.base import load
    from openforge.rl.errors import RLError
    from openforge.rl.loop import RLRun
    from openforge.rl.report import read_lines, results_table
    from openforge.rollout.sandbox import NOT_PROTECTED, unavailable
    from openforge.settings import ConfigError, parse_sets

    named: dict[str, Any] = {
        "loop.iterations": iterations, "engine.backend": engine.value if engine else None,
        "rollout.tasks": str(tasks) if tasks else None, "rollout.toolchains": toolchain or None,
        "rollout.attempts": attempts, "rollout.concurrency": concurrency, "train.steps": steps, "train.lr": lr,
        "loop.window": window, "rollout.sandbox": "none" if no_sandbox else None,
        "eval.tasks": str(eval_tasks) if eval_tasks else None, "tracking.trackers": tracker or None,
    }
    console = Console()
    try:
        cfg = load(config, parse_sets(sets) | {k: v for k, v in named.items() if v is not None},
                   out, resume)
        for flag, path in (("--tasks", tasks), ("--eval-tasks", eval_tasks)):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag}: no such file {path}")
        if why := unavailable(cfg.rollout.sandbox):  # before the engine starts, not at the first rollout
            raise ConfigError(f"rollout.sandbox = {cfg.rollout.sandbox}: {why}")
        run = RLRun(cfg, out, console, resume=resume)
    except (ConfigError, RLError) as e:
        fail(str(e))
    if cfg.rollout.sandbox == Sandbox.none:
        print(NOT_PROTECTED.replace("--no-sandbox", "rollout.sandbox = none"), file=sys.stderr)
    lines = run_loop(run, console)
    console.print(results_table(lines, read_lines(run.eval_path), read_lines(run.canary_path)))
    evaluated = f", evaluations: {run.eval_path}" if run.eval_path.is_file() else ""
    evaluated += f", canaries: {run.canary_path}" if run.canary_path.is_file() else ""
    console.print(f"rl.jsonl: {out / 'rl.jsonl'}{evaluated}, plot: {out / 'rl.png'}, samples: {out / 'rl.duckdb'}, "
                  f"served last: {run.serving()}")


register = one_command("rl", rl)
