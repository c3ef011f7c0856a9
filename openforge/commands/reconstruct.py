"""`openforge reconstruct`: flow files -> token-exact training samples in DuckDB."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command(name="reconstruct")(reconstruct_command)


def reconstruct_command(
    flows: list[Path] = typer.Argument(
        ..., help="Flow files or directories (searched for *.flows). OpenForge flow files or mitmproxy `-w` files."
    ),
    db: Path = typer.Option(..., "--db", help="DuckDB database to create or extend (e.g. runs.duckdb)."),
    tokenizer: Path = typer.Option(
        ..., "--tokenizer", help="Local directory of the policy's Hugging Face tokenizer (with its chat template)."
    ),
    rewards: Path | None = typer.Option(
        None, "--rewards", help="Rewards file, JSONL or .csv: episode_id, reward, optional task_id. Beats reward records."
    ),
    run: str | None = typer.Option(None, "--run", help="Free label stored with every call and sample of this run."),
    missing_reward: str | None = typer.Option(
        None,
        "--missing-reward",
        help="Episodes without a reward: `drop` them, `fill:<x>` with reward x, or `keep` them with a NULL reward. "
        "Without it such episodes are left unbuilt (reported) until a reward or a policy arrives.",
    ),
    advantage: str = typer.Option(
        "grpo", "--advantage", help="Per-task advantage: grpo ((r-mean)/std), grpo-no-std (r-mean), rloo (leave-one-out)."
    ),
    group_by: str = typer.Option(
        "task", "--group-by", help="Advantage groups: `task`, or `task-toolchain` (each toolchain's episodes of a task apart)."
    ),
    train_roles: str = typer.Option(
        "agent", "--train-roles",
        help="Comma-separated routing roles whose calls are the policy's and trainable. Other roles' calls "
        "(validator, synthesis, ...) are kept as samples with nothing trainable.",
    ),
    keep_prompt_mismatch: bool = typer.Option(
        False, "--keep-prompt-mismatch",
        help="Train calls whose rendered prompt differs in length from the engine's (template drift); left out by default.",
    ),
    chat_template: Path | None = typer.Option(
        None, "--chat-template",
        help="Jinja file with the chat template the engine rendered prompts with, when it is not the tokenizer's own.",
    ),
) -> None:
    """Read flow files, rebuild each episode's trajectory tree and write samples, rewards and advantages.

    Running it again on the same or a growing set of files adds only what is new.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from openforge.reconstruct.rewards import ADVANTAGES, GROUPINGS, MissingReward, RewardFileError

    console = Console(stderr=True)
    try:
        policy = MissingReward.parse(missing_reward)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--missing-reward") from None
    if advantage not in ADVANTAGES:
        raise typer.BadParameter(f"choose one of {', '.join(ADVANTAGES)}", param_hint="--advantage")
    if group_by not in GROUPINGS:
        raise typer.BadParameter(f"choose one of {', '.join(GROUPINGS)}", param_hint="--group-by")
    roles = [r.strip() for r in train_roles.split(",") if r.strip()]
    if not roles:
        raise typer.BadParameter("name at least one role, e.g. agent", param_hint="--train-roles")
    if chat_template is not None and not chat_template.is_file():
        raise typer.BadParameter(f"{chat_template} is not a file", param_hint="--chat-template")
    missing = [str(p) for p in flows if not p.exists()]
    if missing:
        console.print(f"[red]No such flow file or directory: {', '.join(missing)}")
        raise typer.Exit(2)
    if not tokenizer.is_dir():
        console.print(f"[red]--tokenizer {tokenizer} is not a directory (give a local Hugging Face tokenizer).")
        raise typer.Exit(2)

    from openforge.reconstruct.api import reconstruct
    from openforge.reconstruct.tokenize import Retokenizer, load_tokenizer

    with console.status("Loading tokenizer"):
        try:
            retok = Retokenizer(load_tokenizer(tokenizer))
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad --tokenizer
            console.print(f"[red]Cannot load tokenizer from {tokenizer}: {e}")
            raise typer.Exit(2) from None
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeRemainingColumn(), console=console) as bar:
        tasks: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task("Reading flows" if stage == "read" else "Building episodes", total=total)
            bar.update(tasks[stage], completed=done, total=total)

        try:
            summary = reconstruct(flows, db, retok, rewards=rewards, run=run, missing_reward=policy,
                                  advantage=advantage, progress=progress, train_roles=roles, group_by=group_by,
                                  keep_prompt_mismatch=keep_prompt_mismatch, chat_template=chat_template)
        except RewardFileError as e:
            console.print(f"[red]{e}")
            raise typer.Exit(2) from None
        except Exception as e:  # noqa: BLE001 - a sentence, never a traceback (a bad record is skipped, not raised)
            console.print(f"reconstruct stopped: {type(e).__name__}: {e}", style="red", markup=False)
            raise typer.Exit(1) from None
    print_summary(summary)


def print_summary(summary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Reconstruct", show_header=False)
    rows = [
        ("files", f"{summary.files} ({summary.files_ingested} read, {summary.files_unchanged} unchanged)"),
        ("records", summary.records),
        ("calls", f"{summary.calls} ({summary.calls_engine_ids} engine ids, {summary.calls_mixed} engine completion ids, {summary.calls_retokenized} retokenized)"),
        ("calls by role", ", ".join(f"{k} {v}" for k, v in sorted(summary.calls_by_role.items())) or "none"),
        ("prompt != engine's", f"{summary.calls_prompt_mismatch} calls (template drift; not trained unless --keep-prompt-mismatch)"),
        ("rewards", summary.rewards),
        ("episodes built", summary.episodes),
        ("samples", summary.samples),
        ("tokens", f"{summary.tokens} ({summary.trainable_tokens} trainable)"),
        ("branches by class", ", ".join(f"{k} {v}" for k, v in sorted(summary.drift.items())) or "none"),
        ("skipped", ", ".join(f"{k} {v}" for k, v in sorted(summary.skipped.items())) or "none"),
        ("episodes without reward", f"{summary.episodes_missing_reward} ({summary.episodes_dropped} dropped, "
                                    f"{summary.episodes_pending} pending)"),
        ("seconds", f"{summary.seconds:.1f}"),
    ]
    for k, v in rows:
        table.add_row(k, str(v))
    console = Console()
    console.print(table)
    if summary.episodes_pending:
        console.print(f"[yellow]{summary.episodes_pending} episodes have no reward and were not built: pass "
                      "--rewards, or --missing-reward drop|fill:<x>|keep.")
