"""The flow-file contract: round trip, rotation, torn tails, versions (addons/flowfile.py)."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from openforge.addons import flowfile
from openforge.addons.flowfile import FlowWriter, UnsupportedVersion, expand_paths, open_flow_file, pack

pytestmark = pytest.mark.addon


def exchange(i: int, payload: bytes = b"x") -> dict:
    return {"type": "exchange", "id": f"id{i}", "seq": i, "complete": True, "episode": None,
            "response": {"status": 200, "body": None, "chunks": [[1.5, payload], [1.6, b"\xff\x00"]],
                         "streamed": True}, "injected": ["logprobs"]}


def test_round_trip_keeps_bytes_and_strings(tmp_path: Path) -> None:
    w = FlowWriter(tmp_path, "abcd1234")
    written = [exchange(i) for i in range(5)] + [{"type": "reward", "episode": "e", "reward": 1.0}]
    for r in written:
        w.write(r)
    w.close()
    (path,) = expand_paths([tmp_path])
    assert path.name.startswith("openforge-abcd1234-") and path.name.endswith("-0001.flows")
    ff = open_flow_file(path)
    assert list(ff.records()) == written
    assert ff.header["v"] == 1 and ff.header["proxy"] == "abcd1234" and len(ff.file_id) == 32
    assert not ff.torn_tail and ff.error is None and ff.n_records == 6


def test_rotation_by_size_and_sorted_expansion(tmp_path: Path) -> None:
    w = FlowWriter(tmp_path, "rot", max_bytes=600)
    for i in range(10):
        w.write(exchange(i, b"y" * 200))
    w.close()
    paths = expand_paths([tmp_path])
    assert len(paths) > 2 and paths == sorted(paths)
    seqs = [r["seq"] for p in paths for r in open_flow_file(p).records()]
    assert seqs == list(range(10))
    ids = set()
    for p in paths:
        ff = open_flow_file(p)
        list(ff.records())
        ids.add(ff.file_id)
    assert len(ids) == len(paths)  # each file has its own id for de-duplication downstream


@pytest.mark.parametrize("cut", [1, 7, 40])
def test_torn_tail_is_skipped_and_reported(tmp_path: Path, cut: int) -> None:
    w = FlowWriter(tmp_path, "torn")
    for i in range(3):
        w.write(exchange(i))
    w.close()
    (path,) = expand_paths([tmp_path])
    with open(path, "ab") as f:
        f.write(pack(exchange(99))[:cut])
    ff = open_flow_file(path)
    assert [r["seq"] for r in ff.records()] == [0, 1, 2]
    assert ff.torn_tail and ff.error is None


def test_other_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.flows"
    path.write_bytes(msgpack.packb({"type": "header", "v": 99}) + pack(exchange(0)))
    with pytest.raises(UnsupportedVersion):
        list(open_flow_file(path).records())


def test_not_a_flow_file(tmp_path: Path) -> None:
    path = tmp_path / "x.flows"
    path.write_bytes(pack(exchange(0)))
    ff = open_flow_file(path)
    assert list(ff.records()) == [] and "no header" in ff.error


def test_damaged_bytes_spoil_only_what_they_hit(tmp_path: Path) -> None:
    """A string that is not UTF-8 spoils only itself; a map without `type` is the reader's caller's to report;
    a record with a map used as a map key (msgpack allows it, Python cannot hold it) is skipped, and the
    records after it are read; bytes that do not decode stop the file there."""
    w = FlowWriter(tmp_path, "dmg")
    for i in range(2):
        w.write(exchange(i))
    w.close()
    (path,) = expand_paths([tmp_path])
    not_utf8 = pack({"type": "exchange", "id": "x"}).replace(b"\xa1x", b"\xa1\xff")
    map_key = b"\x81\x81\xa1k\x01\x02"  # {{"k": 1}: 2}
    with open(path, "ab") as f:
        f.write(not_utf8 + pack({"id": "no-type"}) + pack(exchange(3)) + map_key + pack(exchange(4)))
    ff = open_flow_file(path)
    assert [r["id"] for r in ff.records()] == ["id0", "id1", "\ufffd", "no-type", "id3", "id4"]
    assert ff.error is None and not ff.torn_tail
    assert len(ff.bad_records) == 1 and "TypeError" in ff.bad_records[0]
    with open(path, "ab") as f:
        f.write(b"\xc1" + pack(exchange(5)))  # 0xc1: never valid msgpack
    ff = open_flow_file(path)
    assert [r["id"] for r in ff.records()][-1] == "id4" and "corrupt data" in ff.error


def test_read_header_reads_the_header_alone_and_names_what_is_not_one(tmp_path: Path) -> None:
    w = FlowWriter(tmp_path, "hdr")
    w.write(exchange(0))
    w.close()
    (path,) = expand_paths([tmp_path])
    header = flowfile.read_header(path)
    assert set(header) == flowfile.FileHeader.__required_keys__ and header["proxy"] == "hdr"
    ff = open_flow_file(path)
    list(ff.records())
    assert flowfile.header_id(header) == ff.file_id and ff.header == header
    headerless = tmp_path / "x.flows"
    headerless.write_bytes(pack(exchange(0)))
    with pytest.raises(flowfile.NotAFlowFile, match="no header record"):
        flowfile.read_header(headerless)
    headerless.write_bytes(b"")
    with pytest.raises(flowfile.NotAFlowFile, match="not a flow file"):
        flowfile.read_header(headerless)
    newer = tmp_path / "newer.flows"  # the version is for `records()` to refuse (reconstruct: corrupt_file)
    newer.write_bytes(msgpack.packb({"type": "header", "v": 99}) + pack(exchange(0)))
    assert flowfile.read_header(newer)["v"] == 99


def test_record_types_name_every_field_of_the_format_doc() -> None:
    """The TypedDicts and docs/flow-format.md list the same fields, record by record."""
    doc = (Path(__file__).parents[2] / "docs" / "flow-format.md").read_text()
    sections = {"Header record": flowfile.FileHeader, "Exchange record": flowfile.ExchangeRecord,
                "Reward record": flowfile.RewardRecord, "Refused reward record": flowfile.RefusedRewardRecord}
    for title, typ in sections.items():
        table = doc.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
        fields: set[str] = set()
        for line in table.splitlines():
            if line.startswith("| `"):
                fields.update(f.strip("` ") for f in line.split("|")[1].split(","))
        assert fields == set(typ.__annotations__), title
    assert flowfile.RewardRecord.__optional_keys__ == {"reward_policy"}
    assert flowfile.ExchangeRecord.__optional_keys__ == {"policy_version", "engine_prompt_ids", "engine_prompt_error"}
    assert flowfile.FileHeader.__optional_keys__ == {"mac"}  # in signed files only
