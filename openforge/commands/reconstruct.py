"""`openforge reconstruct`: flow files -> token-exact training samples in DuckDB."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from openforge.choices import Advantage, GroupBy
from openforge.commands import FAILED, fail, one_command

if TYPE_CHECKING:
    from openforge.reconstruct.summary import Summary


def reconstruct_command(
    flows: list[Path] = typer.Argument(
        ..., help="Flow files or directories (searched for *.flows). OpenForge flow files or mitmproxy `-w` files."
    ),
    db: Path = typer.Option(..., "--db", help="DuckDB database to create or extend (e.g. runs.duckdb)."),
    tokenizer: Path = typer.Option(
        ..., "--tokenizer", help="Local directory of the policy's Hugging Face tokenizer (with its chat template)."
    ),
    rewards: Path | None = typer.Option(
        None, "--rewards",
        help="Rewards file, JSONL or .csv: episode_id, reward, optional task_id. Beats reward records."
    ),
    run: str | None = typer.Option(None, "--run", help="Free label stored with every call and sample of this run."),
    missing_reward: str | None = typer.Option(
        None,
        "--missing-reward",
        help="Episodes without a reward: `drop` them, `fill:<x>` with reward x, or `keep` them with a NULL reward. "
        "Without it such episodes are left unbuilt (reported) until a reward or a policy arrives.",
    ),
    advantage: Advantage = typer.Option(
        Advantage.grpo, "--advantage",
        help="Per-task advantage: grpo ((r-mean)/std), grpo-no-std (r-mean), rloo (leave-one-out)."
    ),
    group_by: GroupBy = typer.Option(
        GroupBy.task, "--group-by",
        help="Advantage groups: `task`, or `task-toolchain` (each toolchain's episodes of a task apart)."
    ),
    train_roles: str = typer.Option(
        "agent", "--train-roles",
        help="Comma-separated routing roles whose calls are the policy's and trainable. Other roles' calls "
        "(validator, synthesis, ...) are kept as samples with nothing trainable.",
    ),
    keep_prompt_mismatch: bool = typer.Option(
        False, "--keep-prompt-mismatch",
        help="Train calls whose rendered prompt differs in length from the engine's (template drift); "
        "left out by default.",
    ),
    chat_template: Path | None = typer.Option(
        None, "--chat-template",
        help="Jinja file with the chat template the engine rendered prompts with, when it is not the tokenizer's own.",
    ),
    processor: Path | None = typer.Option(
        None, "--processor",
        help="Directory of a vision-language model's processor (preprocessor_config.json and the chat template "
        "that renders images) for calls with images; found in --tokenizer when it has one. Without it such calls "
        "are skipped.",
    ),
    flow_key_file: Path | None = typer.Option(
        None, "--flow-key-file",
        help="File with the key the proxy signed its flow files with (openforge_flow_key_file). Only records "
        "whose signature holds are used; unsigned or badly signed files are skipped as unauthenticated_file.",
    ),
) -> None:
    """Read flow files, rebuild each episode's trajectory tree and write samples, rewards and advantages.

    Running it again on the same or a growing set of files adds only what is new.
    """
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

    from openforge.reconstruct.rewards import MissingReward, RewardFileError

    console = Console(stderr=True)
    try:
        policy = MissingReward.parse(missing_reward)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--missing-reward") from None
    roles = [r.strip() for r in train_roles.split(",") if r.strip()]
    if not roles:
        raise typer.BadParameter("name at least one role, e.g. agent", param_hint="--train-roles")
    if chat_template is not None and not chat_template.is_file():
        raise typer.BadParameter(f"{chat_template} is not a file", param_hint="--chat-template")
    missing = [str(p) for p in flows if not p.exists()]
    if missing:
        fail(f"No such flow file or directory: {', '.join(missing)}")
    empty = [str(p) for p in flows if p.is_dir() and next(p.rglob("*.flows"), None) is None]
    if empty:  # an empty database would look like a run that recorded nothing
        fail(f"no flow files (*.flows) in {', '.join(empty)}",
             hint="give the proxy's --flow-dir (openforge_flow_dir), or the flow files themselves")
    if not tokenizer.is_dir():
        fail(f"--tokenizer {tokenizer} is not a directory", hint="give a local Hugging Face tokenizer directory")
    if processor is not None and not (processor / "preprocessor_config.json").is_file():
        fail(f"--processor {processor} has no preprocessor_config.json",
             hint="give the directory of a vision-language model (its image processor and chat template)")
    flow_key = None
    if flow_key_file is not None:
        from openforge.addons.flowfile import read_key

        try:
            flow_key = read_key(flow_key_file)
        except ValueError as e:
            fail(str(e))

    from openforge.reconstruct.api import reconstruct
    from openforge.reconstruct.renderer import load_renderer
    from openforge.reconstruct.vision import ProcessorError

    with console.status("Loading tokenizer and image processor"):
        try:
            renderer = load_renderer(tokenizer, chat_template, processor)
        except ProcessorError as e:
            fail(str(e))
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad --tokenizer
            fail(f"Cannot load tokenizer from {tokenizer}: {e}")
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                  TimeRemainingColumn(), console=console) as bar:
        tasks: dict[str, TaskID] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task("Reading flows" if stage == "read" else "Building episodes", total=total)
            bar.update(tasks[stage], completed=done, total=total)

        try:
            summary = reconstruct(flows, db, renderer, rewards=rewards, run=run, missing_reward=policy,
                                  advantage=advantage.value, progress=progress, train_roles=roles,
                                  group_by=group_by.value,
                                  keep_prompt_mismatch=keep_prompt_mismatch, flow_key=flow_key)
        except RewardFileError as e:
            fail(str(e))
        except Exception as e:  # noqa: BLE001 - a sentence, never a traceback (a bad record is skipped, not raised)
            fail(f"reconstruct stopped: {type(e).__name__}: {e}", code=FAILED)
    print_summary(summary)


def print_summary(summary: Summary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Reconstruct", show_header=False)
    rows = [
        ("files", f"{summary.files} ({summary.files_ingested} read, {summary.files_unchanged} unchanged)"),
        ("records", summary.records),
        ("calls", f"{summary.calls} ({summary.calls_engine_ids} engine ids, {summary.calls_mixed} engine completion "
                  f"ids, {summary.calls_retokenized} retokenized)"),
        ("calls by role", ", ".join(f"{k} {v}" for k, v in sorted(summary.calls_by_role.items())) or "none"),
        ("prompt != engine's", f"{summary.calls_prompt_mismatch} calls (template drift; not trained unless "
                               "--keep-prompt-mismatch)"),
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


register = one_command("reconstruct", reconstruct_command)
