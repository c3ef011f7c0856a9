"""`openforge rl`: the RL loop (rollouts -> reconstruct -> train -> new weights in the engine), repeated."""

from __future__ import annotations

import signal
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from openforge.commands import FAILED, fail, one_command

if TYPE_CHECKING:
    from rich.console import Console

    from openforge.rl.loop import RLRun


class Engine(StrEnum):
    """openforge.rl.config.ENGINES."""

    llamacpp = "llamacpp"
    vllm = "vllm"


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def run_loop(run: RLRun, console: Console) -> list[dict[str, Any]]:
    """`run.run()`, with `kill` stopping it as Ctrl-C does (episodes, engine and proxy first); a failure or an
    interruption is one message naming the command that continues the run."""
    from openforge.engine import EngineError
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


def setting(flag: str, key: str, help: str, default: Any = None) -> Any:
    """A named option that sets one rl.toml field (`key`); its help starts with the field it sets."""
    return typer.Option(default, flag, help=f"{key}: {help}" if help[0] != "(" else f"{key} {help}")


def rl(
    out: Path = typer.Option(..., "--out", help="The run's directory: rl.jsonl, rl.png, flows, DuckDB, episodes, "
                                                "checkpoints, logs (docs/rl.md)."),
    config: Path | None = typer.Option(None, "--config", help="rl.toml: \\[engine] \\[proxy] \\[rollout] "
                                                              "\\[reconstruct] \\[loop] \\[tasks] \\[train] "
                                                              "(docs/rl.md has every field)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out at the stage it stopped in "
                                                        "(its own rl.toml; --set and the options below still apply)."),
    iterations: int | None = setting("--iterations", "loop.iterations", "rollout -> train -> publish rounds "
                                     "(default 3)."),
    engine: Engine | None = setting("--engine", "engine.backend", "llamacpp (embedded; default) or vllm "
                                    "(`make setup-vllm`)."),
    tasks: Path | None = setting("--tasks", "rollout.tasks", "task file (docs/rollouts.md). Default: the example "
                                 "arithmetic tasks for tool-agent."),
    toolchain: list[str] = setting("--toolchain", "rollout.toolchains", "a built-in adapter or custom:FILE.toml; "
                                   "repeat for several.", default=[]),
    attempts: int | None = setting("--attempts", "rollout.attempts", "per task and toolchain (the GRPO group; "
                                   "default 4)."),
    concurrency: int | None = setting("--concurrency", "rollout.concurrency", "(default 2)."),
    steps: int | None = setting("--steps", "train.steps", "optimizer steps per iteration (default 2; 0 = one pass "
                                "over the iteration's samples)."),
    lr: float | None = setting("--lr", "train.lr", "(constant: train.min_lr_ratio = 1; default 1e-5)."),
    window: int | None = setting("--window", "loop.window", "train on the last W iterations' samples (default 1: "
                                 "this iteration's)."),
    no_sandbox: bool = setting("--no-sandbox", "rollout.sandbox = none", "agents run as plain processes of your "
                               "user (prints what is then not protected; docs/rollouts.md, Sandbox).", default=False),
    eval_tasks: Path | None = setting("--eval-tasks", "eval.tasks", "held-out tasks evaluated every eval.every "
                                      "policy versions, n samples and greedy (docs/evaluation.md); or --set "
                                      "eval.split=0.2 to hold out a share of --tasks."),
    tracker: list[str] = setting("--tracker", "tracking.trackers", "tensorboard, wandb (offline) or mlflow (local "
                                 "files), under DIR/tracking/; repeat for several (docs/tracking.md).", default=[]),
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
    from openforge.trainer.config import ConfigError, parse_sets

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
    if cfg.rollout.sandbox == "none":
        print(NOT_PROTECTED.replace("--no-sandbox", "rollout.sandbox = none"), file=sys.stderr)
    lines = run_loop(run, console)
    console.print(results_table(lines, read_lines(run.eval_path), read_lines(run.canary_path)))
    evaluated = f", evaluations: {run.eval_path}" if run.eval_path.is_file() else ""
    evaluated += f", canaries: {run.canary_path}" if run.canary_path.is_file() else ""
    console.print(f"rl.jsonl: {out / 'rl.jsonl'}{evaluated}, plot: {out / 'rl.png'}, samples: {out / 'rl.duckdb'}, "
                  f"served last: {run.serving()}")


register = one_command("rl", rl)
