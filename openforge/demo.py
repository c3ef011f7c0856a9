"""`openforge demo`: `openforge rl` on one CPU machine with everything embedded (docs/demo.md).

The embedded llama.cpp engine serves SmolLM2-135M, the example tool agent runs the first tasks of the
example arithmetic set through the proxy, and each iteration trains a few GRPO steps and publishes the new
weights as a GGUF. The demo is the RL loop with small settings, then a summary of what happened, where
everything is and the commands to go on.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from openforge.rl.config import RLConfig, load_rl_config
from openforge.rl.errors import RLError
from openforge.rl.loop import RLRun
from openforge.rl.report import read_lines, results_table

# Written into every demo output: the only directories a later demo replaces without --force.
MARKER = ".openforge-demo"


@dataclass
class DemoConfig:
    out: Path = Path("demo-out")
    gguf: Path | None = None
    tasks: int = 4
    attempts: int = 4
    iterations: int = 3
    train_steps: int = 2
    step_tokens: int = 4096
    lr: float = 1e-5
    threads: int = 2
    max_tokens: int = 64

    def rl_config(self) -> RLConfig:
        return load_rl_config(sets={
            "engine.gguf": str(self.gguf or ""), "engine.threads": self.threads,
            "proxy.max_tokens": self.max_tokens, "rollout.max_tasks": self.tasks, "rollout.attempts": self.attempts,
            "loop.iterations": self.iterations, "train.steps": self.train_steps,
            "train.step_tokens": self.step_tokens, "train.row_tokens": min(self.step_tokens, 4096),
            "train.lr": self.lr,
            # a quarter of the example tasks held out, scored on the first and the last policy (docs/evaluation.md)
            "eval.split": 0.25, "eval.every": self.iterations, "eval.samples": 2,
        })


def prepare(cfg: DemoConfig, console: Console, force: bool = False) -> RLRun:
    """The loop, to run in `cfg.out`, emptied first (an earlier run's flows would mix in); RLError for an
    existing `cfg.out` that is neither empty nor an earlier demo's output (its marker), unless `force`."""
    out = cfg.out
    if out.is_dir() and not out.is_symlink() and ((out / MARKER).is_file() or not any(out.iterdir()) or force):
        shutil.rmtree(out)
    elif out.exists() or out.is_symlink():
        if not force:
            what = "a directory that is not an earlier demo's output" if out.is_dir() else "not a directory"
            raise RLError(f"--out {out} is {what} (no {MARKER} in it): give another --out, or --force to "
                          f"replace it")
        out.unlink()
    out.mkdir(parents=True)
    (out / MARKER).write_text("written by `openforge demo`: a later demo with this --out replaces this directory\n")
    return RLRun(cfg.rl_config(), out, console)


def summary(run: RLRun, lines: list[dict[str, Any]], console: Console) -> None:
    """Reward per iteration, where everything is, and the commands to go on."""
    console.print(results_table(lines, read_lines(run.eval_path)))
    out = run.out
    files = Table(title="where everything is", show_header=False)
    for name, what in (("rl.jsonl", "one line per iteration (docs/rl.md)"),
                       ("eval.jsonl", "held-out tasks scored on the first and last policy (docs/evaluation.md)"),
                       ("rl.png", "reward per iteration, and on the held-out tasks"),
                       ("rl.duckdb", "calls, episodes, samples of every iteration (docs/schema.md)"),
                       ("flows/", "what the proxy recorded (docs/flow-format.md)"),
                       ("iterations/", "each iteration's episodes: workspace, agent output, reward"),
                       ("train/", "the trainer's metrics.jsonl and the last checkpoint"),
                       ("policies/", "the policy the engine serves now"), ("logs/", "engine.log, proxy.log")):
        files.add_row(str(out / name), what)
    console.print(files)
    print_next(next_commands(run.out, run.state.served, len(lines)), console)


def print_next(commands: list[str], console: Console) -> None:
    """One command a line, never wrapped: a terminal narrower than a command shows it cut, not broken in two."""
    console.print("Next:\n" + "\n".join(f"  {line}" for line in commands), highlight=False, soft_wrap=True)


def next_commands(out: Path, served: str, iterations: int) -> list[str]:
    """The commands the summary suggests, each runnable as printed (with this environment's tools)."""
    openforge, jupyter = _tool("openforge"), _tool("jupyter")
    root = " --allow-root" if os.geteuid() == 0 else ""  # jupyter refuses to start as root without it
    lab = (f"OPENFORGE_RL_DIR={out.resolve()} {jupyter} lab{root} notebooks/rl_run.ipynb   (the run, plotted)"
           if jupyter else f"pip install jupyterlab, then OPENFORGE_RL_DIR={out.resolve()} jupyter lab notebooks/")
    serve = (f"{openforge} engine --gguf {served}   (serve the trained policy)" if served else
             "(no iteration had anything to learn, so no policy was published: see rl.jsonl's skipped_train)")
    return [
        lab,
        f"{openforge} rl --out {out} --resume --iterations {iterations + 2}   (two more iterations)",
        f"{openforge} rl --out rl-vllm --engine vllm   (the same loop on real vLLM: make setup-vllm first)",
        f"{openforge} rl --out rl-codex --tasks TASKS.jsonl --toolchain codex --set proxy.max_tokens=256   "
        "(a real CLI on your own tasks: docs/rollouts.md)",
        serve,
    ]


def _tool(name: str) -> str | None:
    """How to call a console script of this environment: its bare name when the shell finds this one,
    else its path (e.g. `.venv/bin/openforge` after `make demo` without an activated venv); None if absent."""
    beside = Path(sys.executable).parent / name
    if not beside.exists():
        return shutil.which(name)
    if shutil.which(name) == str(beside):
        return name
    try:
        return str(beside.relative_to(Path.cwd()))
    except ValueError:
        return str(beside)
