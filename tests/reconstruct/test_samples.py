"""openforge/samples.py, the DuckDB contract's reader: the schema version check, one `Selection`, one Arrow list
conversion, and the GRPO group id reconstruct stores once for the advantages, the trainer and export."""

from __future__ import annotations

import re
from pathlib import Path

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from openforge import samples
from openforge.reconstruct import reconstruct, store
from openforge.reconstruct.rewards import advantage_sql
from openforge.samples import SchemaError, Selection, connect, list_arrays, rl_window
from openforge.testing.reconstruct_flows import FlowFactory, qwen_retokenizer
from openforge.trainer.config import TrainConfig
from openforge.trainer.data import DataError, SampleSource, nothing_to_learn


def add_sample(con: duckdb.DuckDBPyConnection, sample_id: str, episode_id: str, version: int | None = 0,
               trainable: int = 1, advantage: float = 1.0) -> None:
    con.execute("INSERT INTO samples (sample_id, episode_id, tokenizer, vocab_size, token_source, input_ids, "
                "loss_mask, n_tokens, n_trainable, n_calls, advantage, weight, created_at, policy_version) VALUES "
                "(?, ?, 'tok', 10, 'engine', [1, 2], [0, 1], 2, ?, 1, ?, 1.0, now(), ?)",
                [sample_id, episode_id, trainable, advantage, version])


def selected(db: Path, selection: Selection) -> list[str]:
    with connect(db) as con:
        return [r[0] for r in con.execute(f"SELECT sample_id FROM samples WHERE {selection.sql()} ORDER BY 1")
                .fetchall()]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    """Samples of four episodes over policy versions 0-2, one untrainable, and RL iterations 0-2 naming them."""
    path = tmp_path / "db.duckdb"
    with store.connect(path) as con:
        for sid, ep, version in [("a", "e0", 0), ("b", "e1", 1), ("c", "it's", 2), ("d", "e3", 2)]:
            add_sample(con, sid, ep, version)
        add_sample(con, "z", "e0", 0, trainable=0)
        store.record_rl_iteration(con, 0, [("e0", "t", None, 0, "ok", 1.0)], [])
        store.record_rl_iteration(con, 1, [("e1", "t", None, 0, "ok", 1.0)], [])
        store.record_rl_iteration(con, 2, [("it's", "t", None, 0, "ok", 1.0), ("e3", "t", None, 0, "ok", 0.0)],
                                  [("e3", 0.0, 1.0)])
    return path


def test_connect_refuses_another_schema_version_naming_the_command(db: Path, tmp_path: Path) -> None:
    with connect(db) as con:
        assert con.execute("SELECT count(*) FROM samples").fetchone() == (5,)
    rebuild = "reconstruct the flow files into a new database"
    for version, fix in [("6", f"run `openforge reconstruct FLOWS --db {db}` once"), ("1", rebuild), ("99", rebuild)]:
        with duckdb.connect(str(db)) as con:
            con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [version])
        with pytest.raises(SchemaError, match=f"schema version {version}, this OpenForge reads 7: {re.escape(fix)}"):
            connect(db)
    with pytest.raises(SchemaError, match="no database at"):
        connect(tmp_path / "none.duckdb")
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).close()
    with pytest.raises(SchemaError, match="did not write"):
        connect(other)
    (tmp_path / "text.duckdb").write_text("not a database\n")
    with pytest.raises(SchemaError, match="cannot open DuckDB file"):
        connect(tmp_path / "text.duckdb")


def test_the_reader_and_the_writer_agree_on_the_version_and_the_columns(tmp_path: Path) -> None:
    assert samples.MIGRATED_FROM == tuple(store.MIGRATIONS)
    assert f"('schema_version', '{samples.SCHEMA_VERSION}')" in store.schema_sql()
    with store.connect(tmp_path / "db.duckdb") as con:
        columns = [r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name "
                                             "= 'samples' ORDER BY ordinal_position").fetchall()]
    assert tuple(columns) == samples.SAMPLE_COLUMNS


def test_selection_sql(db: Path) -> None:
    assert selected(db, Selection()) == ["a", "b", "c", "d"]  # never an untrainable sample
    assert selected(db, Selection(where="policy_version > 0")) == ["b", "c", "d"]
    assert selected(db, Selection(versions=(1, 2))) == ["b", "c", "d"]
    assert selected(db, Selection(episodes=("it's", "e0"))) == ["a", "c"]
    assert selected(db, Selection(episodes=())) == []
    assert selected(db, Selection(iterations=(1, 2))) == ["b", "c"]  # e3's reward disagreed with its result
    assert selected(db, Selection(where="sample_id <> 'b'", versions=(0, 2), iterations=(0, 2))) == ["a", "c"]


def test_rl_window() -> None:
    assert rl_window(5, 3) == Selection(versions=(3, 5), iterations=(3, 5))
    assert rl_window(1, 4) == Selection(versions=(0, 1), iterations=(0, 1))


def test_record_rl_iteration_replaces_the_iteration(db: Path) -> None:
    with store.connect(db) as con:
        store.record_rl_iteration(con, 2, [("e3", "t", "tc", 1, "ok", 1.0)], [])
        assert con.execute("SELECT iteration, episode_id, toolchain, attempt FROM rl_episodes ORDER BY 1").fetchall() \
            == [(0, "e0", None, 0), (1, "e1", None, 0), (2, "e3", "tc", 1)]
        assert con.execute("SELECT count(*) FROM rl_reward_mismatches").fetchone() == (0,)


def test_list_arrays_reads_sliced_and_chunked_columns() -> None:
    full = pa.array([[1, 2], None, [3], [], [4, 5, 6]], pa.list_(pa.int32()))
    # a NULL backed by values: what a slice's offsets and a NULL's range must not misread
    backed = pa.ListArray.from_arrays(pa.array([0, 2, 4, 5], pa.int32()), pa.array([1, 2, 9, 9, 3], pa.int32()),
                                      mask=pa.array([False, True, False]))
    cases = [
        (full, [[1, 2], None, [3], [], [4, 5, 6]]),
        (full.slice(2), [[3], [], [4, 5, 6]]),
        (full.slice(1, 2), [None, [3]]),
        (backed.slice(1), [None, [3]]),
        (backed, [[1, 2], None, [3]]),
        (pa.chunked_array([full.slice(3), backed.slice(2)]), [[], [4, 5, 6], [3]]),
        (full.slice(5), []),
    ]
    for column, want in cases:
        got = list_arrays(column, np.int64)
        assert [None if a is None else a.tolist() for a in got] == want
        assert all(a.dtype == np.int64 for a in got if a is not None)
    assert list_arrays(full.slice(4))[0].dtype == np.int32  # no dtype: views of the stored values


def test_group_id_is_stored_once_and_is_what_the_advantages_compared(tmp_path: Path) -> None:
    """Two policy versions of one task and an episode without a task: every sample carries its episode's
    stored group, and each episode's advantage is GRPO within the episodes of its group id."""
    flows = FlowFactory(tmp_path / "flows", seed=3)
    plan = [("p0", 0, 1.0, "fix"), ("p1", 0, 0.0, "fix"), ("q0", 1, 1.0, "fix"), ("q1", 1, 0.5, "fix"),
            ("q2", 1, 0.0, "fix"), ("r0", 1, 0.3, None)]
    for episode, version, reward, task in plan:
        flows.policy_version = version
        flows.tool_loop(episode, turns=1, engine_ids=True)
        flows.write(flows.reward(episode, reward, task))
    flows.close()
    db = tmp_path / "db.duckdb"
    reconstruct([tmp_path / "flows"], db, qwen_retokenizer(), run="r1")
    with connect(db) as con:
        episodes = {e: (g, r, a) for e, g, r, a in
                    con.execute("SELECT episode_id, group_id, reward, advantage FROM episodes").fetchall()}
        per_sample = con.execute("SELECT DISTINCT s.episode_id, s.group_id = e.group_id FROM samples s "
                                 "JOIN episodes e USING (episode_id)").fetchall()
    assert {e: g for e, (g, _, _) in episodes.items()} == {
        "p0": "task:fix@v0", "p1": "task:fix@v0", "q0": "task:fix@v1", "q1": "task:fix@v1", "q2": "task:fix@v1",
        "r0": "run:r1@v1"}
    assert sorted(per_sample) == sorted((e, True) for e in episodes)
    for group in {g for g, _, _ in episodes.values()}:
        rewards = np.array([r for g, r, _ in episodes.values() if g == group])
        want = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-4) if len(rewards) > 1 else 0 * rewards
        assert np.allclose([a for g, _, a in episodes.values() if g == group], want)


def test_migration_from_6_stores_the_groups_of_the_last_runs_grouping(tmp_path: Path) -> None:
    db = tmp_path / "db.duckdb"
    with store.connect(db) as con:
        for ep, toolchain, reward in [("a", "x", 1.0), ("b", "x", 0.0), ("c", "y", 1.0)]:
            con.execute("INSERT INTO episodes (episode_id, task_id, toolchain, n_calls, n_samples, reward, weight) "
                        "VALUES (?, 't', ?, 1, 1, ?, 1.0)", [ep, toolchain, reward])
            con.execute("INSERT INTO calls (call_id, file_id, episode_id, protocol, streamed, token_source, "
                        "policy_version) VALUES (?, 'f', ?, 'chat', false, 'engine', 4)", [f"c-{ep}", ep])
            add_sample(con, f"s-{ep}", ep, 4)
        con.execute(advantage_sql("grpo", "task-toolchain"))
        con.execute("INSERT OR REPLACE INTO meta VALUES ('group_by', 'task-toolchain')")
        con.execute("UPDATE samples SET group_id = e.group_id FROM episodes e WHERE samples.episode_id = e.episode_id")
        fresh = con.execute("SELECT sample_id, group_id FROM samples ORDER BY 1").fetchall()
        con.execute("ALTER TABLE samples DROP COLUMN group_id")
        con.execute("ALTER TABLE episodes DROP COLUMN group_id")
        con.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")
    with pytest.raises(SchemaError, match="schema version 6"):
        connect(db)
    store.connect(db).close()  # what `openforge reconstruct` does first
    with connect(db) as con:
        assert con.execute("SELECT sample_id, group_id FROM samples ORDER BY 1").fetchall() == fresh
    assert [g for _, g in fresh] == ["task:t/x@v4", "task:t/x@v4", "task:t/y@v4"]


def test_nothing_to_learn_says_why(db: Path) -> None:
    ppo = TrainConfig(db=str(db))
    with store.connect(db) as con:
        con.execute("UPDATE samples SET group_id = 'g-' || episode_id")
    assert nothing_to_learn(db, Selection(), ppo) == ""
    with store.connect(db) as con:
        con.execute("UPDATE samples SET advantage = 0")
    assert nothing_to_learn(db, Selection(), ppo) == "every group had equal rewards (4 groups)"
    assert nothing_to_learn(db, Selection(), TrainConfig(db=str(db), keep_zero_advantage=True)) == ""
    assert nothing_to_learn(db, Selection(episodes=()), ppo) == "no trainable samples in this iteration's episodes"


def test_the_trainer_refuses_another_schema_version(db: Path) -> None:
    with SampleSource(str(db), Selection(versions=(2, 2)), shuffle=False) as source:
        assert [s.sample_id for s in source.samples(0)] == ["c", "d"]
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")
    with pytest.raises(DataError, match="schema version 6, this OpenForge reads 7: run `openforge reconstruct"):
        SampleSource(str(db))
