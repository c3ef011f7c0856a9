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
from pathlib import Path
from typing import Any, Callable, Iterator

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from addons.flowfile import FlowFile, pack
from reconstruct import reconstruct, store
from reconstruct.api import Summary
from reconstruct.protocols import sse_events
from tests.support.reconstruct_fixtures import qwen_tok, retok  # noqa: F401 - session fixtures
from tests.support.reconstruct_flows import BASH, db_rows, qwen_path
from tests.support.scripted_engine import ScriptedEngine

FILE_LEVEL = ("corrupt_file", "torn_record", "unreadable_file")
SAMPLES = "SELECT episode_id, input_ids, loss_mask FROM samples ORDER BY sample_id"
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
        _post(f"{proxy.url}/openforge/v1/episodes/{episode}/reward", {"reward": 1.0, "task_id": "t"})
        proxy.stop()
    [path] = proxy.flow_files()
    return path


class Corpus:
    """Two real flow files: `damaged` (mutated by the tests) and `good` (another episode, never touched)."""

    def __init__(self, damaged: Path, good: Path, retok: Any, work: Path) -> None:
        self.damaged, self.good, self.retok, self.work = damaged, good, retok, work
        store.connect(work / "empty.duckdb").close()  # copied for each case: creating the schema costs more
        with open(damaged, "rb") as f:
            objects = list(msgpack.Unpacker(f, raw=False))
        self.header, self.records = objects[0], objects[1:]
        self.offsets = _record_ends(damaged.read_bytes())
        run = self.reconstruct(damaged.read_bytes(), "baseline")
        self.summary = run
        self.calls = {r["call_id"] for r in db_rows(self.work / "baseline" / "db.duckdb", "SELECT call_id FROM calls")}
        self.good_samples = self.samples("baseline", "omega")
        assert run.calls == 2 * (len(self.records) - 1) and run.rewards == 2 and not run.skipped

    def reconstruct(self, damaged: bytes, name: str) -> Summary:
        """Reconstruct the damaged bytes (first) and the good file into a fresh database under `name`."""
        d = self.work / name
        shutil.rmtree(d, ignore_errors=True)
        (d / "flows").mkdir(parents=True)
        (d / "flows" / "1-damaged.flows").write_bytes(damaged)
        shutil.copy(self.good, d / "flows" / "2-good.flows")
        shutil.copy(self.work / "empty.duckdb", d / "db.duckdb")
        return reconstruct([d / "flows"], d / "db.duckdb", self.retok, missing_reward="fill:0")

    def samples(self, name: str, episode: str) -> list[dict[str, Any]]:
        return db_rows(self.work / name / "db.duckdb", f"{SAMPLES.replace('ORDER', f'WHERE episode_id = {episode!r} ORDER')}")

    def file_bytes(self, records: list[dict[str, Any]]) -> bytes:
        return pack(self.header) + b"".join(pack(r) for r in records)


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
    """What holds after any damage: one outcome per record read (a call, a reward or a `skipped` row), the
    skipped rows stored, the `intact` calls stored, the good file's samples as in the baseline."""
    per_record = sum(n for reason, n in s.skipped.items() if reason not in FILE_LEVEL)
    assert s.records == s.calls + s.rewards + per_record, s
    assert sum(n for reason, n in s.skipped.items() if reason in FILE_LEVEL) <= 1, s
    db = corpus.work / name / "db.duckdb"
    assert sum(s.skipped.values()) == db_rows(db, "SELECT count(*) n FROM skipped")[0]["n"]
    assert intact <= {r["call_id"] for r in db_rows(db, "SELECT call_id FROM calls")}
    assert corpus.samples(name, "omega") == corpus.good_samples


@st.composite
def record_mutations(draw: st.DrawFn, corpus: Corpus) -> tuple[set[int], list[dict[str, Any]]]:
    """(indexes of the mutated records, the damaged file's records after one to three mutations)."""
    records = list(corpus.records)
    mutated = set()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(records) - 1))
        path = draw(st.sampled_from(list(field_paths(records[i]))))
        records[i] = mutate(records[i], path, draw(st.sampled_from(CHANGES)))
        mutated.add(i)
    return mutated, records


@st.composite
def byte_damage(draw: st.DrawFn, corpus: Corpus) -> tuple[int, bytes]:
    """(offset of the first damaged byte, the damaged file after one to three bit flips, duplicated or cut
    slices, or a truncation); the bytes before that offset are the original's."""
    data = corpus.damaged.read_bytes()
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


# a few hundred cases in all (each a reconstruct of two files into a fresh database), the same on every run
CASES = int(os.environ.get("FUZZ_CASES", 100))
FUZZ = settings(max_examples=CASES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(data=st.data())
def test_reconstruct_survives_record_mutations(corpus: Corpus, data: st.DataObject) -> None:
    mutated, records = data.draw(record_mutations(corpus))
    s = corpus.reconstruct(corpus.file_bytes(records), "records")
    intact = {r["id"] for i, r in enumerate(corpus.records) if i not in mutated} & corpus.calls
    check_run(corpus, s, "records", intact)


@FUZZ
@given(data=st.data())
def test_reconstruct_survives_byte_damage(corpus: Corpus, data: st.DataObject) -> None:
    first, damaged = data.draw(byte_damage(corpus))
    s = corpus.reconstruct(damaged, "bytes")
    intact = {r["id"] for r, end in zip(corpus.records, corpus.offsets[1:]) if end <= first} & corpus.calls
    check_run(corpus, s, "bytes", intact)


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
    s = corpus.reconstruct(corpus.file_bytes(variants), "sweep")
    check_run(corpus, s, "sweep", set())
    assert s.records == len(variants) + len(corpus.records) and s.calls > len(variants) // 2  # most leave a call
