"""Selected samples out of DuckDB in the input shapes of distributed trainers (veRL, slime, TRL) or as our own
flat parquet (docs/export.md maps every column). Rows stream from DuckDB in Arrow record batches, so an export
holds one batch (slime: one output file) in memory, never the table."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from openforge.choices import ExportFormat
from openforge.samples import SchemaError, Selection, connect, first_line

BATCH_ROWS = 256  # rows per Arrow record batch fetched from DuckDB
SLIME_FILE_ROWS = 256  # samples per slime rollout file (whole groups: a file may hold more)

Row = dict[str, Any]
Progress = Callable[[int, int], None]


class ExportError(ValueError):
    """The export cannot be written as asked; the message says what to change."""


# A sample's images in sequence order, each with where its pad tokens sit and its bytes (stored once per image
# in DuckDB, repeated per sample in the export so each row stands alone).
IMAGES_SQL = """
    (SELECT list({'hash': i.hash, 'token_start': i.token_start, 'n_tokens': i.n_tokens, 'grid_t': i.grid_t,
                  'grid_h': i.grid_h, 'grid_w': i.grid_w, 'data': b.data} ORDER BY i.idx)
     FROM sample_images i JOIN images b USING (hash) WHERE i.sample_id = g.sample_id)"""


def selection_sql(selection: Selection, images: bool = False) -> str:
    """The selected samples in group order (their stored GRPO `group_id`, as reconstruct's advantages compared
    them). `images`: with each sample's images (`IMAGES_SQL`)."""
    image_columns = f", processor, {IMAGES_SQL} AS images" if images else ""
    return f"""
    SELECT sample_id, episode_id, run_id, task_id, role, toolchain, policy_version, token_source, tokenizer,
           vocab_size, n_tokens, n_trainable, n_calls, reward, advantage, weight, group_id,
           CAST(dense_rank() OVER (ORDER BY group_id) - 1 AS BIGINT) AS group_index,
           CAST(dense_rank() OVER (ORDER BY group_id, episode_id) - 1 AS BIGINT) AS episode_index,
           input_ids, loss_mask, behaviour_logprobs, n_images{image_columns}
    FROM samples g WHERE {selection.sql()} ORDER BY group_id, episode_id, sample_id
    """


def spans(mask: list[int]) -> tuple[list[int], list[int]]:
    """Where each run of trainable tokens starts and ends (end exclusive): the turn boundaries of a chain."""
    starts, ends = [], []
    for i, m in enumerate(mask):
        if m and (i == 0 or not mask[i - 1]):
            starts.append(i)
        if m and (i + 1 == len(mask) or not mask[i + 1]):
            ends.append(i + 1)
    return starts, ends


def split(row: Row) -> tuple[int, list[int], list[float] | None]:
    """The response start (first trainable token), the response's mask and its logprobs with 0.0 where the
    mask is 0, as veRL, slime and TRL pad tool and environment tokens."""
    mask = row["loss_mask"]
    start = mask.index(1)
    lps = row["behaviour_logprobs"]
    response_lps = None if lps is None else [lp if m else 0.0 for lp, m in zip(lps[start:], mask[start:])]
    return start, mask[start:], response_lps


def parquet_row(row: Row) -> Row:
    """Our own columns, flat; logprobs keep NaN where the mask is 0."""
    starts, ends = spans(row["loss_mask"])
    return {**{k: v for k, v in row.items() if k != "episode_index"}, "span_starts": starts, "span_ends": ends}


def verl_row(row: Row) -> Row:
    """One unpadded row of veRL's rollout batch (DataProto batch/non_tensor_batch keys, agent_loop.py)."""
    start, response_mask, lps = split(row)
    ids = row["input_ids"]
    n = len(ids) - start
    starts, ends = spans(row["loss_mask"])
    return {
        "uid": row["group_id"], "prompts": ids[:start], "responses": ids[start:], "input_ids": ids,
        "attention_mask": [1] * len(ids), "position_ids": list(range(len(ids))), "response_mask": response_mask,
        "rollout_log_probs": lps,
        "token_level_rewards": [0.0] * (n - 1) + [row["reward"]] if row["reward"] is not None else None,
        "advantages": None if row["advantage"] is None else [row["advantage"] * m for m in response_mask],
        "__num_turns__": len(starts), "span_starts": starts, "span_ends": ends,
        "sample_id": row["sample_id"], "episode_id": row["episode_id"], "reward": row["reward"],
        "advantage": row["advantage"], "weight": row["weight"], "policy_version": row["policy_version"],
    }


def trl_row(row: Row) -> Row:
    """SFTTrainer's pre-tokenized columns (input_ids, assistant_masks) and GRPOTrainer's rollout_func keys
    (prompt_ids, completion_ids, logprobs, env_mask) with its per-sequence advantages."""
    start, completion_mask, lps = split(row)
    ids = row["input_ids"]
    starts, ends = spans(row["loss_mask"])
    return {
        "input_ids": ids, "assistant_masks": row["loss_mask"], "prompt_ids": ids[:start],
        "completion_ids": ids[start:], "logprobs": lps, "env_mask": completion_mask,
        "advantages": row["advantage"], "reward": row["reward"], "group_id": row["group_id"],
        "span_starts": starts, "span_ends": ends, "sample_id": row["sample_id"], "episode_id": row["episode_id"],
        "weight": row["weight"], "policy_version": row["policy_version"],
    }


def slime_sample(row: Row, index: int) -> Row:
    """`slime.utils.types.Sample.to_dict()` of one sample: what Sample.from_dict reads back."""
    start, loss_mask, lps = split(row)
    starts, ends = spans(row["loss_mask"])
    return {
        "group_index": row["group_index"], "index": index, "rollout_id": row["episode_index"],
        "tokens": row["input_ids"], "response_length": len(loss_mask), "loss_mask": loss_mask,
        "rollout_log_probs": lps, "reward": row["reward"], "status": "completed",
        "metadata": {"advantage": row["advantage"], "weight": row["weight"], "group_id": row["group_id"],
                     "sample_id": row["sample_id"], "episode_id": row["episode_id"],
                     "policy_version": row["policy_version"], "span_starts": starts, "span_ends": ends},
    }


FLOATS = pa.list_(pa.float32())
IDS = pa.list_(pa.int32())
MASK = pa.list_(pa.uint8())
EXTRA = [("sample_id", pa.string()), ("episode_id", pa.string()), ("weight", pa.float64()),
         ("policy_version", pa.int64())]
SPANS = [("span_starts", IDS), ("span_ends", IDS)]
SCHEMAS = {
    "parquet": pa.schema([
        ("sample_id", pa.string()), ("episode_id", pa.string()), ("run_id", pa.string()), ("task_id", pa.string()),
        ("role", pa.string()), ("toolchain", pa.string()), ("policy_version", pa.int64()),
        ("token_source", pa.string()), ("tokenizer", pa.string()), ("vocab_size", pa.int32()),
        ("n_tokens", pa.int32()), ("n_trainable", pa.int32()), ("n_calls", pa.int32()), ("reward", pa.float64()),
        ("advantage", pa.float64()), ("weight", pa.float64()), ("group_id", pa.string()),
        ("group_index", pa.int64()), ("input_ids", IDS), ("loss_mask", MASK), ("behaviour_logprobs", FLOATS),
        *SPANS, ("n_images", pa.int32()), ("processor", pa.string()), ("images", pa.list_(pa.struct([
            ("hash", pa.string()), ("token_start", pa.int32()), ("n_tokens", pa.int32()), ("grid_t", pa.int32()),
            ("grid_h", pa.int32()), ("grid_w", pa.int32()), ("data", pa.binary())])))]),
    "verl": pa.schema([
        ("uid", pa.string()), ("prompts", IDS), ("responses", IDS), ("input_ids", IDS), ("attention_mask", MASK),
        ("position_ids", IDS), ("response_mask", MASK), ("rollout_log_probs", FLOATS),
        ("token_level_rewards", FLOATS), ("advantages", FLOATS), ("__num_turns__", pa.int32()), *SPANS,
        ("reward", pa.float64()), ("advantage", pa.float64()), *EXTRA]),
    "trl": pa.schema([
        ("input_ids", IDS), ("assistant_masks", MASK), ("prompt_ids", IDS), ("completion_ids", IDS),
        ("logprobs", FLOATS), ("env_mask", MASK), ("advantages", pa.float64()), ("reward", pa.float64()),
        ("group_id", pa.string()), *SPANS, *EXTRA]),
}
ROWS = {"parquet": parquet_row, "verl": verl_row, "trl": trl_row}


def open_selection(db: Path, where: str, fmt: str) -> tuple[duckdb.DuckDBPyConnection, str, int]:
    """A read-only connection, the selection's SQL and its row count; refuses what cannot be exported."""
    try:
        con = connect(db)
    except SchemaError as e:
        raise ExportError(str(e)) from None
    selection = Selection(where)
    try:
        sql = selection_sql(selection, images=fmt == ExportFormat.parquet)
        n, with_images = con.execute(f"SELECT count(*), count(*) FILTER (n_images > 0) FROM ({sql})").fetchall()[0]
    except duckdb.Error as e:
        con.close()
        raise ExportError(f"selection failed: {first_line(e)} (--where is SQL on the samples table)") from None
    if n == 0:
        con.close()
        raise ExportError(f"no samples selected ({selection.sql()})")
    if with_images and fmt != ExportFormat.parquet:  # their image pads without the pixels would train on nothing
        con.close()
        raise ExportError(f"{with_images} of the {n} selected samples have images, which the {fmt} format does "
                          "not carry: export them with --format parquet (images included), or leave them out "
                          "(--where 'n_images = 0')")
    return con, sql, n


def rows(con: duckdb.DuckDBPyConnection, sql: str) -> Iterator[list[Row]]:
    """The selection, one Arrow record batch at a time, as Python rows."""
    reader = con.sql(sql).to_arrow_reader(BATCH_ROWS)
    for batch in reader:
        yield batch.to_pylist()


def write_table(batches: Iterator[list[Row]], fmt: str, out: Path, progress: Progress, n: int) -> None:
    """One parquet file in the format's schema, a row group per batch."""
    convert, schema = ROWS[fmt], SCHEMAS[fmt]
    done = 0
    with pq.ParquetWriter(out, schema) as writer:
        for batch in batches:
            writer.write_table(pa.Table.from_pylist([convert(r) for r in batch], schema=schema))
            done += len(batch)
            progress(done, n)


def write_slime(batches: Iterator[list[Row]], out: Path, progress: Progress, n: int) -> None:
    """`OUT/{k}.pt` files of whole groups, each `{"rollout_id": k, "samples": [Sample.to_dict(), ...]}`: the
    dump slime's `--load-debug-rollout-data OUT/{rollout_id}.pt` reads (rollout_data_utils.py)."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    pending: list[Row] = []
    k = done = 0

    def flush() -> None:
        nonlocal k, pending
        torch.save({"rollout_id": k, "samples": pending}, out / f"{k}.pt")
        k, pending = k + 1, []

    for batch in batches:
        for row in batch:
            if len(pending) >= SLIME_FILE_ROWS and pending[-1]["group_index"] != row["group_index"]:
                flush()
            pending.append(slime_sample(row, done))
            done += 1
        progress(done, n)
    if pending:
        flush()


def slime_files(out: Path) -> list[Path]:
    """The `{k}.pt` files of a slime export in `out` (what `write_slime` writes, and nothing else)."""
    return [p for p in out.glob("*.pt") if p.stem.isdigit()] if out.is_dir() else []


def check_out(db: Path, fmt: str, out: Path, force: bool) -> None:
    """Refuse an `out` that is the database in any spelling (relative, `..`, a symlink or hard link) or, for
    slime, a directory holding it, with or without `force`; and an existing output without `force`."""
    db_real, out_real = db.resolve(), out.resolve()
    if out_real == db_real or (out.exists() and db.exists() and os.path.samefile(out, db)):
        raise ExportError(f"--out {out} is the database {db}: write the export to another path")
    if out_real == db_real.with_name(db_real.name + ".wal"):
        raise ExportError(f"--out {out} is the database's write-ahead log: write the export to another path")
    if fmt == ExportFormat.slime and db_real.is_relative_to(out_real):
        raise ExportError(f"--out {out} holds the database {db}, and slime writes {{k}}.pt files there: "
                          "write the export to another directory")
    existing = slime_files(out) if fmt == ExportFormat.slime else [out] if out.exists() or out.is_symlink() else []
    if existing and not force:
        slime = fmt == ExportFormat.slime
        what = f"{out} holds a slime export ({len(existing)} {{k}}.pt files)" if slime else f"{out} exists"
        raise ExportError(f"{what}: pass --force to overwrite it, or choose another --out")


def export(db: Path, fmt: str, out: Path, where: str = "", progress: Progress = lambda done, total: None,
           force: bool = False) -> int:
    """Write the selected samples (n_trainable > 0 and `where`) to `out` in `fmt`; returns the sample count.
    `force`: overwrite an existing output (slime: its `{k}.pt` files are removed first, so none of a former,
    larger export is read with this one); the database itself is never overwritten."""
    if fmt not in tuple(ExportFormat):
        raise ExportError(f"format must be one of {', '.join(ExportFormat)}, not {fmt!r}")
    check_out(db, fmt, out, force)
    con, sql, n = open_selection(db, where, fmt)
    try:
        target = out if fmt == ExportFormat.slime else out.parent
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ExportError(f"cannot write {out}: {e}") from None
        try:
            if fmt == ExportFormat.slime:
                for stale in slime_files(out):
                    stale.unlink()
                write_slime(rows(con, sql), out, progress, n)
            else:
                write_table(rows(con, sql), fmt, out, progress, n)
        except OSError as e:
            raise ExportError(f"cannot write {out}: {e}") from None
    finally:
        con.close()
    return n
