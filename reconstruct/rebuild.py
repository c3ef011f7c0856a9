"""Pass 2 of a run: the episodes pass 1 touched (or whose reward changed) -> trajectory trees -> samples.

One episode in memory at a time, read back from `call_tokens`: one trajectory tree per role, one sample per
root-to-leaf chain, the episode's reward and weight, then every group's advantage. Everything an episode
had before is replaced in one transaction.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa

from openforge.reconstruct import store
from openforge.reconstruct.drift import classify_drift
from openforge.reconstruct.ingest import DEFAULT_ROLE
from openforge.reconstruct.prefixes import expand
from openforge.reconstruct.rewards import RESOLVED_REWARDS_SQL, MissingReward, advantage_sql
from openforge.reconstruct.summary import Summary
from openforge.reconstruct.tokenize import Retokenizer
from openforge.reconstruct.trajectories import DRIFT_CLASSES, SampleRow, TreeCall, build_tree, chains, near_misses
from openforge.reconstruct.vision import image_pad_id, pad_runs
from openforge.samples import SAMPLE_COLUMNS, list_arrays

if TYPE_CHECKING:
    import duckdb

Progress = Callable[[str, int, int], None]  # (stage, done, total)
READ_CELLS = 1_000_000  # whole episodes are read until their token ids reach this many (at least one episode)

NEW_SAMPLE_COLUMNS = [c for c in SAMPLE_COLUMNS if c != "group_id"]  # `_finish` sets it with the advantages
SAMPLE_IMAGE_COLUMNS = ["sample_id", "idx", "hash", "token_start", "n_tokens", "grid_t", "grid_h", "grid_w"]
EPISODE_COLUMNS = [
    "episode_id", "run_id", "task_id", "toolchain", "n_calls", "n_samples", "reward", "weight",
    "drift_template", "drift_retokenization", "drift_client_rewrite", "drift_other",
]
# what pass 2 reads per call; the canonical conversation is fetched only for near-continuations
_TREE_COLUMNS = (
    "call_id", "episode_id", "token_source", "prompt_ids", "completion_ids", "completion_logprobs",
    "conv_hashes", "conv_end", "strict_hashes", "strict_end", "prefix_call_id", "prefix_len",
)
_CALL_COLUMNS = ("role", "toolchain", "prompt_check", "policy_version")  # from `calls`, beside each call's tokens
_LIST_COLUMNS = ("prompt_ids", "completion_ids", "completion_logprobs")  # read as numpy views

Row = dict[str, Any]  # one call of an episode: _TREE_COLUMNS + _CALL_COLUMNS


class CallImage(NamedTuple):
    """One image of a call's prompt (`call_images`): where its pad run starts and the grid it came from."""

    hash: str
    token_start: int
    n_tokens: int
    grid_t: int
    grid_h: int
    grid_w: int
    processor: str


@dataclass(frozen=True)
class BuildOptions:
    """What decides which tokens are trainable; a run with other options than the last rebuilds every episode."""

    train_roles: list[str]
    keep_prompt_mismatch: bool = False

    def trainable(self, role: str | None, prompt_check: str | None) -> bool:
        return (role or DEFAULT_ROLE) in self.train_roles and (self.keep_prompt_mismatch or prompt_check != "mismatch")

    def key(self) -> str:
        return json.dumps({"train_roles": self.train_roles, "keep_prompt_mismatch": self.keep_prompt_mismatch})


class Episode(NamedTuple):
    """An episode's facts that are not its calls."""

    episode_id: str
    reward: float | None
    task_id: str | None
    toolchain: str | None  # of its policy calls where it has some
    run_id: str | None


def snapshot_rewards(con: duckdb.DuckDBPyConnection) -> None:
    """Keep each episode's reward as it stands before pass 1, so pass 2 rebuilds those whose reward changed."""
    con.execute(f"CREATE OR REPLACE TEMP TABLE old_rewards AS {RESOLVED_REWARDS_SQL}")


class Rebuild:
    """Pass 2 over one connection: builds episodes into buffered `samples` and `episodes` rows."""

    def __init__(self, con: duckdb.DuckDBPyConnection, retok: Retokenizer, build: BuildOptions,
                 summary: Summary) -> None:
        self.con, self.retok, self.build, self.summary = con, retok, build, summary
        self.samples = store.Buffer(con, "samples", NEW_SAMPLE_COLUMNS)
        self.episodes = store.Buffer(con, "episodes", EPISODE_COLUMNS)
        self.owners = store.Buffer(con, "_owners", ["call_id", "sample_id"])  # which sample trains a call
        self.sample_images = store.Buffer(con, "sample_images", SAMPLE_IMAGE_COLUMNS)
        self.images: dict[str, list[CallImage]] = {}  # of the affected episodes' calls that have images
        self.pad_id = image_pad_id(retok.tok)
        self.now = datetime.now(UTC)

    def run(self, touched: set[str], policy: MissingReward | None, advantage: str, group_by: str,
            progress: Progress | None = None) -> None:
        """Rebuild the affected episodes, then every group's advantage; one transaction."""
        con = self.con
        n_affected = self._find_affected(touched, policy)
        facts = self._episode_facts()
        self.images = self._call_images()
        con.begin()
        try:
            con.execute("""DELETE FROM sample_images WHERE sample_id IN
                           (SELECT sample_id FROM samples WHERE episode_id IN (SELECT episode_id FROM affected))""")
            con.execute("DELETE FROM samples WHERE episode_id IN (SELECT episode_id FROM affected)")
            con.execute("DELETE FROM episodes WHERE episode_id IN (SELECT episode_id FROM affected)")
            con.execute("DELETE FROM skipped WHERE file_id IN (SELECT 'episode:' || episode_id FROM affected)")
            con.execute("CREATE OR REPLACE TEMP TABLE _owners (call_id VARCHAR, sample_id VARCHAR)")
            self.now = datetime.now(UTC)
            done = 0
            for episode_id, rows in _episode_rows(con):
                done += 1
                episode = facts.get(episode_id, Episode(episode_id, None, None, None, None))
                if episode.reward is None:
                    self.summary.episodes_missing_reward += 1
                    if policy is None:
                        self.summary.episodes_pending += 1
                        continue
                    if policy.mode == "drop":
                        self.summary.episodes_dropped += 1
                        continue
                    episode = episode._replace(reward=policy.value)  # fill:<x>, or None for keep
                self._episode(episode, rows)
                if self.samples.n >= store.FLUSH_EVERY or self.samples.cells >= store.FLUSH_CELLS:
                    self.samples.flush()
                if progress:
                    progress("episodes", done, n_affected)
            for b in (self.samples, self.episodes, self.owners, self.sample_images):
                b.flush()
            self._finish(advantage, group_by)
            con.commit()
        except BaseException:
            con.rollback()
            raise

    def _find_affected(self, touched: set[str], policy: MissingReward | None) -> int:
        """Fill the temp table `affected` with the episodes to rebuild; how many there are."""
        con = self.con
        con.execute("CREATE OR REPLACE TEMP TABLE affected (episode_id VARCHAR PRIMARY KEY)")
        previous = con.execute("SELECT value FROM meta WHERE key = 'build_options'").fetchall()
        if previous and previous[0][0] != self.build.key():  # other trainable tokens: every episode changes
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
        row = con.execute("SELECT count(*) FROM affected").fetchone()
        return int(row[0]) if row else 0

    def _episode_facts(self) -> dict[str, Episode]:
        """Reward, task, toolchain (of the policy's calls where there are some) and run of each affected episode."""
        rewards = {
            e: (r, t)
            for e, r, t in self.con.execute(
                f"SELECT episode_id, reward, task_id FROM ({RESOLVED_REWARDS_SQL}) "
                "WHERE episode_id IN (SELECT episode_id FROM affected)"
            ).fetchall()
        }
        calls = self.con.execute(
            "SELECT episode_id, coalesce(any_value(toolchain) FILTER (WHERE list_contains(?, role)), "
            "any_value(toolchain)), any_value(run_id) FROM calls "
            "WHERE episode_id IN (SELECT episode_id FROM affected) GROUP BY episode_id", [self.build.train_roles]
        ).fetchall()
        info = {e: (tc, run) for e, tc, run in calls}
        episodes = rewards.keys() | info.keys()
        return {e: Episode(e, *rewards.get(e, (None, None)), *info.get(e, (None, None))) for e in episodes}

    def _call_images(self) -> dict[str, list[CallImage]]:
        """The images of the affected episodes' calls, in prompt order (each processor's settings held once)."""
        out: dict[str, list[CallImage]] = {}
        settings: dict[str, str] = {}
        for call_id, h, start, n, t, gh, gw, processor in self.con.execute("""
                SELECT ci.call_id, ci.hash, ci.token_start, ci.n_tokens, ci.grid_t, ci.grid_h, ci.grid_w, ci.processor
                FROM call_images ci JOIN call_tokens ct USING (call_id)
                WHERE ct.episode_id IN (SELECT episode_id FROM affected) ORDER BY ci.call_id, ci.idx""").fetchall():
            image = CallImage(h, start, n, t, gh, gw, settings.setdefault(processor, processor))
            out.setdefault(call_id, []).append(image)
        return out

    def _episode(self, episode: Episode, rows: list[Row] | ValueError) -> None:
        """Build one episode; one that cannot be built goes to `skipped` (`episode_failed`), never the run."""
        buffers = (self.samples, self.episodes, self.owners, self.sample_images)
        marks = [b.n for b in buffers]
        try:
            if isinstance(rows, Exception):
                raise rows
            self._build(episode, rows)
        except Exception as e:  # noqa: BLE001 - one episode that cannot be built never stops the run
            for b, n in zip(buffers, marks):
                b.truncate(n)
            self.con.execute("INSERT INTO skipped VALUES (?, NULL, 'episode_failed', ?)",
                             [f"episode:{episode.episode_id}", f"{type(e).__name__}: {e}"[:500]])
            self.summary.skipped["episode_failed"] += 1

    def _build(self, episode: Episode, rows: list[Row]) -> None:
        """One trajectory tree per role (a validator's calls never share a chain with the agent's), samples from
        every tree; only the policy roles' completions are trainable, and the episode's weight is shared by the
        samples that train (so other roles' chains do not dilute it)."""
        by_role: dict[str, list[Row]] = {}
        for r in rows:
            by_role.setdefault(r["role"] or DEFAULT_ROLE, []).append(r)
        drift: Counter[str] = Counter()
        built: list[tuple[str, list[TreeCall], SampleRow]] = []
        for role, group in by_role.items():
            calls = [self._tree_call(role, r) for r in group]
            parents = build_tree(calls)
            for i, j in near_misses(calls, parents):
                drift[self._drift(group[j], group[i])] += 1
            built.extend((role, calls, s) for s in chains(calls, parents))
        built = [b for b in built if self._images_match(episode.episode_id, b[1], b[2])]
        weight = 1.0 / max(1, sum(1 for _, _, s in built if s.loss_mask.any()))
        summary = self.summary
        for n, (role, calls, s) in enumerate(built):
            sample_id = f"{episode.episode_id}:{n}"
            n_trainable = int(s.loss_mask.sum())
            images = self.images.get(calls[s.path[-1]].call_id, [])
            for idx, im in enumerate(images):
                self.sample_images.add(sample_id=sample_id, idx=idx, hash=im.hash, token_start=im.token_start,
                                       n_tokens=im.n_tokens, grid_t=im.grid_t, grid_h=im.grid_h, grid_w=im.grid_w)
            self.samples.add(
                sample_id=sample_id, episode_id=episode.episode_id, run_id=episode.run_id, task_id=episode.task_id,
                tokenizer=self.retok.name, vocab_size=self.retok.vocab_size, token_source=s.token_source,
                input_ids=s.input_ids, loss_mask=s.loss_mask, behaviour_logprobs=s.logprobs,
                n_tokens=len(s.input_ids), n_trainable=n_trainable, n_calls=len(s.path), reward=episode.reward,
                advantage=None, weight=weight, created_at=self.now, role=role, toolchain=calls[s.path[-1]].toolchain,
                policy_version=sample_policy_version(calls, s), n_images=len(images),
                processor=images[0].processor if images else None,
            )
            for i in s.owned:
                self.owners.add(call_id=calls[i].call_id, sample_id=sample_id)
            summary.samples += 1
            summary.tokens += len(s.input_ids)
            summary.trainable_tokens += n_trainable
        self.episodes.add(
            episode_id=episode.episode_id, run_id=episode.run_id, task_id=episode.task_id,
            toolchain=episode.toolchain, n_calls=len(rows), n_samples=len(built), reward=episode.reward,
            weight=weight, **{f"drift_{c}": drift[c] for c in DRIFT_CLASSES},
        )
        summary.drift.update(drift)
        summary.episodes += 1

    def _images_match(self, episode_id: str, calls: list[TreeCall], s: SampleRow) -> bool:
        """Whether the sample's pad runs are its images' (those of its last call, whose prompt holds the chain):
        one run per image, where it starts, of its length, all grids from one processor. A sample that does
        not goes to `skipped` (`sample_image_mismatch`) rather than to the trainer wrong."""
        images = self.images.get(calls[s.path[-1]].call_id)
        if not images:
            return True
        runs = pad_runs(s.input_ids, self.pad_id) if self.pad_id is not None else []
        expected = [(im.token_start, im.n_tokens) for im in images]
        if runs == expected and len({im.processor for im in images}) == 1:
            return True
        self.con.execute("INSERT INTO skipped VALUES (?, ?, 'sample_image_mismatch', ?)", [
            f"episode:{episode_id}", calls[s.path[-1]].call_id,
            f"image pad runs (start, length) expected {expected[:10]}, found {runs[:10]}"[:500]])
        self.summary.skipped["sample_image_mismatch"] += 1
        return False

    def _tree_call(self, role: str, r: Row) -> TreeCall:
        return TreeCall(
            call_id=r["call_id"], prompt=r["prompt_ids"], completion=r["completion_ids"],
            logprobs=r["completion_logprobs"], token_source=r["token_source"], conv_prefixes=r["conv_hashes"],
            conv_end=r["conv_end"], trainable=self.build.trainable(role, r["prompt_check"]), toolchain=r["toolchain"],
            policy_version=r["policy_version"],
        )

    def _drift(self, prev: Row, cur: Row) -> str:
        """The class of a near-continuation: `cur`'s conversation continues `prev`'s, its tokens do not."""
        prev_ids = np.concatenate([prev["prompt_ids"], prev["completion_ids"]]).tolist()
        return classify_drift(self.retok, self._classify_view(prev), self._classify_view(cur), prev_ids)

    def _classify_view(self, row: Row) -> dict[str, Any]:
        """The canonical call for drift classification, its conversation read back from `call_messages`
        (`messages` is the JSON `null` for a call that had a prompt text, not a conversation)."""
        [(messages, completion)] = self.con.execute(
            "SELECT messages, completion FROM call_tokens WHERE call_id = ?", [row["call_id"]]
        ).fetchall()
        tools = None
        if messages is None:
            hashes = row["strict_hashes"]
            stored = dict(self.con.execute(
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

    def _finish(self, advantage: str, group_by: str) -> None:
        """Advantages of every group, the options this run used, and each call's owning sample."""
        con = self.con
        con.execute(advantage_sql(advantage, group_by))
        con.execute("INSERT OR REPLACE INTO meta VALUES ('advantage', ?)", [advantage])
        con.execute("INSERT OR REPLACE INTO meta VALUES ('group_by', ?)", [group_by])
        con.execute("INSERT OR REPLACE INTO meta VALUES ('build_options', ?)", [self.build.key()])
        con.execute("""
            UPDATE samples SET advantage = e.advantage, reward = e.reward, weight = e.weight, group_id = e.group_id
            FROM episodes e WHERE samples.episode_id = e.episode_id
              AND (samples.advantage IS DISTINCT FROM e.advantage OR samples.reward IS DISTINCT FROM e.reward
                   OR samples.group_id IS DISTINCT FROM e.group_id)""")
        con.execute("""
            UPDATE calls SET sample_id = o.sample_id FROM _owners o WHERE calls.call_id = o.call_id""")
        con.execute("""
            UPDATE calls SET sample_id = NULL WHERE episode_id IN (SELECT episode_id FROM affected)
              AND call_id NOT IN (SELECT call_id FROM _owners)""")


def sample_policy_version(calls: list[TreeCall], s: SampleRow) -> int | None:
    """The oldest policy that produced a token this sample trains on (of the chain's calls when it trains on
    none), None when one of them recorded no version: a `policy_version >= n` selection then holds no token
    of an older policy, nor one of an unknown policy."""
    which = [i for i in s.owned if calls[i].trainable] or s.path
    versions = [v for i in which if (v := calls[i].policy_version) is not None]
    return min(versions) if len(versions) == len(which) else None


def _episode_rows(con: duckdb.DuckDBPyConnection) -> Iterator[tuple[str, list[Row] | ValueError]]:
    """Affected episodes' calls in start order, one episode at a time.

    Whole episodes are read per query until their token ids reach `READ_CELLS`, each result fully fetched
    before the caller writes anything: DuckDB refuses a new statement on a connection with an open streaming
    result. Token lists come out as numpy views of the Arrow buffers, never as Python lists.
    """
    sizes = con.execute("""
        SELECT episode_id, sum(coalesce(prefix_len, 0) + len(prompt_ids) + len(completion_ids)) FROM call_tokens
        WHERE episode_id IN (SELECT episode_id FROM affected) GROUP BY episode_id ORDER BY episode_id""").fetchall()
    cols = ", ".join([*("ct." + c for c in _TREE_COLUMNS), *("c." + c for c in _CALL_COLUMNS)])
    plain_columns = [c for c in (*_TREE_COLUMNS, *_CALL_COLUMNS) if c not in _LIST_COLUMNS]
    for chunk in _chunks_by_volume(sizes, READ_CELLS):
        con.register("_episode_chunk", pa.table({"episode_id": chunk}))
        rel = con.sql(f"""
            SELECT {cols}
            FROM call_tokens ct JOIN _episode_chunk USING (episode_id) JOIN calls c USING (call_id)
            ORDER BY ct.episode_id, ct.t_start NULLS LAST, ct.seq, ct.call_id""")
        batch = (getattr(rel, "to_arrow_table", None) or rel.arrow)()  # renamed in duckdb 1.4
        con.unregister("_episode_chunk")
        lists = {c: list_arrays(batch.column(c)) for c in _LIST_COLUMNS}
        plain = batch.select(plain_columns).to_pylist()
        current: str = ""
        rows: list[Row] = []
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


def _expanded(rows: list[Row]) -> list[Row] | ValueError:
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
