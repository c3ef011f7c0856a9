"""Samples from DuckDB, streamed in record batches and grouped into global batches by token count.

One pass ("epoch") reads `samples` in a deterministic order (a seeded hash of sample_id, or sample_id
itself; in tree mode a seeded hash of episode_id, then sample_id, so an episode's samples are read together),
so every rank sees the same global batches and a run resumes from (epoch, offset) exactly.
Only one global batch of rows is ever held in memory.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import pyarrow as pa

from openforge.choices import GroupFilter, Objective
from openforge.samples import SchemaError, Selection, connect, first_line, list_arrays

if TYPE_CHECKING:
    from openforge.trainer.config import TrainConfig

COLUMNS = ("sample_id, episode_id, input_ids, loss_mask, behaviour_logprobs, advantage, reward, weight, n_images, "
           "processor")
ARROW_ROWS = 256  # rows per Arrow record batch fetched from DuckDB


class DataError(ValueError):
    """The selected samples cannot be trained on as asked; the message says what to change."""


def trainable_sql(selection: Selection, drop_zero_advantage: bool = False, group_filter: str = "none",
                  seed: int = 0) -> str:
    """SQL on `samples`: the samples `selection` selects; without those whose advantage is 0
    (`drop_zero_advantage`: they add no gradient), and with `group_filter = "dynamic"` only in the groups
    `dynamic_groups` keeps."""
    base = selection.sql()
    out = base
    if drop_zero_advantage:
        out += " AND (advantage IS NULL OR advantage <> 0)"  # NULL stays selected: `check` names it
    if group_filter == "dynamic":
        out += f" AND group_id IN ({dynamic_groups(base, seed)})"
    return out


def dynamic_groups(base: str, seed: int) -> str:
    """SQL: the GRPO groups (`group_id`) the dynamic filter keeps among the samples `base` selects. Per group,
    over its episodes: pass rate = the share with a reward > 0; a group with no positive reward, or with an
    aborted episode (no reward), is dropped; any other is kept with probability min(1, 1 - pass rate), drawn
    from a hash of (group, seed): the same groups on every rank and on a resume."""
    episodes = (f"SELECT group_id AS g, episode_id, any_value(reward) AS reward FROM samples WHERE {base} "
                "GROUP BY ALL")
    draw = f"hash(g || ':{int(seed)}') / 18446744073709551616.0"  # hash() is a UBIGINT: uniform in [0, 1)
    return (f"SELECT g FROM ({episodes}) GROUP BY g HAVING count(*) FILTER (reward > 0) > 0 AND "
            f"count(*) FILTER (reward IS NULL) = 0 AND {draw} < 1 - avg(CASE WHEN reward > 0 THEN 1.0 ELSE 0.0 END)")


def training_filter(cfg: TrainConfig) -> tuple[bool, str]:
    """What the trainer under `cfg` drops of a selection: (drop_zero_advantage, group_filter); both only for
    the ppo objective."""
    ppo = cfg.objective == Objective.ppo
    return ppo and not cfg.keep_zero_advantage, cfg.group_filter if ppo else "none"


def nothing_to_learn(db: str | Path, selection: Selection, cfg: TrainConfig) -> str:
    """Why the trainer under `cfg` would select nothing of `selection`: no trainable sample, every group
    with equal rewards (advantage 0 everywhere), or the dynamic group filter keeping none; "" when there is
    something to learn."""
    drop_zero, group_filter = training_filter(cfg)
    try:
        con = connect(db)
    except SchemaError as e:
        raise DataError(str(e)) from None
    try:
        (selected,) = con.execute(
            f"SELECT count(*) FROM samples WHERE {trainable_sql(selection, drop_zero, group_filter, cfg.seed)}"
        ).fetchone() or (0,)
        groups, equal = con.execute(
            f"SELECT count(*), count(*) FILTER (NOT learns) FROM (SELECT group_id, coalesce(bool_or(advantage "
            f"<> 0), false) AS learns FROM samples WHERE {selection.sql()} GROUP BY group_id)").fetchone() or (0, 0)
    except duckdb.Error as e:
        raise DataError(f"selection failed: {first_line(e)}") from None
    finally:
        con.close()
    if selected:
        return ""
    if not groups:
        return "no trainable samples in this iteration's episodes"
    if equal == groups and drop_zero:
        return f"every group had equal rewards ({groups} group{'s' * (groups != 1)})"
    return f"group_filter = {cfg.group_filter} kept none of {groups} groups ({equal} with equal rewards)"


@dataclass
class SampleImage:
    """One image of a sample: input_ids[token_start : token_start + n_tokens] are its pad tokens."""

    hash: str                        # images.hash
    token_start: int
    n_tokens: int
    grid: tuple[int, int, int]       # (t, h, w) patches, as recorded by reconstruct
    pixels: np.ndarray | None = None  # float32 [t * h * w, patch values], set by `vision.attach_pixels`


@dataclass
class Sample:
    sample_id: str
    episode_id: str
    input_ids: np.ndarray            # int64 [n]
    loss_mask: np.ndarray            # bool [n]; loss_mask[0] is always False (nothing predicts it)
    behaviour_logprobs: np.ndarray | None  # float32 [n] or None when the engine gave none
    advantage: float
    reward: float | None
    weight: float                    # 1 / n_samples of the episode
    processor: str | None = None     # the image processor's settings (JSON) the grids were computed with
    images: list[SampleImage] = field(default_factory=list)  # in sequence order

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class Position:
    """Where the next global batch starts: samples already consumed in this epoch's order."""

    epoch: int = 0
    offset: int = 0


class SampleSource:
    """The selected samples of one DuckDB file (read-only: several ranks may open it at once)."""

    def __init__(self, db: str, where: str | Selection = "", shuffle: bool = True, seed: int = 0, tree: bool = False,
                 drop_zero_advantage: bool = False, group_filter: str = "none") -> None:
        """`where`: SQL on `samples` (`--where`), or a `Selection`."""
        try:
            self.con = connect(db)
        except SchemaError as e:
            raise DataError(str(e)) from None
        selection = where if isinstance(where, Selection) else Selection(where)
        self.filter = trainable_sql(selection, drop_zero_advantage, group_filter, seed)
        left_out = [(drop_zero_advantage, "samples whose advantage is 0 (every group with equal rewards; "
                                          "keep_zero_advantage = true keeps them)"),
                    (group_filter != GroupFilter.none, f"the groups group_filter = {group_filter} drops")]
        self.left_out = [why for on, why in left_out if on]
        self.shuffle, self.seed, self.tree = shuffle, seed, tree
        try:  # binds the filter (columns, types) without reading a row
            self.con.execute(f"SELECT sample_id FROM samples WHERE {self.filter} LIMIT 0")
        except duckdb.Error as e:
            self.con.close()
            raise DataError(f"selection failed: {first_line(e)} (--where is SQL on the samples table: "
                            f"{selection.where!r})") from None
        self.side = self.con.cursor()  # images are read while `samples` streams from the main connection

    def __enter__(self) -> SampleSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the database (a forked or later process may then open it afresh)."""
        self.side.close()
        self.con.close()

    def _order(self, epoch: int) -> str:
        if self.tree:  # episodes together: a global batch holds whole trees where the token budget allows
            return f"hash(episode_id || ':{self.seed}:{epoch}'), episode_id, sample_id" if self.shuffle \
                else "episode_id, sample_id"
        if not self.shuffle:
            return "sample_id"
        return f"hash(sample_id || ':{self.seed}:{epoch}'), sample_id"

    def scalar(self, sql: str) -> tuple:
        return self.rows(sql)[0]

    def rows(self, sql: str) -> list[tuple]:
        try:
            return self.con.execute(sql).fetchall()  # fetchall completes the result: the connection is free
        except duckdb.Error as e:
            raise DataError(f"selection failed: {first_line(e)} (--where is SQL on the samples table)") from None

    def check(self, row_tokens: int, vocab_rows: int, needs_logprobs: bool, needs_advantage: bool,
              needs_weight: bool) -> int:
        """Refuse, before step 1 and naming samples, every selection the run could not train on to the end
        (or would train into non-finite weights); returns the sample count."""
        (n,) = self.scalar(f"SELECT count(*) FROM samples WHERE {self.filter}")
        if n == 0:
            (total,) = self.scalar("SELECT count(*) FROM samples")
            left_out = f" Left out: {'; '.join(self.left_out)}." if self.left_out else ""
            raise DataError(
                f"no samples selected (filter: {self.filter}); the table holds {total} samples.{left_out} "
                "Check --where, or run `openforge reconstruct` first."
            )
        too_long, longest = self.scalar(
            f"SELECT count(*) FILTER (n_tokens > {row_tokens}), max(n_tokens) FROM samples WHERE {self.filter}"
        )
        if too_long:
            raise DataError(
                f"{too_long} of {n} selected samples are longer than row_tokens={row_tokens} "
                f"(longest: {longest} tokens). Raise row_tokens (--set row_tokens={longest}) or leave them out "
                f"(--where 'n_tokens <= {row_tokens}')."
            )
        rebuild = "Re-run `openforge reconstruct`, or leave them out with --where."
        checks = [  # (SQL condition a sample must not meet, what is wrong with it, what to do)
            ("len(loss_mask) <> len(input_ids) OR len(behaviour_logprobs) <> len(input_ids) "
             "OR n_tokens <> len(input_ids)",
             "have input_ids, loss_mask, behaviour_logprobs or n_tokens of different lengths", rebuild),
            (f"list_min(input_ids) < 0 OR list_max(input_ids) >= {vocab_rows}",
             f"have token ids outside the model's embedding (0..{vocab_rows - 1})", rebuild),
            ("NOT coalesce(list_bool_or(list_transform(loss_mask[2:], lambda m: m <> 0)), false)",
             "have no trainable token after the first (nothing predicts the first token)", rebuild),
            ("behaviour_logprobs IS NOT NULL AND coalesce(list_bool_or(list_transform(list_zip(loss_mask, "
             "behaviour_logprobs)[2:], lambda t: t[1] <> 0 AND NOT isfinite(t[2]))), false)",
             "have non-finite behaviour_logprobs on trainable tokens", rebuild),
            ("behaviour_logprobs IS NOT NULL AND coalesce(list_bool_or(list_transform(list_zip(loss_mask, "
             "behaviour_logprobs)[2:], lambda t: t[1] <> 0 AND t[2] > 0)), false)",
             "have behaviour_logprobs > 0 on trainable tokens (a probability above 1: no engine samples that)",
             rebuild),
        ]
        if needs_advantage:
            checks += [
                ("advantage IS NULL", "have no advantage (the ppo objective needs a reward/advantage per sample)",
                 "Leave them out (--where 'advantage IS NOT NULL') or use --objective sft."),
                ("NOT isfinite(advantage)", "have a non-finite advantage (a NaN or infinite reward?)",
                 "Fix the rewards and re-run `openforge reconstruct`, or leave them out with --where."),
            ]
        if needs_weight:
            checks.append(("NOT isfinite(weight) OR weight <= 0", "have a weight that is not a positive number",
                           rebuild))
        if needs_logprobs:
            checks.append(("behaviour_logprobs IS NULL",
                           "have no behaviour_logprobs (old_policy = engine uses them as the old policy)",
                           "Use old_policy = recompute (the default), leave them out "
                           "(--where 'behaviour_logprobs IS NOT NULL') or use --objective sft."))
        counts = self.scalar(  # one pass over the selection for all checks
            "SELECT " + ", ".join(f"count(*) FILTER ({c})" for c, _, _ in checks) + f" FROM samples WHERE {self.filter}"
        )
        for (condition, problem, fix), count in zip(checks, counts):
            if count:
                ids = [r[0] for r in self.con.execute(
                    f"SELECT sample_id FROM samples WHERE {self.filter} AND ({condition}) ORDER BY sample_id LIMIT 5"
                ).fetchall()]
                raise DataError(f"{count} of {n} selected samples {problem}: {', '.join(ids)}"
                                f"{' ...' if count > 5 else ''}. {fix}")
        return n

    def check_images(self, image_token_id: int | None, tree: bool) -> int:
        """Refuse, before step 1 and naming samples, image records that disagree with the tokens (the vision
        tower's output would land on other tokens, or not fit); returns how many selected samples have images.

        `image_token_id`: the model's image pad token, None for a text-only model. The processed grids are
        checked against the image bytes by `vision.check_pixels`."""
        (n,) = self.scalar(f"SELECT count(*) FILTER (n_images > 0) FROM samples WHERE {self.filter}")
        leave_out = "(--where 'n_images = 0')"
        if n and image_token_id is None:
            raise DataError(f"{n} selected samples have images but the model has no vision tower. Train a "
                            f"vision-language model, or leave them out {leave_out}.")
        if n and tree:
            raise DataError(f"{n} selected samples have images: tree mode does not train images yet. Train "
                            f"without --tree, or leave them out {leave_out}.")
        if image_token_id is None:
            return 0
        pad = int(image_token_id)
        rebuild = "Re-run `openforge reconstruct`, or leave them out with --where."
        per_image = {  # (SQL condition on one sample_images row joined with its sample, what is wrong)
            "i.hash NOT IN (SELECT hash FROM images)": "refer to images missing from the images table",
            "i.token_start < 0 OR i.n_tokens < 1 OR i.token_start + i.n_tokens > len(s.input_ids)":
                "have an image whose tokens lie outside input_ids",
            "s.merge IS NULL OR i.n_tokens * s.merge * s.merge <> i.grid_t * i.grid_h * i.grid_w":
                "have an image whose n_tokens is not grid_t * grid_h * grid_w / merge_size^2 (merge_size of "
                "their processor settings)",
            f"list_bool_or(list_transform(s.input_ids[i.token_start + 1:i.token_start + i.n_tokens], "
            f"lambda t: t <> {pad}))": f"have image positions holding other tokens than the image pad ({pad})",
        }
        per_sample = {
            "s.n_images > 0 AND s.processor IS NULL": "have images but no processor settings",
            "s.n_images <> coalesce(i.n, 0)": "have n_images different from their rows in sample_images",
            f"len(list_filter(s.input_ids, lambda t: t = {pad})) <> coalesce(i.pads, 0)":
                f"have image pad tokens ({pad}) that are not exactly their images' tokens",
        }
        selected = (f"SELECT sample_id, input_ids, n_images, processor, TRY_CAST(json_extract(processor, "
                    f"'$.merge_size') AS INTEGER) AS merge FROM samples WHERE {self.filter}")
        queries = [(f"SELECT DISTINCT s.sample_id FROM ({selected}) s JOIN sample_images i USING (sample_id) "
                    f"WHERE coalesce({c}, false)", problem) for c, problem in per_image.items()]
        queries += [(f"SELECT s.sample_id FROM ({selected}) s LEFT JOIN (SELECT sample_id, count(*) AS n, "
                     f"sum(n_tokens) AS pads FROM sample_images GROUP BY sample_id) i USING (sample_id) WHERE {c}",
                     problem) for c, problem in per_sample.items()]
        for query, problem in queries:
            ids = [r[0] for r in self.rows(f"{query} ORDER BY 1")]
            if ids:
                raise DataError(f"{len(ids)} selected samples {problem}: {', '.join(ids[:5])}"
                                f"{' ...' if len(ids) > 5 else ''}. {rebuild}")
        return n

    def vocab_sizes(self) -> list[tuple[int, str]]:
        return self.con.execute(
            f"SELECT DISTINCT vocab_size, tokenizer FROM samples WHERE {self.filter} ORDER BY 1"
        ).fetchall()

    def lengths(self, epoch: int) -> Iterator[int]:
        """Sample lengths in epoch order: enough to count steps without reading tokens."""
        reader = self.con.sql(
            f"SELECT n_tokens FROM samples WHERE {self.filter} ORDER BY {self._order(epoch)}"
        ).to_arrow_reader(ARROW_ROWS * 16)
        for batch in reader:
            yield from batch.column(0).to_numpy().tolist()

    def samples(self, epoch: int, offset: int = 0) -> Iterator[Sample]:
        """Full samples in epoch order from `offset`, one Arrow record batch at a time."""
        reader = self.con.sql(
            f"SELECT {COLUMNS} FROM samples WHERE {self.filter} "
            f"ORDER BY {self._order(epoch)} OFFSET {int(offset)}"
        ).to_arrow_reader(ARROW_ROWS)
        for batch in reader:
            samples = list(_to_samples(batch))
            with_images = batch.column("n_images").to_numpy(zero_copy_only=False) > 0
            self._add_images([s for s, has in zip(samples, with_images) if has])
            yield from samples

    def _add_images(self, samples: list[Sample]) -> None:
        """The image records (not the bytes) of samples with images, one query per record batch."""
        by_id = {s.sample_id: s for s in samples}
        if not by_id:
            return
        rows = self.side.execute(
            "SELECT sample_id, hash, token_start, n_tokens, grid_t, grid_h, grid_w FROM sample_images "
            "WHERE sample_id IN (SELECT unnest(?)) ORDER BY sample_id, token_start", [list(by_id)]
        ).fetchall()
        for sid, digest, start, n, t, h, w in rows:
            by_id[sid].images.append(SampleImage(digest, start, n, (t, h, w)))

    def image_bytes(self, hashes: list[str]) -> dict[str, bytes]:
        """The stored bytes of these images (only those a batch needs are ever read)."""
        return dict(self.side.execute(
            "SELECT hash, data FROM images WHERE hash IN (SELECT unnest(?))", [hashes]).fetchall())

    def batches(self, step_tokens: int, start: Position, epochs: int
                ) -> Generator[tuple[list[Sample], Position], None, None]:
        """Global batches of at most `step_tokens` tokens, each with the position after it."""
        for epoch in range(start.epoch, epochs):
            offset = start.offset if epoch == start.epoch else 0
            batch: list[Sample] = []
            tokens = 0
            for sample in self.samples(epoch, offset):
                if batch and tokens + len(sample) > step_tokens:
                    yield batch, Position(epoch, offset)
                    batch, tokens = [], 0
                batch.append(sample)
                tokens += len(sample)
                offset += 1
            if batch:
                yield batch, Position(epoch, offset)


def count_steps(lengths: Iterator[int], step_tokens: int) -> int:
    """How many global batches `SampleSource.batches` makes from these lengths (same greedy rule)."""
    steps, tokens = 0, 0
    for n in lengths:
        if tokens and tokens + n > step_tokens:
            steps, tokens = steps + 1, 0
        tokens += n
    return steps + (1 if tokens else 0)


def _to_samples(batch: pa.RecordBatch) -> Iterator[Sample]:
    cols = {name: batch.column(i) for i, name in enumerate(batch.schema.names)}
    ids = list_arrays(cols["input_ids"], np.int64)
    masks = list_arrays(cols["loss_mask"], np.uint8)
    logprobs = list_arrays(cols["behaviour_logprobs"], np.float32)
    sample_ids = cols["sample_id"].to_pylist()
    episode_ids = cols["episode_id"].to_pylist()
    advantages = cols["advantage"].to_pylist()
    rewards = cols["reward"].to_pylist()
    weights = cols["weight"].to_pylist()
    processors = cols["processor"].to_pylist()
    for i, sid in enumerate(sample_ids):
        input_ids, stored_mask = ids[i], masks[i]
        if input_ids is None or stored_mask is None:  # NOT NULL in the schema: a database written by hand
            raise DataError(f"sample {sid} has no input_ids or loss_mask. Re-run `openforge reconstruct`.")
        mask = stored_mask.astype(bool)
        mask[0] = False  # the first token has no prediction; in a packed row it would see the previous sample
        yield Sample(sid, episode_ids[i], input_ids, mask, logprobs[i],
                     advantages[i] if advantages[i] is not None else 0.0, rewards[i], weights[i], processors[i])
