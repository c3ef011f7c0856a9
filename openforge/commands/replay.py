"""`openforge replay serve|drive`: re-run a captured session without an engine, or load-test an engine with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from openforge.choices import Side
from openforge.commands import FAILED, fail

replay_app = typer.Typer(
    help="Answer toolchains from a captured trace (serve), or re-send its calls to an engine (drive).",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(replay_app, name="replay")


def _load(trace: list[Path]) -> list[dict[str, Any]]:  # the replay module is imported only when a command runs
    from openforge.replay.trace import ReplayError, load_exchanges

    try:
        return load_exchanges(trace)
    except ReplayError as e:
        fail(str(e))


@replay_app.command("serve")
def serve(
    trace: list[Path] = typer.Argument(..., help="Flow files or directories of a captured trace."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8400, help="Port to listen on (0: pick a free one and print it)."),
    side: Side = typer.Option(
        Side.client,
        help="'client': stand in for proxy+engine, point the toolchain here and get what it received. "
        "'engine': stand in for the engine behind `openforge proxy`, answering the engine's recorded "
        "responses (with token ids) to the proxy's upstream requests.",
    ),
    fast: bool = typer.Option(False, "--fast",
                              help="Send answers as fast as possible instead of at the recorded pace."),
    speed: float = typer.Option(1.0, help="Pace multiplier (2.0 = twice as fast as recorded); ignored with --fast."),
) -> None:
    """Answer calls from a trace, matched by conversation; a call that matches nothing gets an error saying
    where it diverged."""
    from openforge.replay.serve import ReplayIndex, ReplayServer
    from openforge.replay.trace import ReplayError

    exchanges = _load(trace)
    try:
        index = ReplayIndex.build(exchanges, side=side.value)
    except ReplayError as e:
        fail(str(e))
    if speed <= 0:
        fail("--speed must be > 0")
    try:
        server = ReplayServer(index, host=host, port=port, speed=None if fast else speed)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e}")
    typer.echo(f"replaying {len(index)} recorded calls ({side} side) on {server.url}  (Ctrl-C to stop)")
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
        typer.echo(f"served {server.served} calls, {len(server.diverged)} diverged")
        for msg in server.diverged[:20]:
            typer.echo(f"  {msg}")


@replay_app.command("drive")
def drive(
    trace: list[Path] = typer.Argument(..., help="Flow files or directories of a captured trace."),
    upstream: str = typer.Option(..., help="Engine base URL (scheme://host:port); the recorded path is appended."),
    concurrency: int = typer.Option(8, min=1, help="Requests in flight at once."),
    side: Side = typer.Option(
        Side.engine,
        help="'engine': re-send the proxy's upstream requests (each call on its own). 'client': re-send what "
        "the toolchain sent, episode by episode in recorded order (e.g. through `openforge proxy`).",
    ),
    model: str | None = typer.Option(None, help="Replace the recorded model name (compare another policy)."),
    api_key: str | None = typer.Option(None, "--key", "--api-key", envvar="OPENFORGE_REPLAY_API_KEY", show_envvar=False,
                                          help="Bearer key for the engine (recorded keys are masked), as on `openforge "
                                               "proxy` and `preflight`. Default: $OPENFORGE_REPLAY_API_KEY."),
    timeout: float = typer.Option(300.0, help="Per-request timeout in seconds."),
    json_out: Path | None = typer.Option(None, "--json",
                                         help="Also write the summary and per-call results as JSON here."),
) -> None:
    """Re-send a trace's calls to an engine: throughput, TTFT and latency percentiles, divergence from the
    recorded outputs."""
    import asyncio
    from dataclasses import asdict

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from openforge.replay import drive as rp

    exchanges = _load(trace)
    total = rp.count_calls(exchanges, side.value)
    if total == 0:
        fail(f"the trace holds no LLM call with a recorded {side.value} request")
    with Progress(transient=True) as progress:
        task = progress.add_task("driving", total=total)
        report = asyncio.run(
            rp.drive(
                exchanges, upstream, concurrency, side.value, model, timeout, api_key,
                on_done=lambda _r: progress.advance(task),
            )
        )
    summary = report.summary()
    table = Table(title=f"replay drive -> {upstream}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in summary.items():
        table.add_row(k, "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v))
    Console().print(table)
    errors = [r.error for r in report.results if r.error]
    for e in sorted(set(errors))[:5]:
        typer.echo(f"error: {errors.count(e)} calls failed: {e}", err=True)
    if json_out:
        json_out.write_text(json.dumps({"summary": summary, "calls": [asdict(r) for r in report.results]}, indent=1))
    if summary["ok"] == 0:
        raise typer.Exit(FAILED)
