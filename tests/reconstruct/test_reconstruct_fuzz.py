"""One bad record never stops reconstruct: mutations of real flow files (scripted engine -> mitmdump).

Record level: decode a record, delete a field, change its type, or duplicate a list element, at any path:
the record's own fields, nested request/response/headers/chunks, and inside the JSON bodies and SSE events
(hops "json" and "sse"), then re-pack. Byte level: bit flips, duplicated and cut slices, truncation.
Whatever the mutation: no exception, every record read is a call, a reward or one `skipped` row, the
records before the damage and the other file are ingested as without it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from openforge.addons.flowfile import pack
from openforge.protocols.control import ControlClient
from openforge.reconstruct import Summary, reconstruct, store
from openforge.reconstruct.calls import sse_events
from openforge.testing.reconstruct_flows import BASH, db_rows, qwen_path
from openforge.testing.scripted_engine import ScriptedEngine

FILE_LEVEL = ("corrupt_file", "torn_record", "unreadable_file")
FieldPath = tuple[Any, ...]


# ---------------------------------------------------------------- corpus: real captures


def _post(url: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def _capture(start_module_proxy: Any, qwen_tok: Any, episode: str) -> Path:
    """One proxy run: every protocol, streamed and not, a tool loop and a reward, in episode `episode`."""
    with ScriptedEngine(tokenizer=qwen_tok, profile="vllm") as eng:
        proxy = start_module_proxy(eng.url, "openforge_engine_profile=vllm")
        base = f"{proxy.url}/e/{episode}"
        msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": f"List {episode}"}]
        for stream in (True, False):
            _post(f"{base}/v1/chat/completions", {"model": "m", "messages": msgs, "tools": [BASH], "stream": stream})
        _post(f"{base}/v1/completions", {"model": "m", "prompt": f"Say {episode}", "stream": True})
        _post(f"{base}/v1/responses", {"model": "m", "input": f"hello {episode}", "stream": True})
        for content in (f"hey {episode}", [{"type": "text", "text": f"ho {episode}"}]):
            _post(f"{base}/v1/messages", {"model": "m", "max_tokens": 50, "stream": isinstance(content, str),
                                          "messages": [{"role": "user", "content": content}]})
        ControlClient(proxy.url).reward(episode, 1.0, "t")
        proxy.stop()
    [path] = proxy.flow_files()
    return path


# Damaged copies of the file per reconstruct run, so that a run (whose cost is mostly DuckDB's) checks
# several cases. Copy j's record ids end in SUFFIXES[j] and its episode is alpha-SUFFIXES[j]; suffixes
# differ in at least 4 bits, so no 3 bit flips turn one copy's record into another's.
SUFFIXES = ("kkkk", "ssss", "zzzz", "mmmm", "qqqq")


class Corpus:
    """Two real flow files: `damaged` (copied and mutated by the tests) and `good` (episode omega, untouched)."""

    def __init__(self, damaged: Path, good: Path, retok: Any, work: Path) -> None:
        self.damaged, self.good, self.retok, self.work = damaged, good, retok, work
        store.connect(work / "empty.duckdb").close()  # copied for each case: creating the schema costs more
        with open(damaged, "rb") as f:
            objects = list(msgpack.Unpacker(f, raw=False))
        self.header, self.records = objects[0], objects[1:]
        self.offsets = _record_ends(damaged.read_bytes())
        self.baseline = run = self.reconstruct([damaged.read_bytes()], "baseline")
        self.calls = {r["call_id"] for r in db_rows(self.work / "baseline" / "db.duckdb", "SELECT call_id FROM calls")}
        self.good_samples = self.samples("baseline", "omega")
        assert run.calls == 2 * (len(self.records) - 1) and run.rewards == 2 and not run.skipped

    def reconstruct(self, damaged: list[bytes], name: str) -> Summary:
        """Reconstruct the damaged files (first) and the good file into a fresh database under `name`."""
        d = self.work / name
        shutil.rmtree(d, ignore_errors=True)
        (d / "flows").mkdir(parents=True)
        for n, data in enumerate(damaged):
            (d / "flows" / f"{n}-damaged.flows").write_bytes(data)
        shutil.copy(self.good, d / "flows" / "9-good.flows")
        shutil.copy(self.work / "empty.duckdb", d / "db.duckdb")
        return reconstruct([d / "flows"], d / "db.duckdb", self.retok, missing_reward="fill:0")

    def samples(self, name: str, episode: str) -> list[dict[str, Any]]:
        return db_rows(self.work / name / "db.duckdb", "SELECT episode_id, input_ids, loss_mask FROM samples "
                       f"WHERE episode_id = '{episode}' ORDER BY sample_id")

    def copy(self, j: int) -> list[dict[str, Any]]:
        """The records of copy j: the same exchanges under other ids and another episode."""
        return [dict(r, id=f"{r['id']}-{SUFFIXES[j]}", episode=f"alpha-{SUFFIXES[j]}") for r in self.records]

    def file_bytes(self, records: list[dict[str, Any]], j: int | None = None) -> bytes:
        """A flow file of `records`; copy j gets a header of its own (another file id)."""
        header = self.header if j is None else dict(self.header, created=self.header["created"] + j + 1)
        return pack(header) + b"".join(pack(r) for r in records)

    def intact(self, j: int, indexes: Iterable[int]) -> set[str]:
        """The ids in copy j of the records at `indexes` that are calls in the baseline."""
        return {f"{self.records[i]['id']}-{SUFFIXES[j]}" for i in indexes if self.records[i]["id"] in self.calls}


def _record_ends(data: bytes) -> list[int]:
    """Byte offset where each object of a flow file ends (the header's first)."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    ends = []
    for _ in unpacker:
        ends.append(unpacker.tell())
    return ends


@pytest.fixture(scope="module")
def corpus(start_module_proxy: Any, qwen_tok: Any, retok: Any, tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    damaged = _capture(start_module_proxy, qwen_tok, "alpha")
    good = _capture(start_module_proxy, qwen_tok, "omega")
    return Corpus(damaged, good, retok, tmp_path_factory.mktemp("fuzz"))


# ---------------------------------------------------------------- record-level mutations

MSGPACK_VALUES: list[Any] = [None, True, 0, -1, 2**31, 2**63 - 1, 1.5, math.nan, math.inf, "", "x", b"\x00\xff",
                             [], [1, "a", None], {}, {"k": [1]}]
JSON_VALUES: list[Any] = [v for v in MSGPACK_VALUES if not isinstance(v, bytes)] + [10**30, "\ud800"]


def _events(chunks: list[Any]) -> list[list[Any]]:
    """An SSE stream's events as [name, data], data parsed where it is JSON (chunks not [t, bytes]: none)."""
    if not all(isinstance(c, list) and len(c) == 2 and isinstance(c[1], bytes) for c in chunks):
        return []
    out = []
    for name, data in sse_events(b"".join(c[1] for c in chunks)):
        try:
            out.append([name, json.loads(data)])
        except ValueError:
            out.append([name, data])
    return out


def _stream(events: list[list[Any]]) -> bytes:
    parts = []
    for event in events:
        name, data = event if isinstance(event, list) and len(event) == 2 else (None, event)  # a replaced event
        text = data if isinstance(data, str) else json.dumps(data)
        parts.append((f"event: {name}\n" if name is not None else "") + f"data: {text}\n\n")
    return "".join(parts).encode("utf-8", "surrogatepass")


def _json(data: Any) -> Any:
    """A JSON body as a document, or None when it is not one."""
    if not isinstance(data, bytes):
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, (dict, list)) else None


def field_paths(node: Any, prefix: FieldPath = ()) -> Iterator[FieldPath]:
    """Every path below `node`, also into JSON bodies ("json") and the events of SSE chunks ("sse")."""
    if isinstance(node, dict):
        items: Iterator[tuple[Any, Any]] = iter(node.items())
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        items = iter(())
    for key, value in items:
        yield (*prefix, key)
        yield from field_paths(value, (*prefix, key))
        if key == "chunks" and isinstance(value, list) and _events(value):
            yield from field_paths(_events(value), (*prefix, key, "sse"))
        if _json(value) is not None:
            yield from field_paths(_json(value), (*prefix, key, "json"))


def mutate(node: Any, path: FieldPath, change: str, in_json: bool = False) -> Any:
    """A copy of `node` changed at `path`: `delete` the field, `duplicate` a list element, or `value:<i>`
    (the i-th of the replacement values, JSON-able inside a JSON body or SSE event)."""
    hop, rest = path[0], path[1:]
    if hop == "json":
        return json.dumps(mutate(json.loads(node), rest, change, True)).encode("utf-8", "surrogatepass")
    if hop == "sse":
        return [[node[0][0], _stream(mutate(_events(node), rest, change, True))]]
    node = copy.copy(node)
    if rest:
        node[hop] = mutate(node[hop], rest, change, in_json)
    elif change == "delete":
        del node[hop]
    elif change == "duplicate":
        if isinstance(node, list):
            node.insert(hop, node[hop])
    else:
        values = JSON_VALUES if in_json else MSGPACK_VALUES
        node[hop] = values[int(change.split(":")[1]) % len(values)]
    return node


CHANGES = ["delete", "duplicate", *(f"value:{i}" for i in range(len(JSON_VALUES)))]


def check_run(corpus: Corpus, s: Summary, name: str, intact: set[str]) -> None:
    """What holds after any damage: one outcome per record read (a call, a reward or a `skipped` row; one per
    choice where a damaged answer has several), the skipped rows stored, the `intact` calls stored, the good
    file's samples as in the baseline."""
    per_record = sum(n for reason, n in s.skipped.items() if reason not in FILE_LEVEL)
    assert s.records + s.extra_choices == s.calls + s.rewards + per_record, s
    assert sum(n for reason, n in s.skipped.items() if reason in FILE_LEVEL) <= len(SUFFIXES), s
    db = corpus.work / name / "db.duckdb"
    assert sum(s.skipped.values()) == db_rows(db, "SELECT count(*) n FROM skipped")[0]["n"]
    assert intact <= {r["call_id"] for r in db_rows(db, "SELECT call_id FROM calls")}
    assert corpus.samples(name, "omega") == corpus.good_samples


@st.composite
def record_mutations(draw: st.DrawFn, corpus: Corpus, j: int) -> tuple[set[int], list[dict[str, Any]]]:
    """(indexes of the mutated records, the records of copy j after one to three mutations)."""
    records = corpus.copy(j)
    mutated = set()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(records) - 1))
        path = draw(st.sampled_from(list(field_paths(records[i]))))
        records[i] = mutate(records[i], path, draw(st.sampled_from(CHANGES)))
        mutated.add(i)
    return mutated, records


@st.composite
def byte_damage(draw: st.DrawFn, corpus: Corpus, j: int) -> tuple[int, bytes]:
    """(offset of the first damaged byte, copy j's file after one to three bit flips, duplicated or cut
    slices, or a truncation); the bytes before that offset are the copy's."""
    data = corpus.file_bytes(corpus.copy(j), j)
    first = len(data)
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        kind = draw(st.sampled_from(["flip", "duplicate", "cut", "truncate"]))
        a = draw(st.integers(0, len(data) - 1))
        b = draw(st.integers(a, len(data)))
        if kind == "flip":
            data = data[:a] + bytes([data[a] ^ (1 << draw(st.integers(0, 7)))]) + data[a + 1:]
        elif kind == "duplicate":
            at = draw(st.integers(0, len(data)))
            data, a = data[:at] + data[a:b] + data[at:], at
        elif kind == "cut":
            data = data[:a] + data[b:]
        else:
            data = data[:a]
        first = min(first, a)
    return first, data


# Runs per test (each reconstructs len(SUFFIXES) damaged files and the good one into a fresh database): 40
# runs, 200 damaged files per test, the same on every run.
RUNS = int(os.environ.get("FUZZ_RUNS", 40))
FUZZ = settings(max_examples=RUNS, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_reconstruct_survives_record_mutations(corpus: Corpus, data: st.DataObject) -> None:
    files, intact = [], set()
    for j in range(len(SUFFIXES)):
        mutated, records = data.draw(record_mutations(corpus, j))
        files.append(corpus.file_bytes(records, j))
        intact |= corpus.intact(j, set(range(len(records))) - mutated)
    check_run(corpus, corpus.reconstruct(files, "records"), "records", intact)


@FUZZ
@given(data=st.data())
def test_reconstruct_survives_byte_damage(corpus: Corpus, data: st.DataObject) -> None:
    files, intact = [], set()
    for j in range(len(SUFFIXES)):
        first, damaged = data.draw(byte_damage(corpus, j))
        files.append(damaged)
        ends = _record_ends(corpus.file_bytes(corpus.copy(j), j))[1:]
        intact |= corpus.intact(j, (i for i, end in enumerate(ends) if end <= first))
    check_run(corpus, corpus.reconstruct(files, "bytes"), "bytes", intact)


def test_reconstruct_survives_every_field_deleted_or_retyped(corpus: Corpus) -> None:
    """Every field path (list elements: the first two) deleted once and given another type once, each variant
    a record of its own (own id and episode unless that is the field changed), all in one file."""
    variants = []
    for n, (k, path) in enumerate(
        (k, p) for k, rec in enumerate(corpus.records) for p in field_paths(rec)
        if all(not isinstance(hop, int) or hop < 2 for hop in p)
    ):
        for change in ("delete", CHANGES[2 + n % (len(CHANGES) - 2)]):
            rec = dict(corpus.records[k], id=f"{corpus.records[k]['id']}-{len(variants)}", episode=f"v{len(variants)}")
            variants.append(mutate(rec, path, change))
    s = corpus.reconstruct([corpus.file_bytes(variants)], "sweep")
    check_run(corpus, s, "sweep", set())
    assert s.records == len(variants) + len(corpus.records) and s.calls > len(variants) // 2  # most leave a call


# ---------------------------------------------------------------- the failure classes, one by one


def test_reconstruct_reports_records_of_unknown_type(corpus: Corpus) -> None:
    s = corpus.reconstruct([corpus.file_bytes([*corpus.records, {"type": "telemetry", "id": "t1"}])], "unknown")
    assert s.skipped == {"unknown_record_type": 1}
    [row] = db_rows(corpus.work / "unknown" / "db.duckdb", "SELECT * FROM skipped")
    assert (row["record_id"], row["detail"]) == ("t1", "record type 'telemetry'")


def test_reconstruct_drops_a_half_stored_record_whole(corpus: Corpus) -> None:
    """A value refused after the call was split into a prompt suffix: no row of it stays, and the next call
    of its episode is stored whole, not as a suffix of a call that is not there."""
    first, second = corpus.records[0], corpus.records[1]
    records = [dict(first, t_start="soon"), *corpus.records[1:]]
    s = corpus.reconstruct([corpus.file_bytes(records)], "half")
    assert s.skipped == {"malformed_record": 1} and s.calls == corpus.baseline.calls - 1
    db = corpus.work / "half" / "db.duckdb"
    [row] = db_rows(db, "SELECT * FROM skipped")
    assert row["record_id"] == first["id"] and "t_start" in row["detail"]
    assert db_rows(db, f"SELECT count(*) n FROM calls WHERE call_id = '{first['id']}'")[0]["n"] == 0
    stored = db_rows(db, f"SELECT prefix_call_id FROM call_tokens WHERE call_id = '{second['id']}'")
    assert stored == [{"prefix_call_id": None}]
    assert corpus.samples("half", "alpha") and corpus.samples("half", "omega") == corpus.good_samples


def test_buffer_sends_the_rows_arrow_accepts(tmp_path: Path) -> None:
    con = store.connect(tmp_path / "db.duckdb")
    assert con.execute("SELECT count(*) FROM skipped").fetchall() == [(0,)]
    buf = store.Buffer(con, "skipped", ["file_id", "record_id", "reason", "detail"])
    with pytest.raises(store.BadValue, match="record_id"):
        buf.add(file_id="f", record_id={"not": "text"}, reason="r", detail="")
    for record_id, reason in (("a", "r"), ("b", "lone \ud800 surrogate"), ("c", "r")):  # `reason` is not checked
        buf.add(file_id="f", record_id=record_id, reason=reason, detail="d")
    assert buf.flush() == 2
    assert con.execute("SELECT list(record_id ORDER BY record_id) FROM skipped").fetchone()[0] == ["a", "c"]
    [(row, error)] = buf.rejected
    assert row["record_id"] == "b" and "UnicodeEncodeError" in error
    con.close()


def test_reconstruct_sends_a_row_arrow_refuses_to_skipped(corpus: Corpus, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback for a value no check foresaw: that row goes to `skipped` (insert_failed), the batch goes on."""
    monkeypatch.setattr(store, "check", lambda column, value: value)  # no check: the value reaches Arrow
    records = [dict(corpus.records[2], model=["not", "text"]), *corpus.records[3:]]
    s = corpus.reconstruct([corpus.file_bytes(records)], "fallback")
    assert s.skipped == {"insert_failed": 1}
    [row] = db_rows(corpus.work / "fallback" / "db.duckdb", "SELECT * FROM skipped")
    assert row["record_id"] == corpus.records[2]["id"] and row["detail"].startswith("calls: ")
    assert corpus.samples("fallback", "omega") == corpus.good_samples


# ---------------------------------------------------------------- the commands


def test_cli_reconstruct_and_flows_show_on_damaged_files(corpus: Corpus, tmp_path: Path) -> None:
    """No traceback: `reconstruct` exits 0 and lists what it skipped, `flows show` names the damage."""
    from openforge.cli import app

    flows = tmp_path / "flows"
    flows.mkdir()
    records = [dict(corpus.records[0], t_start="soon"), dict(corpus.records[1], client_request=7,
               protocol=None, role=["x"], error="[/]"), *corpus.records[2:]]
    (flows / "1-records.flows").write_bytes(corpus.file_bytes(records))
    data = corpus.damaged.read_bytes()
    flip = corpus.offsets[3] + 3  # the fourth record's first key, "type": a string header flipped to a map's
    (flows / "2-bytes.flows").write_bytes(data[:flip] + bytes([data[flip] ^ 0x20]) + data[flip + 1:])
    shutil.copy(corpus.good, flows / "3-good.flows")
    runner = CliRunner()
    res = runner.invoke(app, ["reconstruct", str(flows), "--db", str(tmp_path / "db.duckdb"), "--tokenizer",
                              qwen_path(), "--missing-reward", "fill:0"])
    assert res.exit_code == 0 and res.exception is None, res.output
    assert "malformed_record 1" in res.output and "corrupt_file 1" in res.output
    assert "Traceback" not in res.output
    for args in ([], ["--json"]):
        res = runner.invoke(app, ["flows", "show", *args, str(flows)])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert "Traceback" not in res.output and "corrupt data after byte" in res.output
