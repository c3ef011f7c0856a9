"""`openforge tasks synth` (docs/tasks.md)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import typer

from openforge.commands import FAILED, fail
from openforge.protocols.control import ControlClient, ControlError


def register(app: typer.Typer) -> None:
    """Adds `synth` to the `openforge tasks` group."""
    app.command("synth")(synth)


def _about(value: str) -> str:
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).expanduser().read_text()
    except OSError as e:
        fail(f"--about {value}: cannot read the file: {e.strerror}")


def _flow_dir(proxy: str, token: str | None) -> Path | None:
    """The proxy's flow directory, from its status answer (a proxy on this machine)."""
    try:
        flow_file = ControlClient(proxy, token, timeout=10, tries=1).status().get("flow_file")
    except ControlError:
        return None
    return Path(flow_file).parent if isinstance(flow_file, str) and Path(flow_file).parent.is_dir() else None


def synth(
    proxy: str = typer.Option(..., help="The running OpenForge proxy's base URL, e.g. http://127.0.0.1:8080: every "
                                        "model call goes through it (role synthesis, the validator's role validator)."),
    about: str = typer.Option(..., help="What the tasks are about: the text itself, or @FILE to read it from a file "
                                        "(a repository's README, a topic list)."),
    out: Path = typer.Option(..., help="Task file to write (JSONL, docs/rollouts.md): the accepted tasks, written "
                                       "whole or not at all."),
    n: int = typer.Option(5, "--n", min=1, help="Candidate tasks to propose."),
    repairs: int = typer.Option(2, min=0, help="Repair rounds per candidate: a malformed answer, a failed check or "
                                               "the validator's finding goes back to the model with what was wrong."),
    validator_toolchain: str = typer.Option("tool-agent", help="The validator's agent: a built-in adapter or "
                                                              "custom:FILE.toml (as openforge rollout --toolchain)."),
    validator_attempts: int = typer.Option(1, min=1, help="Validator attempts per task and round."),
    model: str = typer.Option("synth", help="Model name sent with the synthesis calls (the proxy's openforge_models "
                                            "maps role synthesis to an engine model)."),
    flow_dir: Path | None = typer.Option(None, help="The proxy's flow directory, read for the cost of each task. "
                                                    "Default: the directory of the flow file the proxy's status "
                                                    "names (a proxy on this machine)."),
    flow_key_file: Path | None = typer.Option(None, help="The proxy's flow key file, when it signs its records: "
                                                         "only signed records are counted."),
    work: Path | None = typer.Option(None, help="Directory for the checks' and the validator's episodes. Default: "
                                                "OUT's name + '.synth' beside it."),
    prices: Path | None = typer.Option(None, help="Price table (.json/.toml: role or \"*\" -> {prompt, completion} "
                                                  "dollars per million tokens) to print a dollar cost per task."),
    no_sandbox: bool = typer.Option(False, "--no-sandbox", help="Run checks and the validator's agent as plain "
                                                               "processes instead of in a bubblewrap sandbox."),
) -> None:
    """Propose N tasks with a model, implement each (files, setup, verify, reference solution), check it by
    running it, let a validator agent attempt it, and repair what fails, up to --repairs rounds; write the
    tasks that pass everything to OUT and a summary (rejections by reason, cost per task read from the
    proxy's flow records) to OUT.synth.json. Token: $OPENFORGE_CLIENT_TOKEN (one of the proxy's client tokens)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from openforge.addons.flowfile import read_key
    from openforge.rollout.spec import CLIENT_TOKEN_ENV
    from openforge.taskforge import cost
    from openforge.taskforge.synth import Model, Synth, SynthError, check_inputs, write_tasks

    text = _about(about).strip()
    sandbox = "none" if no_sandbox else "bwrap"
    token = os.environ.get(CLIENT_TOKEN_ENV)
    try:
        check_inputs(text, proxy, token, sandbox)
        price_table = cost.read_prices(prices) if prices else None
        key = read_key(flow_key_file) if flow_key_file else None
    except ValueError as e:  # SynthError, a price table or key file that cannot be read
        fail(str(e))
    if not out.parent.is_dir():
        fail(f"--out {out}: no directory {out.parent}")
    work_dir = work or out.with_name(out.name + ".synth")
    work_dir.mkdir(parents=True, exist_ok=True)

    def checker(task: Any) -> Any:
        from openforge.taskforge.check import check_task

        return check_task(task, sandbox=sandbox, work_root=work_dir / "checks")

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("synth: proposing", total=None)
        counts = {"accepted": 0, "rejected": 0}

        def on_candidate(candidate: str, state: str) -> None:
            if state in counts:
                counts[state] += 1
                progress.update(bar, advance=1)
            progress.update(bar, description=f"synth: {candidate} {state}; accepted {counts['accepted']}, "
                                             f"rejected {counts['rejected']}")

        runner = Synth(Model(proxy, model, token), proxy, text, work_dir, checker, n=n, repairs=repairs,
                       toolchain=validator_toolchain, validator_attempts=validator_attempts, sandbox=sandbox,
                       client_token=token, on_candidate=on_candidate)
        try:
            outcome = runner.synthesize(on_proposed=lambda k: progress.update(bar, total=k))
            where = flow_dir or _flow_dir(proxy, token)
            if where is None:
                raise SynthError("cannot find the proxy's flow files (its status names none): give --flow-dir")
            runner.account(outcome, where, key)
        except (SynthError, cost.FlowReadError) as e:
            progress.stop()
            fail(str(e), code=FAILED)
        finally:
            runner.model.close()
    write_tasks(out, outcome.accepted)
    summary = outcome.summary()
    if price_table is not None:
        summary["dollars"] = cost.dollars(outcome.cost, price_table)
        summary["dollars_per_accepted"] = round(summary["dollars"] / len(outcome.accepted), 6) \
            if outcome.accepted else None
    summary_path = out.with_name(out.name + ".synth.json")
    summary_path.write_text(json.dumps(summary, indent=1))
    for r in outcome.rejected:
        print(f"rejected {outcome.run_id}.{r.candidate} ({r.title}): {r.reason}: "
              f"{' '.join(r.detail.split())[:200]}", file=sys.stderr)
    reasons = ", ".join(f"{k} {v}" for k, v in outcome.reasons.items()) or "none"
    per = outcome.per_accepted
    line = (f"{len(outcome.accepted)} of {outcome.proposed} candidates accepted -> {out} (rejected: {reasons}); "
            f"{outcome.cost['calls']} calls, {outcome.cost['prompt_tokens']} prompt + "
            f"{outcome.cost['completion_tokens']} completion tokens")
    if per:
        tokens = per["prompt_tokens"] + per["completion_tokens"]
        line += f"; per accepted task {per['calls']:g} calls, {tokens:g} tokens"
        if "dollars_per_accepted" in summary:
            line += f", ${summary['dollars_per_accepted']:.4f}"
    print(line + f"; summary: {summary_path}")
    if not outcome.accepted:
        raise typer.Exit(FAILED)

