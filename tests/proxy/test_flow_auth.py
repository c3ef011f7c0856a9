"""Signed flow files (addons/flowfile.py): every record carries an HMAC chained over the records before it; a
reader with the flow key uses nothing from the first record that fails on."""

from __future__ import annotations

from pathlib import Path

import pytest

from openforge.addons import flowfile
from openforge.addons.flowfile import FlowWriter, expand_paths, open_flow_file, pack

pytestmark = pytest.mark.addon

KEY = b"k" * 40
OTHER = b"o" * 40


def reward(i: int, value: float = 0.0) -> dict:
    return {"type": "reward", "id": f"r{i}", "proxy": "p", "seq": i, "t": 1.0 + i, "episode": f"ep{i}",
            "reward": value, "task_id": None, "metadata": None, "reward_policy": "first"}


def signed_file(tmp_path: Path, n: int = 3, key: bytes = KEY) -> Path:
    w = FlowWriter(tmp_path, "signed", key=key)
    for i in range(n):
        w.write(reward(i))
    w.close()
    (path,) = expand_paths([tmp_path])
    return path


def ids(path: Path, key: bytes | None) -> tuple[list[str], flowfile.FlowFile]:
    ff = open_flow_file(path, key)
    return [r["id"] for r in ff.records()], ff


def test_a_signed_file_reads_the_same_with_the_key_and_without(tmp_path: Path) -> None:
    path = signed_file(tmp_path)
    for key in (KEY, None):
        got, ff = ids(path, key)
        assert got == ["r0", "r1", "r2"] and ff.unauthenticated is None and ff.error is None
    assert len(ff.header["mac"]) == 32 and all(len(r["mac"]) == 32 for r in open_flow_file(path).records())
    assert flowfile.read_header(path)["mac"] == ff.header["mac"]


def test_an_unsigned_file_or_another_key_gives_nothing(tmp_path: Path) -> None:
    unsigned = FlowWriter(tmp_path / "u", "plain")
    unsigned.write(reward(0))
    unsigned.close()
    (plain,) = expand_paths([tmp_path / "u"])
    for path in (plain, signed_file(tmp_path / "s", key=OTHER)):
        got, ff = ids(path, KEY)
        assert got == [] and "byte 0" in ff.unauthenticated
    assert ids(plain, None)[0] == ["r0"]  # without a key: read as before


def test_a_forged_or_changed_record_ends_the_file_there(tmp_path: Path) -> None:
    """Appended records (signed with another key, unsigned, or a real record copied) and a changed byte all
    fail; the records before them stay."""
    path = signed_file(tmp_path)
    data = path.read_bytes()
    records = list(open_flow_file(path).records())
    appended = [pack(reward(9, 1.0)), flowfile.sign(reward(9, 1.0), OTHER, records[-1]["mac"])[0],
                pack(records[0])]  # the first record again, its own MAC with it
    for extra in appended:
        path.write_bytes(data + extra)
        got, ff = ids(path, KEY)
        assert got == ["r0", "r1", "r2"] and ff.unauthenticated and "nothing from there on" in ff.unauthenticated
    at = data.index(b"ep1")
    path.write_bytes(data[:at] + b"ep7" + data[at + 3:])  # another episode for r1's reward
    got, ff = ids(path, KEY)
    assert got == ["r0"] and ff.unauthenticated


def test_a_torn_tail_is_reported_not_used(tmp_path: Path) -> None:
    path = signed_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-5])
    got, ff = ids(path, KEY)
    assert got == ["r0", "r1"] and ff.torn_tail and ff.unauthenticated is None


def test_records_signed_across_a_rotation(tmp_path: Path) -> None:
    w = FlowWriter(tmp_path, "rot", max_bytes=400, key=KEY)
    for i in range(8):
        w.write(reward(i))
    w.close()
    paths = expand_paths([tmp_path])
    assert len(paths) > 1
    assert [i for p in paths for i in ids(p, KEY)[0]] == [f"r{i}" for i in range(8)]
    n_first = len(ids(paths[0], KEY)[0])
    first, second = (p.read_bytes() for p in paths[:2])
    header_len = len(pack(flowfile.read_header(paths[1])))
    paths[0].write_bytes(first + second[header_len:])  # the next file's records moved behind this one's
    got, ff = ids(paths[0], KEY)
    assert len(got) == n_first and ff.unauthenticated


def test_a_record_with_a_map_key_is_skipped_and_checked(tmp_path: Path) -> None:
    """Signed bytes that Python cannot decode (a map as a map key) are skipped when their MAC holds; a forged
    one ends the file."""
    path = signed_file(tmp_path, n=1)
    last = list(open_flow_file(path).records())[-1]["mac"]
    body = b"\x82\x81\xa1k\x01\x02" + flowfile.MAC_FIELD  # {{"k": 1}: 2, "mac": ...}
    mac = flowfile._mac(KEY, last, body)
    after = flowfile.sign(reward(5), KEY, mac)[0]
    path.write_bytes(path.read_bytes() + body + mac + after)
    got, ff = ids(path, KEY)
    assert got == ["r0", "r5"] and len(ff.bad_records) == 1 and ff.unauthenticated is None
    got, ff = ids(path, OTHER)
    assert got == [] and ff.unauthenticated


def test_read_key_refuses_short_keys(tmp_path: Path) -> None:
    good, short = tmp_path / "good", tmp_path / "short"
    good.write_text("x" * 40 + "\n")
    short.write_text("x" * 10)
    assert flowfile.read_key(good) == b"x" * 40
    with pytest.raises(ValueError, match="at least 32"):
        flowfile.read_key(short)
    with pytest.raises(ValueError, match="cannot read"):
        flowfile.read_key(tmp_path / "missing")
