"""DuckDB side: apply the versioned schema, bulk-insert Arrow batches, remember ingested files."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

SCHEMA_VERSION = "3"
# statements that bring a database of the previous version to the next one
MIGRATIONS = {
    "1": [
        "ALTER TABLE call_tokens ADD COLUMN IF NOT EXISTS prefix_call_id VARCHAR",
        "ALTER TABLE call_tokens ADD COLUMN IF NOT EXISTS prefix_len INTEGER",
        "UPDATE meta SET value = '2' WHERE key = 'schema_version'",
    ],
    # role-aware samples: every episode is rebuilt by the next run (samples of other roles stop being trainable)
    "2": [
        "ALTER TABLE calls ADD COLUMN IF NOT EXISTS engine_model VARCHAR",
        "ALTER TABLE calls ADD COLUMN IF NOT EXISTS prompt_check VARCHAR",
        "ALTER TABLE samples ADD COLUMN IF NOT EXISTS role VARCHAR",
        "ALTER TABLE samples ADD COLUMN IF NOT EXISTS toolchain VARCHAR",
        "DELETE FROM episodes",
        "UPDATE meta SET value = '3' WHERE key = 'schema_version'",
    ],
}

_I32_LIST = pa.list_(pa.int32())
_U8_LIST = pa.list_(pa.uint8())
_F32_LIST = pa.list_(pa.float32())
_STR_LIST = pa.list_(pa.string())

# Arrow types for the columns that are not plain scalars (scalars are inferred).
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
}


def schema_sql() -> str:
    return resources.files("reconstruct").joinpath("schema.sql").read_text()


def connect(db: str | Path) -> Any:
    """Open (creating if needed) a database, apply the schema, migrate an older version; refuse a newer one."""
    import duckdb

    con = duckdb.connect(str(db))
    con.execute(schema_sql())
    version = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    while version in MIGRATIONS:
        con.begin()
        for statement in MIGRATIONS[version]:
            con.execute(statement)
        con.commit()
        version = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    if version != SCHEMA_VERSION:
        con.close()
        raise ValueError(f"{db}: schema version {version}, this reconstruct writes {SCHEMA_VERSION}")
    return con


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


class Buffer:
    """Rows for one table, flushed as a single Arrow batch (`INSERT ... SELECT` from the batch).

    `cells` counts the numeric list elements held, so callers can flush by volume (bounded memory
    whatever the prompt length), not only by row count.
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

    def add(self, **row: Any) -> None:
        if self.key is not None:
            if row.get(self.key) in self.keys:
                return
            self.keys.add(row.get(self.key))
        for c in self.columns:
            v = row.get(c)
            self.rows[c].append(v)
            if isinstance(v, np.ndarray):
                self.cells += len(v)
        self.n += 1

    def flush(self) -> int:
        if not self.n:
            return 0
        arrays = {c: _column(v, COLUMN_TYPES.get(c)) for c, v in self.rows.items()}
        self.con.register("_openforge_batch", pa.table(arrays))
        cols = ", ".join(self.columns)
        if self.ignore and self.key is not None:
            self.con.execute(
                f"INSERT INTO {self.table} ({cols}) SELECT {cols} FROM _openforge_batch "
                f"WHERE {self.key} NOT IN (SELECT {self.key} FROM {self.table})"
            )
        else:
            verb = "INSERT OR IGNORE" if self.ignore else "INSERT"
            self.con.execute(f"{verb} INTO {self.table} ({cols}) SELECT {cols} FROM _openforge_batch")
        self.con.unregister("_openforge_batch")
        n, self.n, self.cells = self.n, 0, 0
        self.keys = set()
        self.rows = {c: [] for c in self.columns}
        return n
