"""Totals of a reconstruct database, for `openforge stats` and tests."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from openforge.reconstruct.store import MIGRATIONS, REBUILD, SCHEMA_VERSION
from openforge.reconstruct.trajectories import DRIFT_CLASSES

if TYPE_CHECKING:
    import duckdb


class StatsError(ValueError):
    """The file cannot be read as a reconstruct database; the message says what to do."""


def first_line(e: Exception) -> str:
    """DuckDB's message without what it appends on later lines."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def open_database(db: str | Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection to a reconstruct database of this schema version: the queries below name its
    columns, so another version (or another file) is refused with what to run instead of failing mid-way."""
    import duckdb

    try:
        con = duckdb.connect(str(db), read_only=True)
    except duckdb.Error as e:
        raise StatsError(f"{db} is not a DuckDB database: {first_line(e)}") from None
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except duckdb.Error:
        con.close()
        raise StatsError(f"{db} is a DuckDB file that `openforge reconstruct` did not write (no meta table)") from None
    version = str(row[0]) if row else None
    if version != SCHEMA_VERSION:
        con.close()
        fix = (f"run `openforge reconstruct FLOWS --db {db}` once (it migrates versions {', '.join(MIGRATIONS)} "
               "in place)" if version in MIGRATIONS else REBUILD)
        raise StatsError(f"{db} has schema version {version}, this stats reads {SCHEMA_VERSION}: {fix}")
    return con


def collect(db: str | Path) -> dict[str, Any]:
    con = open_database(db)
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
