"""Totals of a reconstruct database, for `openforge stats` and tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openforge.reconstruct.trajectories import DRIFT_CLASSES
from openforge.samples import connect


def collect(db: str | Path) -> dict[str, Any]:
    """The totals; `samples.SchemaError` for a file that is not a database of this schema version (the
    queries name its columns)."""
    con = connect(db)
    try:
        def one(query: str) -> tuple[Any, ...]:
            return con.execute(query).fetchone() or ()

        episodes, extra_chains = one("SELECT count(*), coalesce(sum(n_samples - 1), 0) FROM episodes")
        calls, prompt_engine, completion_engine, mismatch = one(
            "SELECT count(*), count(*) FILTER (token_source = 'engine'), "
            "count(*) FILTER (token_source IN ('engine', 'mixed')), count(*) FILTER (prompt_check = 'mismatch') "
            "FROM calls")
        roles = dict(con.execute("SELECT role, count(*) FROM calls GROUP BY role ORDER BY 2 DESC").fetchall())
        samples, tokens, trainable = one(
            "SELECT count(*), coalesce(sum(n_tokens), 0), coalesce(sum(n_trainable), 0) FROM samples"
        )
        built_calls = one("SELECT coalesce(sum(n_calls), 0) FROM episodes")[0]
        drift = one("SELECT " + ", ".join(f"coalesce(sum(drift_{c}), 0)" for c in DRIFT_CLASSES) + " FROM episodes")
        classes = {c: int(n) for c, n in zip(DRIFT_CLASSES, drift) if n}
        unclassified = int(extra_chains) - sum(classes.values())
        if unclassified > 0:
            classes["new conversation"] = unclassified  # subagents, compaction, retries
        images = one("SELECT (SELECT count(*) FROM images), count(*) FILTER (n_images > 0), "
                     "coalesce(sum(n_images), 0) FROM samples")
        skipped = dict(con.execute("SELECT reason, count(*) FROM skipped GROUP BY reason ORDER BY 2 DESC").fetchall())
        return {
            "episodes": episodes,
            "calls": calls,
            # llama.cpp returns completion ids only: its prompts are rendered by the chat template
            "prompt_ids": {"engine": prompt_engine, "rendered": calls - prompt_engine},
            "completion_ids": {"engine": completion_engine, "rendered": calls - completion_engine},
            "calls_prompt_mismatch": mismatch,  # rendered prompt length != the engine's: template drift
            "calls_by_role": roles,
            "samples": samples,
            "tokens": int(tokens),
            "trainable_tokens": int(trainable),
            "merge_ratio": (built_calls / samples) if samples else 0.0,
            "branches": int(extra_chains),
            "branches_by_class": classes,
            # each image once; samples that have images, and the images they hold (an image resent on each
            # turn of an episode counts once per sample)
            "images": {"stored": images[0], "samples": images[1], "in samples": int(images[2])},
            "skipped": skipped,
        }
    finally:
        con.close()
