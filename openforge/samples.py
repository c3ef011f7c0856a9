"""The DuckDB contract's reader: what every consumer of a reconstruct database (the trainer, export, stats,
the RL loop, the notebooks) opens and selects samples through. `reconstruct/store.py` is its writer;
`reconstruct/schema.sql` and docs/schema.md are the contract."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa

SCHEMA_VERSION = "7"
# The older versions `openforge reconstruct` migrates in place (reconstruct/store.py MIGRATIONS); any other is
# rebuilt from the flow files.
MIGRATED_FROM = ("2", "3", "4", "5", "6")
REBUILD = "reconstruct the flow files into a new database (--db)"

# The columns of table `samples`, in schema.sql's order.
SAMPLE_COLUMNS = (
    "sample_id", "episode_id", "run_id", "task_id", "tokenizer", "vocab_size", "token_source", "input_ids",
    "loss_mask", "behaviour_logprobs", "n_tokens", "n_trainable", "n_calls", "reward", "advantage", "weight",
    "created_at", "role", "toolchain", "policy_version", "n_images", "processor", "group_id",
)


class SchemaError(ValueError):
    """The file is not a reconstruct database of this schema version; the message says what to run."""


def first_line(e: Exception) -> str:
    """DuckDB's message without the query excerpt it appends on later lines (an error is one line)."""
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def connect(path: str | Path, read_only: bool = True) -> duckdb.DuckDBPyConnection:
    """A connection to a reconstruct database of this schema version. Another file, or another version, is
    refused with what to run instead (`openforge reconstruct` migrates an older database in place): every
    query of a reader names this version's columns."""
    if not Path(path).is_file():  # never create one: a reader of a missing file is a wrong path
        raise SchemaError(f"no database at {path}")
    try:
        con = duckdb.connect(str(path), read_only=read_only)
    except duckdb.Error as e:
        raise SchemaError(f"cannot open DuckDB file {path}: {first_line(e)}") from None
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    except duckdb.Error:
        con.close()
        raise SchemaError(f"{path} is a DuckDB file that `openforge reconstruct` did not write (no meta table)") \
            from None
    version = str(row[0]) if row else None
    if version != SCHEMA_VERSION:
        con.close()
        fix = (f"run `openforge reconstruct FLOWS --db {path}` once (it migrates versions "
               f"{', '.join(MIGRATED_FROM)} in place)" if version in MIGRATED_FROM else REBUILD)
        raise SchemaError(f"{path} has schema version {version}, this OpenForge reads {SCHEMA_VERSION}: {fix}")
    return con


def _literal(value: str) -> str:
    """`value` as an SQL string literal."""
    return "'" + value.replace("'", "''") + "'"


@dataclass(frozen=True)
class Selection:
    """Which trainable samples (`n_trainable > 0`) a consumer reads: `where` (SQL on `samples`, as the user
    gives it to `--where`), a range of policy versions, the episodes of a range of RL iterations (table
    `rl_episodes`, without those whose reward disagreed with their result: `rl_reward_mismatches`), or named
    episodes. Every field narrows the selection; the defaults select every trainable sample."""

    where: str = ""
    versions: tuple[int, int] | None = None     # policy_version BETWEEN lo AND hi
    iterations: tuple[int, int] | None = None   # episodes of rl_episodes.iteration BETWEEN lo AND hi
    episodes: tuple[str, ...] | None = None

    def sql(self) -> str:
        """The WHERE clause on `samples`: numbers rendered by int(), ids as quoted literals, so the clause
        can go into any query (several times over) without parameters to thread through."""
        terms = ["n_trainable > 0"]
        if self.where.strip():
            terms.append(f"({self.where})")
        if self.versions is not None:
            lo, hi = self.versions
            terms.append(f"policy_version BETWEEN {int(lo)} AND {int(hi)}")
        if self.iterations is not None:
            lo, hi = self.iterations
            terms.append(f"episode_id IN (SELECT episode_id FROM rl_episodes WHERE iteration BETWEEN {int(lo)} "
                         f"AND {int(hi)}) AND episode_id NOT IN (SELECT episode_id FROM rl_reward_mismatches)")
        if self.episodes is not None:
            ids = ", ".join(_literal(e) for e in self.episodes)
            terms.append(f"episode_id IN ({ids})" if ids else "false")
        return " AND ".join(terms)


def rl_window(iteration: int, window: int) -> Selection:
    """The samples RL iteration `iteration` trains on: the rollout episodes of its last `window` iterations,
    at the policy versions that ran them."""
    lo = max(0, iteration - window + 1)
    return Selection(versions=(lo, iteration), iterations=(lo, iteration))


def list_arrays(column: pa.ListArray | pa.ChunkedArray, dtype: type | None = None) -> list[np.ndarray | None]:
    """An Arrow list column as one numpy array per row (None for a NULL): views of its values, converted to
    `dtype` once when given. The offsets of a sliced column index its parent's values: they are read
    relative to the slice's first."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    offsets = column.offsets.to_numpy()
    values = column.values[offsets[0]:offsets[-1]].to_numpy(zero_copy_only=False)
    if dtype is not None:
        values = values.astype(dtype, copy=False)
    offsets = offsets - offsets[0]
    bitmap = column.buffers()[0]  # read directly: `is_valid()` would import pyarrow.compute (~0.15 s)
    if bitmap is not None and column.null_count:
        bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
        valid = bits[column.offset:column.offset + len(column)].astype(bool)
    else:
        valid = np.ones(len(column), bool)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(column))]
