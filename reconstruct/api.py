"""`reconstruct(paths, db, tokenizer, ...)`: flow files -> token-exact samples in DuckDB.

Two passes, both streaming. Pass 1 (`ingest.Ingest`) reads each new (or grown) flow file once, turns each
exchange into a call with token ids and stores it (`calls`, `call_tokens`), rewards into `rewards`, and
anything unusable into `skipped`. Pass 2 (`rebuild.Rebuild`) rebuilds only the episodes that pass 1 touched,
one episode in memory at a time, from `call_tokens`: trajectory tree, samples, reward, advantage.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from openforge.addons.flowfile import expand_paths
from openforge.reconstruct import store
from openforge.reconstruct.ingest import DEFAULT_ROLE, Ingest
from openforge.reconstruct.rebuild import BuildOptions, Progress, Rebuild, snapshot_rewards
from openforge.reconstruct.renderer import Renderer, load_renderer
from openforge.reconstruct.rewards import MissingReward, advantage_sql, read_rewards_file
from openforge.reconstruct.summary import Summary
from openforge.reconstruct.vision import Vision

__all__ = ["BuildOptions", "Progress", "ReconstructError", "Summary", "check_inputs", "reconstruct"]


class ReconstructError(ValueError):
    """An input `reconstruct` refuses before it reads a file or opens the database. `option`: the CLI option
    at fault, for a usage error naming it; `hint`: what to give instead."""

    def __init__(self, message: str, *, option: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.option, self.hint = option, hint


def check_inputs(
    paths: Iterable[str | Path],
    tokenizer: Any,
    missing_reward: str | MissingReward | None = None,
    train_roles: Iterable[str] = (DEFAULT_ROLE,),
    chat_template: str | Path | None = None,
    processor: str | Path | Vision | None = None,
    flow_files_required: bool = False,
) -> MissingReward | None:
    """Raise `ReconstructError` for an input `reconstruct` could only fail on later, after loading a
    tokenizer, or turn into skipped records; returns the parsed `missing_reward`. `reconstruct` calls it;
    the CLI calls it first, before it loads the tokenizer. `flow_files_required`: refuse a directory with no
    flow files too (the CLI: an empty database would look like a run that recorded nothing; the RL loop's
    flow directory may legitimately hold none yet)."""
    try:
        policy = missing_reward if isinstance(missing_reward, MissingReward) else MissingReward.parse(missing_reward)
    except ValueError as e:
        raise ReconstructError(str(e), option="--missing-reward") from None
    if not any(r.strip() for r in train_roles):
        raise ReconstructError("name at least one role, e.g. agent", option="--train-roles")
    if chat_template is not None and not Path(chat_template).is_file():
        raise ReconstructError(f"{chat_template} is not a file", option="--chat-template")
    given = [Path(p) for p in paths]
    missing = [str(p) for p in given if not p.exists()]
    if missing:
        raise ReconstructError(f"No such flow file or directory: {', '.join(missing)}")
    empty = [str(p) for p in given if p.is_dir() and next(p.rglob("*.flows"), None) is None]
    if flow_files_required and empty:
        raise ReconstructError(f"no flow files (*.flows) in {', '.join(empty)}",
                               hint="give the proxy's --flow-dir (openforge_flow_dir), or the flow files themselves")
    if isinstance(tokenizer, (str, os.PathLike)) and not Path(tokenizer).is_dir():
        raise ReconstructError(f"--tokenizer {tokenizer} is not a directory",
                               hint="give a local Hugging Face tokenizer directory")
    if isinstance(processor, (str, os.PathLike)) and not (Path(processor) / "preprocessor_config.json").is_file():
        raise ReconstructError(f"--processor {processor} has no preprocessor_config.json",
                               hint="give the directory of a vision-language model (its image processor and chat "
                               "template)")
    return policy


def reconstruct(
    paths: Iterable[str | Path],
    db: str | Path,
    tokenizer: Any,
    rewards: str | Path | None = None,
    run: str | None = None,
    missing_reward: str | MissingReward | None = None,
    advantage: str = "grpo",
    progress: Progress | None = None,
    train_roles: Iterable[str] = (DEFAULT_ROLE,),
    group_by: str = "task",
    keep_prompt_mismatch: bool = False,
    chat_template: str | Path | None = None,
    processor: str | Path | Vision | None = None,
    flow_key: bytes | None = None,
) -> Summary:
    """Ingest flow files (ours or mitmproxy's) into `db`; rebuild the episodes they touch.

    Only calls of `train_roles` become trainable tokens; other roles' calls are kept as samples with nothing
    trainable. `group_by`: advantages within a task (`task`) or within a task and toolchain (`task-toolchain`).
    A call whose rendered prompt differs in length from the engine's is template drift and trains only with
    `keep_prompt_mismatch`. `chat_template`: a file with the template the engine rendered prompts with.
    `processor`: a vision-language model's directory (its image processor and the chat template that renders
    images), found in a `tokenizer` directory that has one; without it, calls with images are skipped.
    `flow_key`: the run's flow key (`flowfile.read_key`); with it only signed files count, each up to its
    first record whose MAC fails, and the rest goes to `skipped` as `unauthenticated_file`.
    `tokenizer`: a tokenizer directory, a loaded tokenizer or `Retokenizer`, or a `renderer.Renderer` (then
    `chat_template` and `processor` are its own). Raises `ReconstructError` for the inputs `check_inputs`
    refuses, `vision.ProcessorError` for a directory without a usable image processor.
    """
    started = time.monotonic()
    paths, train_roles = list(paths), list(train_roles)
    policy = check_inputs(paths, tokenizer, missing_reward, train_roles, chat_template, processor)
    advantage_sql(advantage, group_by)  # validate before any work
    build = BuildOptions(sorted(set(train_roles)), keep_prompt_mismatch)
    files = expand_paths(paths)
    reward_rows = list(read_rewards_file(rewards)) if rewards else []
    renderer = tokenizer if isinstance(tokenizer, Renderer) else load_renderer(tokenizer, chat_template, processor)
    retok, vision = renderer.retok, renderer.vision
    con = store.connect(db)
    try:
        summary = Summary(files=len(files))
        snapshot_rewards(con)
        ingest = Ingest(con, retok, run, summary, vision, flow_key)
        total = sum(p.stat().st_size for p in files if p.exists())
        done = 0
        for path in files:
            ingest.file(path)
            done += path.stat().st_size if path.exists() else 0
            if progress:
                progress("read", done, total)
        if rewards:
            ingest.rewards_file(Path(rewards), reward_rows)
        Rebuild(con, retok, build, summary).run(ingest.touched, policy, advantage, group_by, progress)
        summary.seconds = time.monotonic() - started
        return summary
    finally:
        con.close()
