"""`reconstruct(paths, db, tokenizer, ...)`: flow files -> token-exact samples in DuckDB.

Two passes, both streaming. Pass 1 (`ingest.Ingest`) reads each new (or grown) flow file once, turns each
exchange into a call with token ids and stores it (`calls`, `call_tokens`), rewards into `rewards`, and
anything unusable into `skipped`. Pass 2 (`rebuild.Rebuild`) rebuilds only the episodes that pass 1 touched,
one episode in memory at a time, from `call_tokens`: trajectory tree, samples, reward, advantage.
"""

from __future__ import annotations

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

__all__ = ["BuildOptions", "Progress", "Summary", "reconstruct"]


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
    `chat_template` and `processor` are its own). Raises `vision.ProcessorError` for a directory without a
    usable image processor.
    """
    started = time.monotonic()
    policy = missing_reward if isinstance(missing_reward, MissingReward) else MissingReward.parse(missing_reward)
    advantage_sql(advantage, group_by)  # validate before any work
    build = BuildOptions(sorted(set(train_roles)), keep_prompt_mismatch)
    files = expand_paths(list(paths))
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
