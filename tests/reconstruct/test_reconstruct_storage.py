"""How reconstruct stores calls: prompts as suffixes of the episode's previous call (engine prompt ids
parsed only past it), a transaction per batch (a run that dies mid-file resumes), databases of older schema
versions migrated in place or refused with a rebuild message, and no column that nothing writes."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import msgpack
import numpy as np
import pytest

from openforge.reconstruct import Summary, answer_json, calls, reconstruct, store
from openforge.reconstruct.answer_json import RawIds
from openforge.reconstruct.ingest import Ingest
from openforge.reconstruct.prefixes import PrefixSplitter, expand, int32
from openforge.samples import SCHEMA_VERSION
from openforge.testing.reconstruct_flows import FlowFactory, db_rows

SAMPLES = "SELECT * EXCLUDE (created_at) FROM samples ORDER BY sample_id"


def corpus(directory: Path, seed: int = 3) -> FlowFactory:
    """A merging tool loop, a loop whose new user turns branch (Qwen3 drops old reasoning), a retokenized one."""
    f = FlowFactory(directory, seed=seed)
    f.tool_loop("loop", turns=4, engine_ids=True, stream=True)
    f.tool_loop("branchy", turns=3, engine_ids=True, new_user_turns=True)
    f.tool_loop("retok", turns=2, engine_ids=False)
    f.close()
    return f


def run(db: Path, flows: Path, retok) -> Summary:
    return reconstruct([flows], db, retok, missing_reward="keep")


def no_split(self, episode, call_id, prompt, completion):
    return None, 0, int32(prompt.parse() if isinstance(prompt, RawIds) else prompt)


def test_prompts_stored_as_suffixes_rebuild_the_same_samples(tmp_path, retok, monkeypatch):
    corpus(tmp_path / "flows")
    run(tmp_path / "split.duckdb", tmp_path / "flows", retok)
    stored, full = db_rows(tmp_path / "split.duckdb", """
        SELECT sum(len(prompt_ids)) AS stored, sum(coalesce(prefix_len, 0) + len(prompt_ids)) AS whole
        FROM call_tokens""")[0].values()
    usage = db_rows(tmp_path / "split.duckdb", "SELECT sum(prompt_tokens) n FROM calls")[0]["n"]
    assert full == usage and stored < full / 3  # every prompt token accounted for, most stored once
    monkeypatch.setattr(PrefixSplitter, "split", no_split)
    run(tmp_path / "whole.duckdb", tmp_path / "flows", retok)
    prefixed = "SELECT count(*) n FROM call_tokens WHERE prefix_call_id IS NOT NULL"
    assert db_rows(tmp_path / "whole.duckdb", prefixed)[0]["n"] == 0
    a, b = (json.dumps(db_rows(tmp_path / f"{n}.duckdb", SAMPLES), default=str) for n in ("split", "whole"))
    assert a == b and len(json.loads(a)) >= 4


def test_prompt_ids_parsed_only_past_the_previous_call_give_the_same_samples(tmp_path, retok, monkeypatch):
    corpus(tmp_path / "flows")
    tails = []
    tail_after = RawIds.tail_after
    monkeypatch.setattr(RawIds, "tail_after",
                        lambda self, earlier: tails.append(tail_after(self, earlier)) or tails[-1])
    run(tmp_path / "text.duckdb", tmp_path / "flows", retok)
    assert sum(t is not None for t in tails) >= 4  # streamed and not: the shortcut was taken
    monkeypatch.setattr(calls, "loads_answer", answer_json.loads)  # every id parsed, as before
    run(tmp_path / "parsed.duckdb", tmp_path / "flows", retok)
    for sql in (SAMPLES, "SELECT * EXCLUDE (t_start) FROM call_tokens ORDER BY call_id"):
        a, b = (json.dumps(db_rows(tmp_path / f"{n}.duckdb", sql), default=str) for n in ("text", "parsed"))
        assert a == b


def _plain(obj):
    """`loads_answer`'s result with every RawIds parsed: must equal what json.loads gives."""
    if isinstance(obj, RawIds):
        return obj.parse()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return [_plain(v) for v in obj] if isinstance(obj, list) else obj


@pytest.mark.parametrize("body, kept", [
    (b'{"choices": [{"index": 0}], "prompt_token_ids": [1, 2, 3]}', True),
    (b'{"choices": [{"index": 0, "prompt_token_ids":[4,5]}]}', True),
    ('{"choices": [], "prompt_token_ids" : [\n6 ,7]}', True),  # SSE data arrives as text
    (b'{"content": "say \\"prompt_token_ids\\": [1]", "prompt_token_ids": [7]}', True),
    (b'{"prompt_token_ids": [1], "choices": [{"prompt_token_ids": [1]}]}', False),  # two: parsed normally
    (b'{"prompt_token_ids": [[1, 2], [3]]}', False),
    (b'{"prompt_token_ids": []}', False),
    (b'{"prompt_token_ids": null, "choices": []}', False),
    (b'{"sglext": {"prompt_token_ids": [1, 2]}}', False),  # not where ids are read: parsed normally
])
def test_loads_answer_keeps_one_prompt_id_array_as_text(body, kept):
    obj = answer_json.loads_answer(body)
    holders = [obj, *obj.get("choices", [])]
    assert any(isinstance(h.get("prompt_token_ids"), RawIds) for h in holders) == kept
    assert _plain(obj) == json.loads(body)


def test_loads_answer_still_rejects_bad_json():
    for bad in (b'{"prompt_token_ids": [1, 2], "x": }', b'{"prompt_token_ids": [1, 2]'):
        with pytest.raises(ValueError):
            answer_json.loads_answer(bad)


@pytest.mark.parametrize("earlier, text, tail", [
    (b"[1, 2, 3]", b"[1, 2, 3, 4, 5]", [4, 5]),
    (b"[1, 2, 3]", b"[1, 2, 3]", []),
    (b"[1, 2, 3]", b"[1, 2, 34, 5]", None),  # same bytes, different id: the next byte decides
    (b"[1,2,3]", b"[1,2,3,9]", [9]),
    (b"[1,2,3]", b"[1, 2, 3, 9]", None),  # formatted differently: parsed in full instead
    (b"[1, 2, 3]", b"[1, 2]", None),
])
def test_raw_ids_tail_after(earlier, text, tail):
    assert RawIds(text).tail_after(RawIds(earlier)) == tail


def test_splitter_gives_the_same_split_for_text_and_parsed_ids():
    import random

    rng = random.Random(0)  # 30% of prompts rewrite the history (a branch): the text shortcut must refuse
    as_text, as_ids = PrefixSplitter(), PrefixSplitter()
    history = {e: [] for e in "abc"}
    for n in range(300):
        e = rng.choice("abc")
        keep = history[e][: rng.randint(0, len(history[e]))] if rng.random() < 0.3 else history[e]
        prompt = keep + [rng.randrange(1000) for _ in range(rng.randint(0, 5))]
        completion = np.array([rng.randrange(1000) for _ in range(rng.randint(1, 4))], np.int32)
        history[e] = prompt + completion.tolist()
        sep = rng.choice([", ", ","])
        got = as_text.split(e, str(n), RawIds(("[" + sep.join(map(str, prompt)) + "]").encode()), completion)
        want = as_ids.split(e, str(n), prompt, completion)
        assert (got[0], got[1], got[2].tolist()) == (want[0], want[1], want[2].tolist())
    with pytest.raises(ValueError):
        as_text.split("a", "bad", RawIds(b'[1, 2, 3.5e99]'), np.array([1], np.int32))


def test_splitter_forgets_old_episodes_and_expand_resolves_any_order():
    ids = lambda *xs: np.array(xs, np.int32)  # noqa: E731
    s = PrefixSplitter(max_cells=6)
    pid, k, rest = s.split("a", "a1", ids(1, 2, 3), ids(4))
    assert (pid, k, rest.tolist()) == (None, 0, [1, 2, 3])
    pid, k, rest = s.split("a", "a2", ids(1, 2, 3, 4, 5), ids(6))
    assert (pid, k, rest.tolist()) == ("a1", 4, [5])  # the prefix runs into a1's completion
    s.split("b", "b1", ids(7, 8, 9), ids(10))  # 6 + 4 ids > 6: episode a is forgotten
    pid, k, rest = s.split("a", "a3", ids(1, 2, 3, 4, 5, 6, 11), ids(12))
    assert (pid, k, rest.tolist()) == (None, 0, [1, 2, 3, 4, 5, 6, 11])
    rows = [  # stored form, the latest call first: expand must follow prefixes, not row order
        {"call_id": "c3", "prefix_call_id": "c2", "prefix_len": 3, "prompt_ids": ids(9), "completion_ids": ids(10)},
        {"call_id": "c2", "prefix_call_id": "c1", "prefix_len": 2, "prompt_ids": ids(7), "completion_ids": ids(8)},
        {"call_id": "c1", "prefix_call_id": None, "prefix_len": None, "prompt_ids": ids(1, 2),
         "completion_ids": ids(3)},
    ]
    expand(rows)
    assert [r["prompt_ids"].tolist() for r in rows] == [[1, 2, 7, 9], [1, 2, 7], [1, 2]]
    with pytest.raises(ValueError, match="not in its episode"):
        expand([{"call_id": "x", "prefix_call_id": "gone", "prefix_len": 1, "prompt_ids": ids(1),
                 "completion_ids": ids(2)}])


def test_run_dying_mid_file_resumes_after_the_last_committed_batch(tmp_path, retok, monkeypatch):
    corpus(tmp_path / "flows")
    run(tmp_path / "clean.duckdb", tmp_path / "flows", retok)
    monkeypatch.setattr(store, "FLUSH_EVERY", 2)
    real, seen = Ingest._record, []

    def dies_at_seventh(*args, **kwargs):
        seen.append(1)
        if len(seen) == 7:
            raise KeyboardInterrupt  # Ctrl-C in the middle of a file, after a few committed batches
        return real(*args, **kwargs)

    monkeypatch.setattr(Ingest, "_record", dies_at_seventh)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "resumed.duckdb", tmp_path / "flows", retok)
    partial = db_rows(tmp_path / "resumed.duckdb", "SELECT n_records, n_bytes FROM ingested_files")
    assert partial == [{"n_records": 6, "n_bytes": -1}]
    monkeypatch.setattr(Ingest, "_record", real)
    s = run(tmp_path / "resumed.duckdb", tmp_path / "flows", retok)
    assert s.files_ingested == 1 and s.records == s.calls + s.rewards > 0
    a, b = (json.dumps(db_rows(tmp_path / f"{n}.duckdb", SAMPLES), default=str) for n in ("clean", "resumed"))
    assert a == b
    calls = "SELECT call_id, sample_id FROM calls ORDER BY call_id"
    assert db_rows(tmp_path / "clean.duckdb", calls) == db_rows(tmp_path / "resumed.duckdb", calls)


def old_database(db: Path, version: str) -> None:
    """Turn a database this reconstruct wrote into one of an older schema version (its columns and tables)."""
    con = duckdb.connect(str(db))
    for table in ("episodes", "samples"):  # added in 7
        con.execute(f"ALTER TABLE {table} DROP COLUMN group_id")
    for table in ("sample_images", "call_images", "images") if version != "6" else ():  # added in 6
        con.execute(f"DROP TABLE {table}")
    for column in ("n_images", "processor") if version != "6" else ():
        con.execute(f"ALTER TABLE samples DROP COLUMN {column}")
    for table in ("calls", "samples") if version not in ("5", "6") else ():  # added in 5
        con.execute(f"ALTER TABLE {table} DROP COLUMN policy_version")
    if version in ("1", "2", "3"):
        con.execute("ALTER TABLE call_tokens ADD COLUMN tools JSON")  # never written since 1
        con.execute("CREATE TABLE images (sha256 VARCHAR PRIMARY KEY, mime VARCHAR, data BLOB NOT NULL)")
        con.execute("CREATE TABLE call_images (call_id VARCHAR NOT NULL, sha256 VARCHAR NOT NULL)")
    if version in ("1", "2"):
        for table, column in (("calls", "engine_model"), ("calls", "prompt_check"), ("samples", "role"),
                              ("samples", "toolchain")):  # added in 3
            con.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    if version == "1":
        con.execute("ALTER TABLE call_tokens DROP COLUMN prefix_call_id")
        con.execute("ALTER TABLE call_tokens DROP COLUMN prefix_len")
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [version])
    con.close()


@pytest.mark.parametrize("version", ["2", "3", "4", "5", "6"])
def test_older_schema_databases_are_migrated(tmp_path, retok, version):
    """An older database takes new calls of its episodes and gives the samples a fresh one gives; its calls
    read before have no policy version (their flow files predate it here, as they would there)."""
    f = FlowFactory(tmp_path / "first", seed=5)
    f.tool_loop("ep", turns=2, engine_ids=True)
    f.close()
    g = FlowFactory(tmp_path / "second", seed=6)
    g.policy_version = 2
    g.tool_loop("ep", turns=2, engine_ids=True)  # the same episode: old and new calls meet
    g.close()
    old = tmp_path / "old.duckdb"
    run(old, tmp_path / "first", retok)
    old_database(old, version)
    run(old, tmp_path / "second", retok)
    for flows in ("first", "second"):
        run(tmp_path / "fresh.duckdb", tmp_path / flows, retok)
    assert db_rows(old, "SELECT value FROM meta WHERE key = 'schema_version'") == [{"value": SCHEMA_VERSION}]
    tables = "SELECT table_name, column_name FROM information_schema.columns ORDER BY ALL"
    assert db_rows(old, tables) == db_rows(tmp_path / "fresh.duckdb", tables)
    a, b = (json.dumps(db_rows(tmp_path / n, SAMPLES), default=str) for n in ("old.duckdb", "fresh.duckdb"))
    assert a == b and len(json.loads(a)) >= 2
    assert {r["policy_version"] for r in json.loads(a)} == {None, 2}


def test_database_too_old_to_migrate_is_refused_with_a_rebuild_message(tmp_path, retok):
    """Version 1, and a version 3 holding rows a migration would lose (per-call conversations written before
    `call_messages`): refused, untouched, with a sentence that says to rebuild."""
    corpus(tmp_path / "flows")
    for version, legacy in (("1", False), ("3", True)):
        db = tmp_path / f"v{version}.duckdb"
        run(db, tmp_path / "flows", retok)
        old_database(db, version)
        if legacy:
            con = duckdb.connect(str(db))
            con.execute("UPDATE call_tokens SET tools = '[]', messages = '[]'")
            con.close()
        with pytest.raises(ValueError, match=f"schema version {version}.*reconstruct the flow files into a new"):
            run(db, tmp_path / "flows", retok)
        assert db_rows(db, "SELECT value FROM meta WHERE key = 'schema_version'") == [{"value": version}]


def test_every_column_is_written(tmp_path, retok):
    """No column or table of the schema is left NULL by every run: calls, a reward and a damaged record fill
    them all, but `call_tokens.messages`, which holds JSON null only for a call that sent a prompt text, the
    images' tables and columns (calls with images: test_reconstruct_vision writes them all) and the tables
    `openforge rl` writes (test_samples)."""
    f = FlowFactory(tmp_path / "flows", seed=4)
    f.policy_version = 0
    f.tool_loop("ep", turns=2, engine_ids=True)
    f.write(f.reward("ep", 1.0, task_id="t"))
    f.write({"type": "mystery", "id": "x"})  # type: ignore[typeddict-item] - a damaged record, for `skipped`
    f.close()
    db = tmp_path / "db.duckdb"
    reconstruct([tmp_path / "flows"], db, retok, run="r1")
    columns = db_rows(db, "SELECT table_name t, column_name c FROM information_schema.columns ORDER BY ALL")
    unwritten = [f"{r['t']}.{r['c']}" for r in columns
                 if db_rows(db, f'SELECT count("{r["c"]}") n FROM "{r["t"]}"')[0]["n"] == 0]
    elsewhere = [c for c in unwritten if c.split(".")[0] in ("call_images", "images", "sample_images", "rl_episodes",
                                                             "rl_reward_mismatches")]
    assert [c for c in unwritten if c not in elsewhere] == ["call_tokens.messages", "samples.processor"]


def test_flow_file_of_another_version_is_a_corrupt_file_not_an_unreadable_one(tmp_path, retok):
    """The header alone decides whether a file is a flow file; its version is refused while reading it."""
    (tmp_path / "flows").mkdir()
    (tmp_path / "flows" / "x.flows").write_bytes(
        msgpack.packb({"type": "header", "v": 99}) + msgpack.packb({"type": "exchange", "id": "a"})
    )
    s = reconstruct([tmp_path / "flows"], tmp_path / "db.duckdb", retok)
    assert dict(s.skipped) == {"corrupt_file": 1}
    [row] = db_rows(tmp_path / "db.duckdb", "SELECT reason, detail FROM skipped")
    assert "flow format version 99" in row["detail"]


def test_policy_versions_are_stored_on_calls_and_samples(tmp_path, retok, monkeypatch):
    """A call keeps its record's version (NULL for a record written before the field existed); a sample has
    the lowest version of the calls trainable in it (NULL if one has none), so `policy_version >= n` keeps no
    older token."""
    f = FlowFactory(tmp_path / "flows", seed=7)
    f.tool_loop("old", turns=1)  # no policy_version field: an old proxy's records
    f.policy_version = 3
    f.tool_loop("new", turns=1)
    versions, write = iter([4, 3, 5, None, 6]), f.write  # chains whose weights changed between their calls

    def stamped(record):
        record.pop("policy_version")
        if (version := next(versions)) is not None:
            record["policy_version"] = version
        return write(record)

    monkeypatch.setattr(f, "write", stamped)
    f.tool_loop("mixed", turns=2)
    f.tool_loop("partly", turns=1)
    f.close()
    db = tmp_path / "db.duckdb"
    reconstruct([tmp_path / "flows"], db, retok, missing_reward="keep")
    calls = db_rows(db, "SELECT episode_id e, list(policy_version ORDER BY t_start) v FROM calls GROUP BY 1 ORDER BY 1")
    assert calls == [{"e": "mixed", "v": [4, 3, 5]}, {"e": "new", "v": [3, 3]}, {"e": "old", "v": [None, None]},
                     {"e": "partly", "v": [None, 6]}]
    samples = db_rows(db, "SELECT episode_id e, n_calls, policy_version v FROM samples ORDER BY 1")
    assert samples == [{"e": "mixed", "n_calls": 3, "v": 3}, {"e": "new", "n_calls": 2, "v": 3},
                       {"e": "old", "n_calls": 2, "v": None}, {"e": "partly", "n_calls": 2, "v": None}]
