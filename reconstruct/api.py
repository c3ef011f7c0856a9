"""`reconstruct(paths, db, tokenizer, ...)`: flow files -> token-exact samples in DuckDB.

Two passes, both streaming. Pass 1 reads each new (or grown) flow file once, turns each exchange
into a call with token ids and stores it (`calls`, `call_tokens`), rewards into `rewards`, and
anything unusable into `skipped`. Pass 2 rebuilds only the episodes that pass 1 touched, one
episode in memory at a time, from `call_tokens`: trajectory tree, samples, reward, advantage.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pyarrow as pa

from openforge.addons.flowfile import UnsupportedVersion, expand_paths, open_flow_file, pack
from openforge.reconstruct import store
from openforge.reconstruct.drift import classify
from openforge.reconstruct.episodes import ChainHasher, Linker
from openforge.reconstruct.mitm_flows import MitmFile, is_mitm_file
from openforge.reconstruct.prefixes import PrefixSplitter, expand, int32
from openforge.reconstruct.protocols import Call, RawIds, Skip, parse_record
from openforge.reconstruct.rewards import (
    RESOLVED_REWARDS_SQL,
    BadReward,
    MissingReward,
    advantage_sql,
    check_reward,
    read_rewards_file,
)
from openforge.reconstruct.tokenize import Retokenizer, load_tokenizer
from openforge.reconstruct.trajectories import DRIFT_CLASSES, TreeCall, build_tree, chains, near_misses

Progress = Callable[[str, int, int], None]  # (stage, done, total)
FLUSH_EVERY = 256
FLUSH_CELLS = 1_000_000  # token ids (+ logprobs) buffered before a flush: ~4 MB as numpy, whatever the prompt length
READ_CELLS = 1_000_000  # pass 2 reads whole episodes until their token ids reach this many (at least one episode)
DEFAULT_ROLE = "agent"  # the proxy's default role; a call recorded without one counts as it


@dataclass
class Summary:
    """What one run did; the CLI prints it and tests assert on it."""

    files: int = 0
    files_ingested: int = 0
    files_unchanged: int = 0
    records: int = 0
    calls: int = 0
    calls_engine_ids: int = 0
    calls_mixed: int = 0  # engine completion ids, prompt rendered by the template (llama.cpp gives no prompt ids)
    calls_retokenized: int = 0
    calls_prompt_mismatch: int = 0  # rendered prompt length differs from the engine's: template drift
    calls_by_role: Counter = field(default_factory=Counter)
    rewards: int = 0
    skipped: Counter = field(default_factory=Counter)
    episodes: int = 0
    samples: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    drift: Counter = field(default_factory=Counter)
    episodes_missing_reward: int = 0
    episodes_dropped: int = 0
    episodes_pending: int = 0  # no reward and no --missing-reward policy: not built, not lost
    seconds: float = 0.0


CALL_COLUMNS = [
    "call_id", "file_id", "episode_id", "run_id", "role", "toolchain", "protocol", "model", "engine_model",
    "streamed", "status", "t_start", "t_first_byte", "t_end", "prompt_tokens", "completion_tokens",
    "finish_reason", "token_source", "prompt_check",
]
TOKEN_COLUMNS = [
    "call_id", "episode_id", "linked_by", "t_start", "seq", "token_source", "prompt_ids", "completion_ids",
    "completion_logprobs", "conv_hashes", "conv_end", "strict_hashes", "strict_end", "messages", "tools",
    "completion", "prefix_call_id", "prefix_len",
]
SAMPLE_COLUMNS = [
    "sample_id", "episode_id", "run_id", "task_id", "tokenizer", "vocab_size", "token_source", "input_ids",
    "loss_mask", "behaviour_logprobs", "n_tokens", "n_trainable", "n_calls", "reward", "advantage", "weight",
    "created_at", "role", "toolchain",
]


@dataclass(frozen=True)
class BuildOptions:
    """What decides which tokens are trainable; a run with other options than the last rebuilds every episode."""

    train_roles: list[str]
    keep_prompt_mismatch: bool = False

    def trainable(self, role: str | None, prompt_check: str | None) -> bool:
        return (role or DEFAULT_ROLE) in self.train_roles and (self.keep_prompt_mismatch or prompt_check != "mismatch")

    def key(self) -> str:
        return json.dumps({"train_roles": self.train_roles, "keep_prompt_mismatch": self.keep_prompt_mismatch})


EPISODE_COLUMNS = [
    "episode_id", "run_id", "task_id", "toolchain", "n_calls", "n_samples", "reward", "weight",
    "drift_template", "drift_retokenization", "drift_client_rewrite", "drift_other",
]


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
) -> Summary:
    """Ingest flow files (ours or mitmproxy's) into `db`; rebuild the episodes they touch.

    Only calls of `train_roles` become trainable tokens; other roles' calls are kept as samples with nothing
    trainable. `group_by`: advantages within a task (`task`) or within a task and toolchain (`task-toolchain`).
    A call whose rendered prompt differs in length from the engine's is template drift and trains only with
    `keep_prompt_mismatch`. `chat_template`: a file with the template the engine rendered prompts with.
    """
    started = time.monotonic()
    policy = missing_reward if isinstance(missing_reward, MissingReward) else MissingReward.parse(missing_reward)
    advantage_sql(advantage, group_by)  # validate before any work
    build = BuildOptions(sorted(set(train_roles)), keep_prompt_mismatch)
    files = expand_paths(list(paths))
    reward_rows = list(read_rewards_file(rewards)) if rewards else []
    retok = tokenizer if isinstance(tokenizer, Retokenizer) else Retokenizer(load_tokenizer(tokenizer))
    if chat_template is not None:
        retok = Retokenizer(retok.tok, chat_template=Path(chat_template).read_text(encoding="utf-8"))
    con = store.connect(db)
    try:
        summary = Summary(files=len(files))
        con.execute(f"CREATE OR REPLACE TEMP TABLE old_rewards AS {RESOLVED_REWARDS_SQL}")
        linker = Linker(
            dict(con.execute("SELECT conv_end, episode_id FROM call_tokens WHERE linked_by = 'conversation'").fetchall())
        )
        hasher = ChainHasher()
        prefixes = PrefixSplitter()
        touched: set[str] = set()
        seen: set[str] = set()  # call ids read in this run: a reused id is a damaged record, never a second call
        total = sum(p.stat().st_size for p in files if p.exists())
        done = 0
        for path in files:
            _ingest_file(con, path, retok, linker, hasher, prefixes, run, summary, touched, seen)
            done += path.stat().st_size if path.exists() else 0
            if progress:
                progress("read", done, total)
        if rewards:
            _ingest_rewards_file(con, Path(rewards), reward_rows, summary)
        _rebuild(con, retok, touched, policy, advantage, group_by, build, summary, progress)
        summary.seconds = time.monotonic() - started
        return summary
    finally:
        con.close()


# ---------------------------------------------------------------- pass 1: files -> calls


def _open(path: Path) -> tuple[Any, str | None, str | None]:
    """(reader, file id, error) without reading past the header, so unchanged files cost nothing."""
    if not path.is_file():
        return None, None, f"no such file: {path}"
    if path.stat().st_size and is_mitm_file(path):
        reader = MitmFile(path)
        first = next(iter(MitmFile(path).records()), None)
        if first is None:
            return None, None, "mitmproxy file holds no HTTP flow"
        return reader, hashlib.sha256(f"mitmproxy:{first['id']}".encode()).hexdigest()[:32], None
    try:
        with open(path, "rb") as f:
            header = next(iter(msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=1 << 20)))
    except Exception as e:  # noqa: BLE001 - any undecodable start means the same thing
        return None, None, f"not a flow file: {e}"
    if not isinstance(header, dict) or header.get("type") != "header":
        return None, None, "no header record: not an OpenForge flow file"
    reader = open_flow_file(path)
    return reader, hashlib.sha256(pack(header)).hexdigest()[:32], None


def _ingest_file(
    con, path: Path, retok: Retokenizer, linker: Linker, hasher: ChainHasher, prefixes: PrefixSplitter, run,
    summary: Summary, touched: set, seen: set,
) -> None:
    reader, file_id, error = _open(path)
    if error:
        fid = "path:" + hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:27]
        con.execute("DELETE FROM skipped WHERE file_id = ? AND record_id IS NULL", [fid])
        con.execute("INSERT INTO skipped VALUES (?, NULL, 'unreadable_file', ?)", [fid, f"{path}: {error}"])
        summary.skipped["unreadable_file"] += 1
        return
    prior = con.execute("SELECT n_records, n_bytes FROM ingested_files WHERE file_id = ?", [file_id]).fetchone()
    size = path.stat().st_size
    if prior and prior[1] == size:
        summary.files_unchanged += 1
        return
    already = prior[0] if prior else 0
    con.begin()
    try:
        con.execute("DELETE FROM skipped WHERE file_id = ? AND record_id IS NULL", [file_id])
        bufs = _buffers(con)
        index = 0
        try:
            for rec in reader.records():
                index += 1
                if index <= already:
                    continue
                summary.records += 1
                mark = {name: b.n for name, b in bufs.items()}
                try:
                    _ingest_record(rec, file_id, retok, linker, hasher, prefixes, run, bufs, summary, touched, seen)
                except Exception as e:  # noqa: BLE001 - one bad record is skipped, never the run
                    _skip_failed(rec, e, mark, file_id, bufs, prefixes, summary)
                if bufs["calls"].n >= FLUSH_EVERY or bufs["call_tokens"].cells >= FLUSH_CELLS:
                    _commit_batch(con, bufs, file_id, path, index, touched, summary)
                    con.begin()
        except UnsupportedVersion as e:
            reader.error = str(e)
        _flush(bufs, file_id, summary)
        for flag, reason in ((reader.error, "corrupt_file"), (reader.torn_tail, "torn_record")):
            if flag:
                detail = reader.error if reason == "corrupt_file" else "last record cut short (kill -9 mid-write)"
                con.execute("INSERT INTO skipped VALUES (?, NULL, ?, ?)", [file_id, reason, f"{path}: {detail}"])
                summary.skipped[reason] += 1
        _mark_read(con, file_id, path, reader.n_records, size, bool(reader.torn_tail))
        con.commit()
    except BaseException:
        con.rollback()
        raise
    summary.files_ingested += 1


def _buffers(con) -> dict[str, store.Buffer]:
    return {
        "calls": store.Buffer(con, "calls", CALL_COLUMNS, ignore_conflicts=True, key="call_id"),
        "call_tokens": store.Buffer(con, "call_tokens", TOKEN_COLUMNS, ignore_conflicts=True, key="call_id"),
        "skipped": store.Buffer(con, "skipped", ["file_id", "record_id", "reason", "detail"]),
        "rewards": store.Buffer(con, "rewards", ["episode_id", "reward", "task_id", "source", "metadata", "policy"]),
        "images": store.Buffer(con, "images", ["sha256", "mime", "data"], ignore_conflicts=True),
        "call_messages": store.Buffer(con, "call_messages", ["hash", "message"], ignore_conflicts=True),
        "call_images": store.Buffer(con, "call_images", ["call_id", "sha256"]),
    }


def _flush(bufs: dict[str, store.Buffer], file_id: str, summary: Summary) -> None:
    """Insert every buffer, `skipped` last: the rows Arrow refused (a value no check foresaw) go there too."""
    for name, b in bufs.items():
        if name != "skipped":
            b.flush()
        for row, error in b.rejected:
            _skip(bufs, summary, file_id, row.get("call_id"), "insert_failed", error)
        b.rejected.clear()
    bufs["skipped"].flush()


def _skip(bufs: dict[str, store.Buffer], summary: Summary, file_id: str, record_id: Any, reason: str, detail: str) -> None:
    record_id = None if record_id is None else _text(str(record_id)[:100])
    bufs["skipped"].add(file_id=file_id, record_id=record_id, reason=reason, detail=_text(detail[:500]))
    summary.skipped[reason] += 1


def _text(s: str) -> str:
    """`s` storable whatever a damaged record put in it (a lone surrogate becomes its escape)."""
    return s.encode("utf-8", "backslashreplace").decode()


def _skip_failed(rec, error: Exception, mark: dict[str, int], file_id: str, bufs: dict[str, store.Buffer],
                 prefixes: PrefixSplitter, summary: Summary) -> None:
    """Skip a record that raised half-way as `malformed_record`, dropping what it had buffered (so its call
    rows, token rows and images go together) and its call from the prefix splitter (no later prompt is
    stored as a suffix of a call that is not stored). Conversation messages stay: they are shared by
    content, and later calls refer to them."""
    for name, n in mark.items():
        if name != "call_messages":
            bufs[name].truncate(n)
    prefixes.forget(str(rec.get("id")))
    _skip(bufs, summary, file_id, rec.get("id"), "malformed_record", f"{type(error).__name__}: {error}")


def _commit_batch(con, bufs: dict[str, store.Buffer], file_id: str, path: Path, index: int, touched: set,
                  summary: Summary) -> None:
    """Commit a batch in the middle of a file: a transaction per batch, not per file, keeps memory flat.

    The file is marked read up to `index` records (n_bytes -1: never equal to a size), so a run that dies
    later resumes after them; the touched episodes lose their `episodes` row, so that run rebuilds them.
    """
    _flush(bufs, file_id, summary)
    _mark_read(con, file_id, path, index, -1, False)
    con.register("_touched", pa.table({"episode_id": list(touched)}))
    con.execute("DELETE FROM episodes WHERE episode_id IN (SELECT episode_id FROM _touched)")
    con.unregister("_touched")
    con.commit()


def _mark_read(con, file_id: str, path: Path, n_records: int, n_bytes: int, torn_tail: bool) -> None:
    """Record how far a file was read (n_bytes -1: part of it, the next run goes on after n_records)."""
    con.execute(
        "INSERT OR REPLACE INTO ingested_files VALUES (?, ?, ?, ?, ?, ?)",
        [file_id, str(path), n_records, n_bytes, torn_tail, datetime.now(UTC)],
    )


def _ingest_record(rec, file_id, retok, linker, hasher, prefixes, run, bufs, summary: Summary, touched: set,
                   seen: set) -> None:
    if rec.get("type") == "reward":
        try:
            reward = check_reward(rec.get("reward"))
            episode = rec.get("episode")
            if not isinstance(episode, str) or not episode:
                raise BadReward(f"episode {episode!r:.80} is not an episode id")
        except BadReward as e:
            _skip(bufs, summary, file_id, rec.get("id"), "bad_reward", f"{e} (episode {rec.get('episode')!r:.80})")
            return
        meta = rec.get("metadata")
        bufs["rewards"].add(
            episode_id=episode, reward=reward, task_id=rec.get("task_id"), source=f"flow:{file_id}",
            metadata=json.dumps(meta) if meta is not None else None,
            policy="first" if rec.get("reward_policy") == "first" else "last",
        )
        summary.rewards += 1
        return
    if rec.get("type") != "exchange":
        _skip(bufs, summary, file_id, rec.get("id"), "unknown_record_type", f"record type {rec.get('type')!r}")
        return
    try:
        call = parse_record(rec)
        if call.call_id in seen:
            raise Skip("duplicate_record", f"record id {call.call_id} was already read in this run")
        seen.add(call.call_id)
        if call.images:
            raise Skip("images_unsupported", f"{len(call.images)} image(s): vision-language samples do not exist yet")
        prompt_ids, completion_ids, source = _token_ids(call, retok)
    except Skip as s:
        bufs["skipped"].add(file_id=file_id, record_id=rec.get("id"), reason=s.reason, detail=s.detail)
        summary.skipped[s.reason] += 1
        return
    messages = call.messages if call.messages is not None else [{"role": "prompt", "content": call.prompt_text or ""}]
    conv, conv_end, strict, strict_end = hasher.hashes(messages, call.tools, call.completion)
    for h, message in hasher.fresh:  # conversation stored once per message, not once per call
        bufs["call_messages"].add(hash=h, message=message)
    hasher.fresh.clear()
    if rec.get("episode"):
        episode, linked_by = str(rec["episode"]), "recorded"
    else:
        episode, linked_by = linker.assign(call.call_id, conv, conv_end), "conversation"
    logprobs = call.engine_logprobs if call.engine_completion_ids is not None else None
    try:  # numpy from here on: 4 bytes a token in the buffers instead of a Python int object
        completion_ids = int32(completion_ids)
        prefix_id, prefix_len, suffix = prefixes.split(episode, call.call_id, prompt_ids, completion_ids)
    except ValueError as e:
        bufs["skipped"].add(file_id=file_id, record_id=rec.get("id"), reason="bad_token_ids", detail=str(e)[:300])
        summary.skipped["bad_token_ids"] += 1
        return
    logprobs = None if logprobs is None else np.asarray(logprobs, np.float32)
    check = _prompt_check(source, len(prompt_ids) if not isinstance(prompt_ids, RawIds) else None, call.prompt_tokens)
    touched.add(episode)
    role = rec.get("role") or DEFAULT_ROLE
    bufs["calls"].add(
        call_id=call.call_id, file_id=file_id, episode_id=episode, run_id=run, role=role,
        toolchain=rec.get("toolchain"), protocol=call.protocol, model=rec.get("model"),
        engine_model=rec.get("upstream_model"), streamed=call.streamed,
        status=call.status, t_start=rec.get("t_start"), t_first_byte=rec.get("t_first_byte"),
        t_end=rec.get("t_end"), prompt_tokens=call.prompt_tokens, completion_tokens=call.completion_tokens,
        finish_reason=call.finish_reason, token_source=source, prompt_check=check,
    )
    bufs["call_tokens"].add(
        call_id=call.call_id, episode_id=episode, linked_by=linked_by, t_start=rec.get("t_start"),
        seq=rec.get("seq"), token_source=source, prompt_ids=suffix, completion_ids=completion_ids,
        completion_logprobs=logprobs, conv_hashes=conv, conv_end=conv_end, strict_hashes=strict,
        strict_end=strict_end, completion=json.dumps(call.completion),
        messages=None if call.messages is not None else "null",  # NULL: read back from call_messages
        prefix_call_id=prefix_id, prefix_len=prefix_len if prefix_id else None,
    )
    for img in call.images:
        bufs["images"].add(sha256=img.sha256, mime=img.mime, data=img.data)
        bufs["call_images"].add(call_id=call.call_id, sha256=img.sha256)
    summary.calls += 1
    summary.calls_by_role[role] += 1
    summary.calls_prompt_mismatch += int(check == "mismatch")
    if source == "engine":
        summary.calls_engine_ids += 1
    elif source == "mixed":
        summary.calls_mixed += 1
    else:
        summary.calls_retokenized += 1


def _token_ids(call: Call, retok: Retokenizer) -> tuple[list[int] | RawIds, list[int], str]:
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


def _prompt_check(source: str, rendered: int | None, reported: Any) -> str:
    """`engine` (the engine's own prompt ids), or how a rendered prompt's length compares with the engine's
    `usage` count: `match`, `mismatch` (the engine rendered another template), `unchecked` (no count)."""
    if source == "engine":
        return "engine"
    if rendered is None or isinstance(reported, bool) or not isinstance(reported, int):
        return "unchecked"
    return "match" if rendered == reported else "mismatch"


def _ingest_rewards_file(con, path: Path, rows: list[dict[str, Any] | BadReward], summary: Summary) -> None:
    source = f"file:{path.resolve()}"
    con.execute("DELETE FROM rewards WHERE source = ?", [source])
    con.execute("DELETE FROM skipped WHERE file_id = ?", [source])
    buf = store.Buffer(con, "rewards", ["episode_id", "reward", "task_id", "source", "metadata"])
    for row in rows:
        if isinstance(row, BadReward):
            con.execute("INSERT INTO skipped VALUES (?, NULL, 'bad_reward', ?)", [source, str(row)[:500]])
            summary.skipped["bad_reward"] += 1
        else:
            buf.add(**row, source=source, metadata=None)
    summary.rewards += buf.flush()


# ---------------------------------------------------------------- pass 2: episodes -> samples


def _rebuild(con, retok, touched: set, policy, advantage: str, group_by: str, build: BuildOptions,
             summary: Summary, progress) -> None:
    con.execute("CREATE OR REPLACE TEMP TABLE affected (episode_id VARCHAR PRIMARY KEY)")
    previous = con.execute("SELECT value FROM meta WHERE key = 'build_options'").fetchall()
    if previous and previous[0][0] != build.key():  # other trainable tokens: every episode changes
        con.execute("INSERT OR IGNORE INTO affected SELECT DISTINCT episode_id FROM call_tokens")
    if touched:
        con.register("_touched", pa.table({"episode_id": sorted(touched)}))
        con.execute("INSERT OR IGNORE INTO affected SELECT episode_id FROM _touched")
        con.unregister("_touched")
    # episodes whose reward changed, and episodes never built (pending or dropped earlier)
    con.execute(f"""
        INSERT OR IGNORE INTO affected
        SELECT n.episode_id FROM ({RESOLVED_REWARDS_SQL}) n LEFT JOIN old_rewards o USING (episode_id)
        WHERE (o.reward IS DISTINCT FROM n.reward OR o.task_id IS DISTINCT FROM n.task_id)
          AND n.episode_id IN (SELECT episode_id FROM call_tokens)""")
    con.execute("""
        INSERT OR IGNORE INTO affected SELECT DISTINCT episode_id FROM call_tokens
        WHERE episode_id NOT IN (SELECT episode_id FROM episodes)""")
    if policy is not None and policy.mode != "keep":
        con.execute("INSERT OR IGNORE INTO affected SELECT episode_id FROM episodes WHERE reward IS NULL")
    n_affected = con.execute("SELECT count(*) FROM affected").fetchone()[0]
    rewards = {
        e: (r, t)
        for e, r, t in con.execute(
            f"SELECT episode_id, reward, task_id FROM ({RESOLVED_REWARDS_SQL}) WHERE episode_id IN (SELECT episode_id FROM affected)"
        ).fetchall()
    }
    info = {  # the toolchain of the policy's calls where there are some
        e: (tc, run)
        for e, tc, run in con.execute(
            "SELECT episode_id, coalesce(any_value(toolchain) FILTER (WHERE list_contains(?, role)), "
            "any_value(toolchain)), any_value(run_id) FROM calls "
            "WHERE episode_id IN (SELECT episode_id FROM affected) GROUP BY episode_id", [build.train_roles]
        ).fetchall()
    }
    con.begin()
    try:
        con.execute("DELETE FROM samples WHERE episode_id IN (SELECT episode_id FROM affected)")
        con.execute("DELETE FROM episodes WHERE episode_id IN (SELECT episode_id FROM affected)")
        con.execute("DELETE FROM skipped WHERE file_id IN (SELECT 'episode:' || episode_id FROM affected)")
        samples = store.Buffer(con, "samples", SAMPLE_COLUMNS)
        episodes = store.Buffer(con, "episodes", EPISODE_COLUMNS)
        owners = store.Buffer(con, "_owners", ["call_id", "sample_id"])
        con.execute("CREATE OR REPLACE TEMP TABLE _owners (call_id VARCHAR, sample_id VARCHAR)")
        now = datetime.now(UTC)
        done = 0
        for episode_id, rows in _episode_rows(con):
            done += 1
            reward, task_id = rewards.get(episode_id, (None, None))
            if reward is None:
                summary.episodes_missing_reward += 1
                if policy is None:
                    summary.episodes_pending += 1
                    continue
                if policy.mode == "drop":
                    summary.episodes_dropped += 1
                    continue
                reward = policy.value  # fill:<x>, or None for keep
            toolchain, run_id = info.get(episode_id, (None, None))
            marks = [b.n for b in (samples, episodes, owners)]
            try:
                if isinstance(rows, Exception):
                    raise rows
                _build_episode(
                    con, retok, build, episode_id, rows, reward, task_id, toolchain, run_id, now, samples, episodes,
                    owners, summary,
                )
            except Exception as e:  # noqa: BLE001 - one episode that cannot be built never stops the run
                for b, n in zip((samples, episodes, owners), marks):
                    b.truncate(n)
                con.execute("INSERT INTO skipped VALUES (?, NULL, 'episode_failed', ?)",
                            [f"episode:{episode_id}", f"{type(e).__name__}: {e}"[:500]])
                summary.skipped["episode_failed"] += 1
            if samples.n >= FLUSH_EVERY or samples.cells >= FLUSH_CELLS:
                samples.flush()
            if progress:
                progress("episodes", done, n_affected)
        for b in (samples, episodes, owners):
            b.flush()
        con.execute(advantage_sql(advantage, group_by))
        con.execute("INSERT OR REPLACE INTO meta VALUES ('advantage', ?)", [advantage])
        con.execute("INSERT OR REPLACE INTO meta VALUES ('group_by', ?)", [group_by])
        con.execute("INSERT OR REPLACE INTO meta VALUES ('build_options', ?)", [build.key()])
        con.execute("""
            UPDATE samples SET advantage = e.advantage, reward = e.reward, weight = e.weight
            FROM episodes e WHERE samples.episode_id = e.episode_id
              AND (samples.advantage IS DISTINCT FROM e.advantage OR samples.reward IS DISTINCT FROM e.reward)""")
        con.execute("""
            UPDATE calls SET sample_id = o.sample_id FROM _owners o WHERE calls.call_id = o.call_id""")
        con.execute("""
            UPDATE calls SET sample_id = NULL WHERE episode_id IN (SELECT episode_id FROM affected)
              AND call_id NOT IN (SELECT call_id FROM _owners)""")
        con.commit()
    except BaseException:
        con.rollback()
        raise


# what pass 2 reads per call; the canonical conversation is fetched only for near-continuations
_TREE_COLUMNS = (
    "call_id, episode_id, token_source, prompt_ids, completion_ids, completion_logprobs, "
    "conv_hashes, conv_end, strict_hashes, strict_end, prefix_call_id, prefix_len"
)
_CALL_COLUMNS = ("role", "toolchain", "prompt_check")  # from `calls`, beside each call's tokens


def _episode_rows(con) -> Iterable[tuple[str, list[dict[str, Any]]]]:
    """Affected episodes' calls in start order, one episode at a time.

    Whole episodes are read per query until their token ids reach `READ_CELLS`, each result fully fetched
    before the caller writes anything: DuckDB refuses a new statement on a connection with an open streaming
    result. Token lists come out as numpy views of the Arrow buffers, never as Python lists.
    """
    sizes = con.execute("""
        SELECT episode_id, sum(coalesce(prefix_len, 0) + len(prompt_ids) + len(completion_ids)) FROM call_tokens
        WHERE episode_id IN (SELECT episode_id FROM affected) GROUP BY episode_id ORDER BY episode_id""").fetchall()
    cols = ", ".join("ct." + c.strip() for c in _TREE_COLUMNS.split(","))
    for chunk in _chunks_by_volume(sizes, READ_CELLS):
        con.register("_episode_chunk", pa.table({"episode_id": chunk}))
        rel = con.sql(f"""
            SELECT {cols}, {", ".join("c." + c for c in _CALL_COLUMNS)}
            FROM call_tokens ct JOIN _episode_chunk USING (episode_id) JOIN calls c USING (call_id)
            ORDER BY ct.episode_id, ct.t_start NULLS LAST, ct.seq, ct.call_id""")
        batch = (getattr(rel, "to_arrow_table", None) or rel.arrow)()  # renamed in duckdb 1.4
        con.unregister("_episode_chunk")
        lists = {c: _list_views(batch.column(c)) for c in ("prompt_ids", "completion_ids", "completion_logprobs")}
        plain = batch.select(["call_id", "episode_id", "token_source", "conv_hashes", "conv_end", "strict_hashes",
                              "strict_end", "prefix_call_id", "prefix_len", *_CALL_COLUMNS]).to_pylist()
        current, rows = None, []
        for n, row in enumerate(plain):
            for c, views in lists.items():
                row[c] = views[n]
            if row["episode_id"] != current and rows:
                yield current, _expanded(rows)
                rows = []
            current = row["episode_id"]
            rows.append(row)
        if rows:
            yield current, _expanded(rows)


def _expanded(rows: list[dict[str, Any]]) -> list[dict[str, Any]] | ValueError:
    """The episode's rows with whole prompts, or the reason they cannot have them (a damaged prefix chain)."""
    try:
        expand(rows)
    except ValueError as e:
        return e
    return rows


def _chunks_by_volume(sizes: list[tuple[str, int]], limit: int) -> Iterable[list[str]]:
    """Consecutive runs of episode ids whose sizes add up to at most `limit` (a larger episode goes alone)."""
    chunk: list[str] = []
    total = 0
    for episode_id, n in sizes:
        if chunk and total + n > limit:
            yield chunk
            chunk, total = [], 0
        chunk.append(episode_id)
        total += n
    if chunk:
        yield chunk


def _list_views(col: Any) -> list[np.ndarray | None]:
    """A list<int32|float32> Arrow column as one numpy view per row (None where NULL)."""
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    offsets = col.offsets.to_numpy()
    values = col.values.to_numpy(zero_copy_only=False)
    bitmap = col.buffers()[0]  # validity bitmap read directly: `is_valid()` would import pyarrow.compute (~0.15 s)
    valid = (
        np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")[col.offset : col.offset + len(col)].astype(bool)
        if bitmap is not None and col.null_count
        else np.full(len(col), not col.null_count or len(col) == 0)
    )
    return [values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(col))]


def _build_episode(con, retok, build: BuildOptions, episode_id, rows, reward, task_id, toolchain, run_id, now,
                   samples, episodes, owners, summary):
    """One trajectory tree per role (a validator's calls never share a chain with the agent's), samples from
    every tree; only the policy roles' completions are trainable, and the episode's weight is shared by the
    samples that train (so other roles' chains do not dilute it)."""
    by_role: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_role.setdefault(r["role"] or DEFAULT_ROLE, []).append(r)
    drift: Counter = Counter()
    built: list[tuple[str, list[TreeCall], Any]] = []
    for role, group in by_role.items():
        calls = [
            TreeCall(
                call_id=r["call_id"],
                prompt=r["prompt_ids"],
                completion=r["completion_ids"],
                logprobs=r["completion_logprobs"],
                token_source=r["token_source"],
                conv_prefixes=r["conv_hashes"],
                conv_end=r["conv_end"],
                trainable=build.trainable(role, r["prompt_check"]),
                toolchain=r["toolchain"],
            )
            for r in group
        ]
        parents = build_tree(calls)
        for i, j in near_misses(calls, parents):
            prev, cur = _classify_view(con, group[j]), _classify_view(con, group[i])
            prev_ids = np.concatenate([group[j]["prompt_ids"], group[j]["completion_ids"]]).tolist()
            drift[classify(retok, prev, cur, prev_ids)] += 1
        built.extend((role, calls, s) for s in chains(calls, parents))
    weight = 1.0 / max(1, sum(1 for _, _, s in built if s.loss_mask.any()))
    for n, (role, calls, s) in enumerate(built):
        sample_id = f"{episode_id}:{n}"
        n_trainable = int(s.loss_mask.sum())
        samples.add(
            sample_id=sample_id, episode_id=episode_id, run_id=run_id, task_id=task_id, tokenizer=retok.name,
            vocab_size=retok.vocab_size, token_source=s.token_source, input_ids=s.input_ids, loss_mask=s.loss_mask,
            behaviour_logprobs=s.logprobs, n_tokens=len(s.input_ids), n_trainable=n_trainable, n_calls=len(s.path),
            reward=reward, advantage=None, weight=weight, created_at=now, role=role,
            toolchain=calls[s.path[-1]].toolchain,
        )
        for i in s.owned:
            owners.add(call_id=calls[i].call_id, sample_id=sample_id)
        summary.samples += 1
        summary.tokens += len(s.input_ids)
        summary.trainable_tokens += n_trainable
    episodes.add(
        episode_id=episode_id, run_id=run_id, task_id=task_id, toolchain=toolchain, n_calls=len(rows),
        n_samples=len(built), reward=reward, weight=weight,
        **{f"drift_{c}": drift[c] for c in DRIFT_CLASSES},
    )
    summary.drift.update(drift)
    summary.episodes += 1


def _classify_view(con, row: dict[str, Any]) -> dict[str, Any]:
    """The canonical call for drift classification: per-call JSON (older databases) or `call_messages`."""
    [(messages, tools, completion)] = con.execute(
        "SELECT messages, tools, completion FROM call_tokens WHERE call_id = ?", [row["call_id"]]
    ).fetchall()
    if messages is None:
        hashes = row["strict_hashes"]
        stored = dict(con.execute(
            "SELECT hash, message FROM call_messages WHERE list_contains(?, hash)", [hashes]
        ).fetchall())
        if all(h in stored for h in hashes):
            tools = stored[hashes[0]]
            messages = "[" + ",".join(stored[h] for h in hashes[1:]) + "]"
    return {
        "messages": json.loads(messages) if messages else None,
        "tools": json.loads(tools) if tools else None,
        "completion": json.loads(completion) if completion else None,
        "strict_hashes": row["strict_hashes"],
        "strict_end": row["strict_end"],
        "prompt_ids": row["prompt_ids"].tolist(),
    }
