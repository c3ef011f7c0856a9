"""The DuckDB contract's writer: apply the versioned schema, migrate older versions, bulk-insert Arrow
batches. `openforge/samples.py` is its reader."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from openforge.reconstruct.rewards import group_ids_sql
from openforge.samples import REBUILD, SCHEMA_VERSION

if TYPE_CHECKING:
    import duckdb


def schema_sql() -> str:
    return resources.files("openforge.reconstruct").joinpath("schema.sql").read_text()


def _create_table(table: str) -> str:
    """schema.sql's `CREATE TABLE IF NOT EXISTS` statement of `table` (a migration that adds it runs the same)."""
    match = re.search(rf"^CREATE TABLE IF NOT EXISTS {table} \(.*?^\);", schema_sql(), re.M | re.S)
    if match is None:
        raise LookupError(f"schema.sql creates no table {table}")
    return match.group(0)


# statements that bring a database of the previous version to the next one
MIGRATIONS = {
    # role-aware samples: every episode is rebuilt by the next run (samples of other roles stop being trainable)
    "2": [
        "ALTER TABLE calls ADD COLUMN IF NOT EXISTS engine_model VARCHAR",
        "ALTER TABLE calls ADD COLUMN IF NOT EXISTS prompt_check VARCHAR",
        "ALTER TABLE samples ADD COLUMN IF NOT EXISTS role VARCHAR",
        "ALTER TABLE samples ADD COLUMN IF NOT EXISTS toolchain VARCHAR",
        "ALTER TABLE rewards ADD COLUMN IF NOT EXISTS policy VARCHAR",
        "DELETE FROM episodes",
        "UPDATE meta SET value = '3' WHERE key = 'schema_version'",
    ],
    # columns and tables nothing writes: conversations live in call_messages, calls with images are skipped
    "3": [
        "ALTER TABLE call_tokens DROP COLUMN IF EXISTS tools",
        "DROP TABLE IF EXISTS call_images",
        "DROP TABLE IF EXISTS images",
        "UPDATE meta SET value = '4' WHERE key = 'schema_version'",
    ],
    # the policy version of each call and sample: NULL for the rows already stored (their records are not
    # read again); the next run's calls, and the samples it rebuilds, carry it
    "4": [
        "ALTER TABLE calls ADD COLUMN IF NOT EXISTS policy_version BIGINT",
        "ALTER TABLE samples ADD COLUMN IF NOT EXISTS policy_version BIGINT",
        "UPDATE meta SET value = '5' WHERE key = 'schema_version'",
    ],
    # vision-language samples: every stored sample has no image (calls with images were skipped)
    "5": [
        "ALTER TABLE samples ADD COLUMN IF NOT EXISTS n_images INTEGER DEFAULT 0",
        "ALTER TABLE samples ADD COLUMN IF NOT EXISTS processor JSON",
        *(_create_table(t) for t in ("images", "sample_images", "call_images")),
        "UPDATE meta SET value = '6' WHERE key = 'schema_version'",
    ],
    # each episode's GRPO group stored once (advantages, the trainer's group filter and export read it),
    # computed as the last run's advantages grouped them (meta.group_by)
    "6": [
        "ALTER TABLE episodes ADD COLUMN IF NOT EXISTS group_id VARCHAR",
        "ALTER TABLE samples ADD COLUMN IF NOT EXISTS group_id VARCHAR",
        group_ids_sql(),
        "UPDATE samples SET group_id = e.group_id FROM episodes e WHERE samples.episode_id = e.episode_id",
        "UPDATE meta SET value = '7' WHERE key = 'schema_version'",
    ],
}
# A database whose rows a migration would lose: (query counting them, what they are) per version.
UNMIGRATABLE = {
    "3": ("SELECT (SELECT count(*) FROM call_tokens WHERE tools IS NOT NULL) + (SELECT count(*) FROM images)",
          "per-call conversations or images, written by a reconstruct older than schema 3"),
}
# A buffer is flushed once it holds this many rows or cells (numeric list elements, or 4 bytes of an image:
# ~4 MB, whatever the prompt length or image size): memory stays flat on any corpus.
FLUSH_EVERY = 256
FLUSH_CELLS = 1_000_000

_I32_LIST = pa.list_(pa.int32())
_U8_LIST = pa.list_(pa.uint8())
_F32_LIST = pa.list_(pa.float32())
_STR_LIST = pa.list_(pa.string())

# Arrow types of the columns that are not plain scalars, and of the scalars a record sets (checked by
# `Buffer.add`, so one wrong-typed value skips its record instead of failing a batch); others are inferred.
COLUMN_TYPES: dict[str, pa.DataType] = {
    "input_ids": _I32_LIST,
    "loss_mask": _U8_LIST,
    "behaviour_logprobs": _F32_LIST,
    "prompt_ids": _I32_LIST,
    "completion_ids": _I32_LIST,
    "completion_logprobs": _F32_LIST,
    "conv_hashes": _STR_LIST,
    "strict_hashes": _STR_LIST,
    "status": pa.int32(),
    "prompt_tokens": pa.int32(),
    "completion_tokens": pa.int32(),
    "reward": pa.float64(),
    "advantage": pa.float64(),
    "t_start": pa.float64(),
    "t_first_byte": pa.float64(),
    "t_end": pa.float64(),
    "seq": pa.int64(),
    "policy_version": pa.int64(),
    "record_id": pa.string(),
    "detail": pa.string(),
    "role": pa.string(),
    "toolchain": pa.string(),
    "model": pa.string(),
    "engine_model": pa.string(),
    "finish_reason": pa.string(),
    "task_id": pa.string(),
    "data": pa.binary(),
    "mime": pa.string(),
    "width": pa.int32(),
    "height": pa.int32(),
    "idx": pa.int32(),
    "token_start": pa.int32(),
    "n_tokens": pa.int32(),
    "grid_t": pa.int32(),
    "grid_h": pa.int32(),
    "grid_w": pa.int32(),
    "n_images": pa.int32(),
}


def _kind(typ: pa.DataType) -> str | int | None:
    """What `check` tests a column's values for: text, bytes, float, an int's bits, or nothing (lists)."""
    if pa.types.is_list(typ):
        return None
    if pa.types.is_string(typ):
        return "text"
    if pa.types.is_binary(typ):
        return "bytes"
    if pa.types.is_floating(typ):
        return "float"
    return typ.bit_width


_KINDS = {c: _kind(t) for c, t in COLUMN_TYPES.items()}


def connect(db: str | Path) -> duckdb.DuckDBPyConnection:
    """Open (creating if needed) a database, apply the schema, migrate an older version; refuse any other
    version (a newer one, or one too old to migrate) with a sentence that says to rebuild it."""
    import duckdb

    con = duckdb.connect(str(db))
    con.execute(schema_sql())
    version = _version(con)
    while version in MIGRATIONS:
        if version in UNMIGRATABLE:
            query, what = UNMIGRATABLE[version]
            if _count(con, query):
                con.close()
                raise ValueError(f"{db}: schema version {version} holding {what}: {REBUILD}")
        con.begin()
        for statement in MIGRATIONS[version]:
            con.execute(statement)
        con.commit()
        version = _version(con)
    if version != SCHEMA_VERSION:
        con.close()
        raise ValueError(f"{db}: schema version {version}; this reconstruct writes {SCHEMA_VERSION} and migrates from "
                         f"{', '.join(MIGRATIONS)}: {REBUILD}")
    return con


def _version(con: duckdb.DuckDBPyConnection) -> str:
    row = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return str(row[0]) if row else ""


def _count(con: duckdb.DuckDBPyConnection, query: str) -> int:
    row = con.execute(query).fetchone()
    return int(row[0]) if row else 0


def record_rl_iteration(con: duckdb.DuckDBPyConnection, iteration: int,
                        episodes: list[tuple[str, str | None, str | None, int | None, str, float | None]],
                        mismatches: list[tuple[str, float | None, float | None]]) -> None:
    """Replace an RL iteration's rows in one transaction: `episodes` (episode_id, task_id, toolchain, attempt,
    status, reward) into `rl_episodes`, and those whose stored reward is not the one they posted
    (episode_id, result reward, stored reward) into `rl_reward_mismatches`."""
    con.begin()
    try:
        con.execute("DELETE FROM rl_episodes WHERE iteration = ?", [iteration])
        con.execute("DELETE FROM rl_reward_mismatches WHERE iteration = ?", [iteration])
        if episodes:  # executemany refuses an empty list
            con.executemany("INSERT INTO rl_episodes VALUES (?, ?, ?, ?, ?, ?, ?)", [(iteration, *e) for e in episodes])
        if mismatches:
            con.executemany("INSERT INTO rl_reward_mismatches VALUES (?, ?, ?, ?)",
                            [(iteration, *m) for m in mismatches])
        con.commit()
    except BaseException:
        con.rollback()
        raise


def numeric_list_array(values: list[np.ndarray | None], typ: pa.ListType) -> pa.Array:
    """numpy arrays (None = NULL) as one Arrow list column: one concatenation, no per-element Python work."""
    dtype = typ.value_type.to_pandas_dtype()
    present = [v for v in values if v is not None]
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum([0 if v is None else len(v) for v in values], out=offsets[1:])
    flat = np.concatenate(present).astype(dtype, copy=False) if present else np.zeros(0, dtype)
    mask = pa.array([v is None for v in values]) if len(present) < len(values) else None
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat), type=typ, mask=mask)


def _column(values: list[Any], typ: pa.DataType | None) -> pa.Array:
    if typ is not None and pa.types.is_list(typ) and typ.value_type != pa.string():
        return numeric_list_array([None if v is None else np.asarray(v) for v in values], typ)
    return pa.array(values, type=typ)


class BadValue(ValueError):
    """A value that does not fit its column's type."""


def check(column: str, value: Any) -> Any:
    """`value` as its column stores it (an int as a float for a DOUBLE), or BadValue.

    Python-side on purpose: a value DuckDB refuses inside a transaction aborts the whole transaction.
    """
    kind = _KINDS.get(column)
    if value is None or kind is None:
        return value
    if kind == "text":
        ok = isinstance(value, str) and (value.isascii() or _utf8(value))
    elif kind == "bytes":
        ok = isinstance(value, bytes)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _fits_double(value)
        value = float(value) if ok else value
    else:
        half = 1 << (int(kind) - 1)  # an int column's bit width
        ok = isinstance(value, int) and not isinstance(value, bool) and -half <= value < half
    if not ok:
        raise BadValue(f"{column}: {type(value).__name__} {str(value)[:60]!r} does not fit {COLUMN_TYPES[column]}")
    return value


def _utf8(text: str) -> bool:
    """False for a lone surrogate (JSON's "\\ud800" escape decodes to one), which Arrow cannot store."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _fits_double(value: int | float) -> bool:
    """NaN and infinities are stored as they are; an int beyond the double range is not."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def _cells(value: Any) -> int:
    """What a value counts towards a buffer's volume: its elements for a numeric list, a cell per 4 bytes
    (an id's size) for bytes (an image), else nothing."""
    if isinstance(value, np.ndarray):
        return len(value)
    return len(value) // 4 if isinstance(value, bytes) else 0


class Buffer:
    """Rows for one table, flushed as a single Arrow batch (`INSERT ... SELECT` from the batch).

    `cells` counts the numeric list elements (and bytes, 4 to a cell) held, so callers can flush by volume
    (bounded memory whatever the prompt length or image size), not only by row count. Rows whose values
    Arrow cannot convert are left out of the batch and kept in `rejected` with the error, for the caller
    to report.
    """

    def __init__(
        self, con: Any, table: str, columns: list[str], ignore_conflicts: bool = False, key: str | None = None
    ) -> None:
        """`key`: the primary key column of an `ignore_conflicts` table. Rows whose key is already stored
        (or already in the batch) are dropped by an anti-join, which DuckDB runs several times faster
        than `INSERT OR IGNORE` on wide rows with long lists."""
        self.con, self.table, self.columns = con, table, columns
        self.ignore, self.key = ignore_conflicts, key
        self.rows: dict[str, list[Any]] = {c: [] for c in columns}
        self.keys: set[Any] = set()
        self.n = 0
        self.cells = 0
        self.rejected: list[tuple[dict[str, Any], str]] = []

    def add(self, **row: Any) -> None:
        """Buffer one row; BadValue (nothing buffered) when a value does not fit its column."""
        values = {c: check(c, row.get(c)) for c in self.columns}
        if self.key is not None:
            if values[self.key] in self.keys:
                return
            self.keys.add(values[self.key])
        for c, v in values.items():
            self.rows[c].append(v)
            self.cells += _cells(v)
        self.n += 1

    def truncate(self, n: int) -> None:
        """Drop the rows after the first `n` (those of a record that failed half-way)."""
        for c, values in self.rows.items():
            for v in values[n:]:
                self.cells -= _cells(v)
            if self.key is not None and c == self.key:
                self.keys.difference_update(values[n:])
            del values[n:]
        self.n = min(self.n, n)

    def flush(self) -> int:
        """Insert the buffered rows; returns how many were sent (rejected rows not counted)."""
        if not self.n:
            return 0
        try:
            batch = self._batch(self.rows)
        except Exception:  # noqa: BLE001 - find the rows Arrow refuses, one by one, and send the others
            good = [i for i in range(self.n) if self._convertible(i)]
            batch = self._batch({c: [v[i] for i in good] for c, v in self.rows.items()}) if good else None
        n = 0 if batch is None else batch.num_rows
        if n:
            self._insert(batch)
        self.n, self.cells = 0, 0
        self.keys = set()
        self.rows = {c: [] for c in self.columns}
        return n

    def _batch(self, rows: dict[str, list[Any]]) -> pa.Table:
        return pa.table({c: _column(v, COLUMN_TYPES.get(c)) for c, v in rows.items()})

    def _convertible(self, i: int) -> bool:
        row = {c: v[i] for c, v in self.rows.items()}
        try:
            self._batch({c: [v] for c, v in row.items()})
            return True
        except Exception as e:  # noqa: BLE001 - Arrow raises several classes (ArrowInvalid, TypeError, UnicodeError)
            self.rejected.append((row, f"{self.table}: {type(e).__name__}: {str(e)[:200]}"))
            return False

    def _insert(self, batch: pa.Table) -> None:
        self.con.register("_openforge_batch", batch)
        try:
            cols = ", ".join(self.columns)
            if self.ignore and self.key is not None:
                self.con.execute(
                    f"INSERT INTO {self.table} ({cols}) SELECT {cols} FROM _openforge_batch "
                    f"WHERE {self.key} NOT IN (SELECT {self.key} FROM {self.table})"
                )
            else:
                verb = "INSERT OR IGNORE" if self.ignore else "INSERT"
                self.con.execute(f"{verb} INTO {self.table} ({cols}) SELECT {cols} FROM _openforge_batch")
        finally:
            self.con.unregister("_openforge_batch")
