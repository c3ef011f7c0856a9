"""Pass 1 of a run: flow files (ours or mitmproxy's) -> `calls`, `call_tokens`, `rewards`, `skipped`.

Each new (or grown) file is read once, streaming: each exchange becomes a call with token ids, each reward
record a reward, anything unusable a `skipped` row with its reason. A transaction per batch of calls keeps
memory flat, and a run that dies mid-file resumes after the last batch it committed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import numpy as np
import pyarrow as pa

from openforge.addons.flowfile import (
    ExchangeRecord,
    NotAFlowFile,
    RewardRecord,
    UnsupportedVersion,
    header_id,
    open_flow_file,
    read_header,
)
from openforge.reconstruct import store
from openforge.reconstruct.answer_json import RawIds
from openforge.reconstruct.calls import Call, Skip, parse_choices
from openforge.reconstruct.episodes import ChainHasher, Linker
from openforge.reconstruct.mitm_flows import MitmFile, is_mitm_file
from openforge.reconstruct.prefixes import PrefixSplitter, int32
from openforge.reconstruct.rewards import BadReward, check_reward
from openforge.reconstruct.summary import Summary
from openforge.reconstruct.tokenize import Retokenizer
from openforge.reconstruct.vision import Grid, Vision

if TYPE_CHECKING:
    import duckdb

DEFAULT_ROLE = "agent"  # the proxy's default role; a call recorded without one counts as it

CALL_COLUMNS = [
    "call_id", "file_id", "episode_id", "run_id", "role", "toolchain", "protocol", "model", "engine_model",
    "streamed", "status", "t_start", "t_first_byte", "t_end", "prompt_tokens", "completion_tokens",
    "finish_reason", "token_source", "prompt_check", "policy_version",
]
TOKEN_COLUMNS = [
    "call_id", "episode_id", "linked_by", "t_start", "seq", "token_source", "prompt_ids", "completion_ids",
    "completion_logprobs", "conv_hashes", "conv_end", "strict_hashes", "strict_end", "messages", "completion",
    "prefix_call_id", "prefix_len",
]
REWARD_COLUMNS = ["episode_id", "reward", "task_id", "source", "metadata", "policy"]
SKIPPED_COLUMNS = ["file_id", "record_id", "reason", "detail"]
CALL_IMAGE_COLUMNS = ["call_id", "idx", "hash", "token_start", "n_tokens", "grid_t", "grid_h", "grid_w", "processor"]
IMAGE_COLUMNS = ["hash", "mime", "data", "width", "height"]


class Reader(Protocol):
    """A file opened for pass 1: `FlowFile`, or `MitmFile` (mitmproxy's own files as exchange records)."""

    n_records: int
    torn_tail: bool
    error: str | None

    def records(self) -> Iterator[Mapping[str, Any]]: ...


class Unauthenticated(Exception):
    """A file that a flow key is given for and that is not signed with it: nothing of it is used."""


def open_reader(path: Path, flow_key: bytes | None = None) -> tuple[Reader, str]:
    """(reader, file id) without reading past the header, so an unchanged file costs nothing.

    Raises NotAFlowFile, with the reason, for a file that is neither kind; with a flow key, Unauthenticated
    for a mitmproxy file (never signed).
    """
    if not path.is_file():
        raise NotAFlowFile(f"no such file: {path}")
    if path.stat().st_size and is_mitm_file(path):
        if flow_key is not None:
            raise Unauthenticated("a mitmproxy file is never signed")
        first = next(iter(MitmFile(path).records()), None)
        if first is None:
            raise NotAFlowFile("mitmproxy file holds no HTTP flow")
        return MitmFile(path), hashlib.sha256(f"mitmproxy:{first['id']}".encode()).hexdigest()[:32]
    return open_flow_file(path, flow_key), header_id(read_header(path))


class Ingest:
    """Pass 1 over one database connection: what the run's files have read so far, and what they touched.

    `touched`: the episodes that got calls (pass 2 rebuilds them). `seen`: the call ids read in this run
    (a reused id is a damaged record, never a second call). The linker starts from the conversations
    already stored, so a later run's calls join their episodes. `vision`: the image processor and VL chat
    template for calls with images; None skips them as `images_unsupported`. `flow_key`: records are used
    only from files signed with it, up to the first record whose MAC fails (`unauthenticated_file`).
    """

    def __init__(self, con: duckdb.DuckDBPyConnection, retok: Retokenizer, run: str | None, summary: Summary,
                 vision: Vision | None = None, flow_key: bytes | None = None) -> None:
        self.con, self.retok, self.run, self.summary, self.vision = con, retok, run, summary, vision
        self.flow_key = flow_key
        known = con.execute("SELECT conv_end, episode_id FROM call_tokens WHERE linked_by = 'conversation'").fetchall()
        self.linker = Linker(dict(known))
        self.hasher = ChainHasher()
        self.prefixes = PrefixSplitter()
        self.touched: set[str] = set()
        self.seen: set[str] = set()
        self.file_id = ""  # of the file being read
        self.record_calls: list[str] = []  # the calls of the record being read that reached the prefix splitter
        self.bufs: dict[str, store.Buffer] = {}  # its rows not inserted yet

    def file(self, path: Path) -> None:
        """Read a flow file's records that are not stored yet (all of a new file, the tail of a grown one)."""
        try:
            reader, self.file_id = open_reader(path, self.flow_key)
        except NotAFlowFile as e:
            self._unreadable(path, "unreadable_file", str(e))
            return
        except Unauthenticated as e:
            self._unreadable(path, "unauthenticated_file", str(e))
            return
        con = self.con
        prior = con.execute(
            "SELECT n_records, n_bytes FROM ingested_files WHERE file_id = ?", [self.file_id]
        ).fetchone()
        size = path.stat().st_size
        if prior and prior[1] == size:
            self.summary.files_unchanged += 1
            return
        already = prior[0] if prior else 0
        con.begin()
        try:
            con.execute("DELETE FROM skipped WHERE file_id = ? AND record_id IS NULL", [self.file_id])
            self.bufs = self._buffers()
            index = 0
            try:
                for rec in reader.records():
                    index += 1
                    if index <= already:
                        continue
                    self.summary.records += 1
                    mark = {name: b.n for name, b in self.bufs.items()}
                    self.record_calls = []
                    try:
                        self._record(rec)
                    except Exception as e:  # noqa: BLE001 - one bad record is skipped, never the run
                        self._skip_failed(rec, e, mark)
                    if self.bufs["calls"].n >= store.FLUSH_EVERY or max(
                            self.bufs["call_tokens"].cells, self.bufs["images"].cells) >= store.FLUSH_CELLS:
                        self._commit_batch(path, index)
                        con.begin()
            except UnsupportedVersion as e:
                reader.error = str(e)
            self._flush()
            for reason, detail in file_problems(reader):
                self.summary.records += reason == "undecodable_record"  # a record read, and skipped
                con.execute("INSERT INTO skipped VALUES (?, NULL, ?, ?)",
                            [self.file_id, reason, _text(f"{path}: {detail}")])
                self.summary.skipped[reason] += 1
            self._mark_read(path, reader.n_records, size, bool(reader.torn_tail))
            con.commit()
        except BaseException:
            con.rollback()
            raise
        self.summary.files_ingested += 1

    def rewards_file(self, path: Path, rows: list[dict[str, Any] | BadReward]) -> None:
        """A rewards file's rows replace those an earlier run read from the same file."""
        source = f"file:{path.resolve()}"
        self.con.execute("DELETE FROM rewards WHERE source = ?", [source])
        self.con.execute("DELETE FROM skipped WHERE file_id = ?", [source])
        buf = store.Buffer(self.con, "rewards", ["episode_id", "reward", "task_id", "source", "metadata"])
        for row in rows:
            if isinstance(row, BadReward):
                self.con.execute("INSERT INTO skipped VALUES (?, NULL, 'bad_reward', ?)", [source, str(row)[:500]])
                self.summary.skipped["bad_reward"] += 1
            else:
                buf.add(**row, source=source, metadata=None)
        self.summary.rewards += buf.flush()

    def _unreadable(self, path: Path, reason: str, error: str) -> None:
        """A file none of which is read: one `skipped` row per path, replaced by each run that meets it."""
        fid = "path:" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:27]
        self.con.execute("DELETE FROM skipped WHERE file_id = ? AND record_id IS NULL", [fid])
        self.con.execute("INSERT INTO skipped VALUES (?, NULL, ?, ?)", [fid, reason, f"{path}: {error}"])
        self.summary.skipped[reason] += 1

    def _buffers(self) -> dict[str, store.Buffer]:
        con = self.con
        return {
            "calls": store.Buffer(con, "calls", CALL_COLUMNS, ignore_conflicts=True, key="call_id"),
            "call_tokens": store.Buffer(con, "call_tokens", TOKEN_COLUMNS, ignore_conflicts=True, key="call_id"),
            "skipped": store.Buffer(con, "skipped", SKIPPED_COLUMNS),
            "rewards": store.Buffer(con, "rewards", REWARD_COLUMNS),
            "call_messages": store.Buffer(con, "call_messages", ["hash", "message"], ignore_conflicts=True),
            "call_images": store.Buffer(con, "call_images", CALL_IMAGE_COLUMNS),
            "images": store.Buffer(con, "images", IMAGE_COLUMNS, ignore_conflicts=True, key="hash"),
        }

    def _flush(self) -> None:
        """Insert every buffer, `skipped` last: the rows Arrow refused (a value no check foresaw) go there too."""
        for name, b in self.bufs.items():
            if name != "skipped":
                b.flush()
            for row, error in b.rejected:
                self._skip(row.get("call_id"), "insert_failed", error)
            b.rejected.clear()
        self.bufs["skipped"].flush()

    def _skip(self, record_id: Any, reason: str, detail: str) -> None:
        record_id = None if record_id is None else _text(str(record_id)[:100])
        self.bufs["skipped"].add(file_id=self.file_id, record_id=record_id, reason=reason, detail=_text(detail[:500]))
        self.summary.skipped[reason] += 1

    def _skip_failed(self, rec: Mapping[str, Any], error: Exception, mark: dict[str, int]) -> None:
        """Skip a record that raised half-way as `malformed_record`, dropping what it had buffered (so its call
        and token rows go together) and its calls (one per choice) from the prefix splitter (no later prompt is
        stored as a suffix of a call that is not stored). Conversation messages stay: they are shared by
        content, and later calls refer to them."""
        for name, n in mark.items():
            if name != "call_messages":
                self.bufs[name].truncate(n)
        for call_id in self.record_calls:
            self.prefixes.forget(call_id)
        self._skip(rec.get("id"), "malformed_record", f"{type(error).__name__}: {error}")

    def _commit_batch(self, path: Path, index: int) -> None:
        """Commit a batch in the middle of a file: a transaction per batch, not per file, keeps memory flat.

        The file is marked read up to `index` records (n_bytes -1: never equal to a size), so a run that dies
        later resumes after them; the touched episodes lose their `episodes` row, so that run rebuilds them.
        """
        self._flush()
        self._mark_read(path, index, -1, False)
        self.con.register("_touched", pa.table({"episode_id": list(self.touched)}))
        self.con.execute("DELETE FROM episodes WHERE episode_id IN (SELECT episode_id FROM _touched)")
        self.con.unregister("_touched")
        self.con.commit()

    def _mark_read(self, path: Path, n_records: int, n_bytes: int, torn_tail: bool) -> None:
        """Record how far a file was read (n_bytes -1: part of it, the next run goes on after n_records)."""
        self.con.execute(
            "INSERT OR REPLACE INTO ingested_files VALUES (?, ?, ?, ?, ?, ?)",
            [self.file_id, str(path), n_records, n_bytes, torn_tail, datetime.now(UTC)],
        )

    def _record(self, rec: Mapping[str, Any]) -> None:
        """One record, whatever a damaged file made of it: its `type` picks what it becomes."""
        kind = rec.get("type")
        if kind == "reward":
            self._reward(cast(RewardRecord, rec))
        elif kind == "exchange":
            self._exchange(cast(ExchangeRecord, rec))
        elif kind == "reward_refused":  # a second post the proxy refused (409): on record, never a reward
            self._skip(rec.get("id"), "refused_reward", f"episode {rec.get('episode')!r:.80}: reward "
                       f"{rec.get('reward')!r:.40} refused: {rec.get('error')!r:.200}")
        else:
            self._skip(rec.get("id"), "unknown_record_type", f"record type {kind!r}")

    def _reward(self, rec: RewardRecord) -> None:
        try:
            reward = check_reward(rec.get("reward"))
            episode = rec.get("episode")
            if not isinstance(episode, str) or not episode:
                raise BadReward(f"episode {episode!r:.80} is not an episode id")
        except BadReward as e:
            self._skip(rec.get("id"), "bad_reward", f"{e} (episode {rec.get('episode')!r:.80})")
            return
        meta = rec.get("metadata")
        self.bufs["rewards"].add(
            episode_id=episode, reward=reward, task_id=rec.get("task_id"), source=f"flow:{self.file_id}",
            metadata=json.dumps(meta) if meta is not None else None,
            policy="first" if rec.get("reward_policy") == "first" else "last",
        )
        self.summary.rewards += 1

    def _exchange(self, rec: ExchangeRecord) -> None:
        """Every choice of the answer becomes a call (a choice that cannot: a `skipped` row of its own).

        The record's outcomes are counted once all its choices are buffered: a choice that raises drops the
        whole record (`_skip_failed`), and then none of them was counted."""
        try:
            choices = parse_choices(rec)
        except Skip as s:
            self._skip_row(rec.get("id"), s)
            return
        outcomes = [c if isinstance(c, Skip) else self._call(rec, c) for c in choices]
        for outcome in outcomes:
            if isinstance(outcome, Skip):
                self._skip_row(outcome.call_id, outcome)
            else:
                self._count(*outcome)
        self.summary.extra_choices += len(outcomes) - 1

    def _skip_row(self, record_id: Any, s: Skip) -> None:
        self.bufs["skipped"].add(file_id=self.file_id, record_id=record_id, reason=s.reason, detail=s.detail)
        self.summary.skipped[s.reason] += 1

    def _call(self, rec: ExchangeRecord, call: Call) -> Skip | tuple[str, str, str]:
        """Buffer one call's rows; (role, token source, prompt check) to count, or why it is skipped."""
        bufs = self.bufs
        try:
            if call.call_id in self.seen:
                raise Skip("duplicate_record", f"record id {call.call_id} was already read in this run")
            self.seen.add(call.call_id)
            grids: list[Grid] = []
            starts: list[int] = []  # of each image's pad run in the prompt ids
            if call.images:
                if self.vision is None:
                    raise Skip("images_unsupported", f"{len(call.images)} image(s): pass --processor DIR (the "
                               "vision-language model's image processor) to build vision-language samples")
                grids = [self.vision.grid(i, image) for i, image in enumerate(call.images)]
                prompt_ids, completion_ids, source = token_ids(call, self.vision.retok)
                prompt_ids, starts = image_prompt(self.vision, prompt_ids, source, grids)
            else:
                prompt_ids, completion_ids, source = token_ids(call, self.retok)
        except Skip as s:
            s.call_id = call.call_id
            return s
        messages = call.messages
        if messages is None:
            messages = [{"role": "prompt", "content": call.prompt_text or ""}]
        conv, conv_end, strict, strict_end = self.hasher.hashes(messages, call.tools, call.completion)
        for h, message in self.hasher.fresh:  # conversation stored once per message, not once per call
            bufs["call_messages"].add(hash=h, message=message)
        self.hasher.fresh.clear()
        recorded = rec.get("episode")
        if recorded:
            episode, linked_by = str(recorded), "recorded"
        else:
            # linked by the record id: a record's choices share their prompt, so they share its episode
            episode, linked_by = self.linker.assign(str(rec["id"]), conv, conv_end), "conversation"
        logprobs = call.engine_logprobs if call.engine_completion_ids is not None else None
        try:  # numpy from here on: 4 bytes a token in the buffers instead of a Python int object
            completion = int32(completion_ids)
            self.record_calls.append(call.call_id)
            prefix_id, prefix_len, suffix = self.prefixes.split(episode, call.call_id, prompt_ids, completion)
        except ValueError as e:
            return Skip("bad_token_ids", str(e)[:300], call.call_id)
        lps = None if logprobs is None else np.asarray(logprobs, np.float32)
        rendered = len(prompt_ids) if not isinstance(prompt_ids, RawIds) else None
        check = prompt_check(source, rendered, call.prompt_tokens, call.engine_prompt_beside)
        if check == "match" and call.engine_prompt_beside and prompt_ids != call.engine_prompt_ids:
            check = "mismatch"  # rendered (the completion's ids were not the engine's), and not the engine's prompt
        self.touched.add(episode)
        role = rec.get("role") or DEFAULT_ROLE
        bufs["calls"].add(
            call_id=call.call_id, file_id=self.file_id, episode_id=episode, run_id=self.run, role=role,
            toolchain=rec.get("toolchain"), protocol=call.protocol, model=rec.get("model"),
            engine_model=rec.get("upstream_model"), streamed=call.streamed,
            status=call.status, t_start=rec.get("t_start"), t_first_byte=rec.get("t_first_byte"),
            t_end=rec.get("t_end"), prompt_tokens=call.prompt_tokens, completion_tokens=call.completion_tokens,
            finish_reason=call.finish_reason, token_source=source, prompt_check=check,
            policy_version=rec.get("policy_version"),
        )
        bufs["call_tokens"].add(
            call_id=call.call_id, episode_id=episode, linked_by=linked_by, t_start=rec.get("t_start"),
            seq=rec.get("seq"), token_source=source, prompt_ids=suffix, completion_ids=completion,
            completion_logprobs=lps,
            conv_hashes=conv, conv_end=conv_end, strict_hashes=strict, strict_end=strict_end,
            completion=json.dumps(call.completion),
            messages=None if call.messages is not None else "null",  # NULL: read back from call_messages
            prefix_call_id=prefix_id, prefix_len=prefix_len if prefix_id else None,
        )
        if self.vision is not None and grids:
            self._images(call, grids, starts, self.vision.settings)
        return role, source, check

    def _images(self, call: Call, grids: list[Grid], starts: list[int], settings: str) -> None:
        """The call's images in prompt order with their pad runs (`call_images`), and each image's bytes once."""
        for idx, (image, grid, start) in enumerate(zip(call.images, grids, starts)):
            self.bufs["call_images"].add(
                call_id=call.call_id, idx=idx, hash=image.sha256, token_start=start, n_tokens=grid.n_tokens,
                grid_t=grid.t, grid_h=grid.h, grid_w=grid.w, processor=settings,
            )
            self.bufs["images"].add(hash=image.sha256, mime=image.mime, data=image.data, width=grid.width,
                                    height=grid.height)

    def _count(self, role: str, source: str, check: str) -> None:
        summary = self.summary
        summary.calls += 1
        summary.calls_by_role[role] += 1
        summary.calls_prompt_mismatch += int(check == "mismatch")
        if source == "engine":
            summary.calls_engine_ids += 1
        elif source == "mixed":
            summary.calls_mixed += 1
        else:
            summary.calls_retokenized += 1


def file_problems(reader: Reader) -> list[tuple[str, str]]:
    """(skipped reason, detail) of what a read file could not give: records skipped as undecodable, where it
    stopped (corruption, a MAC that failed) and a torn tail."""
    problems = [("undecodable_record", bad) for bad in getattr(reader, "bad_records", [])]
    if reader.error:
        problems.append(("corrupt_file", reader.error))
    if unauthenticated := getattr(reader, "unauthenticated", None):
        problems.append(("unauthenticated_file", unauthenticated))
    if reader.torn_tail:
        problems.append(("torn_record", "last record cut short (kill -9 mid-write)"))
    return problems


def token_ids(call: Call, retok: Retokenizer) -> tuple[list[int] | RawIds, list[int], str]:
    """The engine's ids where it gave them, else the chat template's; `mixed` when only the completion's."""
    if call.engine_prompt_ids is not None and call.engine_completion_ids is not None:
        return call.engine_prompt_ids, call.engine_completion_ids, "engine"
    try:
        prompt, completion = retok.call_ids(call)
    except Exception as e:  # noqa: BLE001 - a template that rejects this conversation skips the call
        raise Skip("template_error", f"{type(e).__name__}: {e}") from None
    if call.engine_completion_ids is not None:
        return prompt, call.engine_completion_ids, "mixed"
    return prompt, completion, "retokenized"


def image_prompt(vision: Vision, prompt_ids: list[int] | RawIds, source: str,
                 grids: list[Grid]) -> tuple[list[int], list[int]]:
    """(prompt ids, start of each image's pad run): a rendered prompt's pads expanded as the VL processor does;
    the engine's already are. Either way the runs must be the processor's grids, in order, or Skip."""
    ids = prompt_ids.parse() if isinstance(prompt_ids, RawIds) else list(prompt_ids)
    if source != "engine":
        ids = vision.expand(ids, grids)
    return ids, vision.check_runs(ids, grids)


def prompt_check(source: str, rendered: int | None, reported: Any, beside: bool = False) -> str:
    """`engine` (the engine's own prompt ids), or how a rendered prompt's length compares with the engine's
    `usage` count: `match`, `mismatch` (the engine rendered another template), `unchecked` (no count).
    Ids the engine gave `beside` its answer (rendered and tokenized by a second request) are checked too:
    `mismatch` when their count is not the one its answer reports."""
    counted = rendered is not None and not isinstance(reported, bool) and isinstance(reported, int)
    if source == "engine":
        return "mismatch" if beside and counted and rendered != reported else "engine"
    if not counted:
        return "unchecked"
    return "match" if rendered == reported else "mismatch"


def _text(s: str) -> str:
    """`s` storable whatever a damaged record put in it (a lone surrogate becomes its escape)."""
    return s.encode("utf-8", "backslashreplace").decode()
