"""Flow files: the msgpack record stream the proxy appends and reconstruct/ reads.

This module is the one place that writes or reads the format (specified in docs/flow-format.md).
It runs inside the proxy, so it depends on the standard library and msgpack only.

Signed files: with a flow key every record (the header first) ends with a `mac` field, an HMAC-SHA256 of the
record's own bytes before it, chained over the previous record's MAC. So a file being appended to verifies
record by record, a record moved to another place or file fails, and a reader with the key uses nothing
past the first record that fails.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, TypedDict, cast

import msgpack

FORMAT_VERSION = 1
SUFFIX = ".flows"
MAX_RECORD_BYTES = 1 << 31  # a single exchange may carry a long SSE stream; refuse absurd sizes only
# A reward record's reward is a finite number within +-MAX_ABS_REWARD: larger is a verifier bug, not a score
# (the proxy refuses it, reconstruct skips it), and group sums and variances of such rewards stay finite.
MAX_ABS_REWARD = 1e6
HEADER_MAX_BYTES = 1 << 20  # `read_header` decodes no more than this: a header is a few dozen bytes
MIN_KEY_CHARS = 32  # a flow key is text of at least this many characters
# A signed record ends with its `mac` field: the key "mac", a 32-byte bin header, then the MAC itself.
MAC_FIELD = b"\xa3mac\xc4\x20"
MAC_BYTES = 32
_HEADER_DOMAIN = b"openforge-flow-header\0"  # what a header's MAC covers first: no record's MAC equals one


class _HeaderFields(TypedDict):
    type: Literal["header"]
    v: int
    proxy: str
    started: float
    file_seq: int
    created: float


class FileHeader(_HeaderFields, total=False):
    """The first record of every flow file; `mac` only in a signed one."""

    mac: bytes


class HttpRequest(TypedDict):
    """`client_request` / `upstream_request`: headers are `[name, value]` pairs in wire order, secrets masked."""

    method: str
    url: str
    headers: list[list[str]]
    body: bytes | None


class HttpResponse(TypedDict):
    """`response` / `client_response`: `chunks` holds `[t, bytes]` reads of a stream (then `body` is None)."""

    status: int
    headers: list[list[str]]
    body: bytes | None
    chunks: list[list[Any]] | None
    streamed: bool


# `from` is a keyword: the functional form names it
Translation = TypedDict("Translation", {"from": str, "to": str, "dropped": list[str]})


class _ExchangeFields(TypedDict):
    type: Literal["exchange"]
    id: str
    proxy: str
    seq: int
    t_start: float
    t_first_byte: float | None
    t_end: float | None
    complete: bool
    episode: str | None
    episode_source: str | None
    role: str
    toolchain: str | None
    protocol: str
    model: str | None
    upstream_model: str | None
    engine_profile: str
    client_request: HttpRequest
    upstream_request: HttpRequest | None
    response: HttpResponse | None
    client_response: HttpResponse | None
    injected: list[str]
    translated: Translation | None
    has_token_ids: bool
    error: str | None


class ExchangeRecord(_ExchangeFields, total=False):
    """One LLM call (or passthrough call) as the proxy saw it; `policy_version` is absent in files written
    before it existed; `engine_prompt_ids` / `engine_prompt_error` only where the proxy asked the engine for
    the prompt's ids (llama.cpp)."""

    policy_version: int
    engine_prompt_ids: list[int]
    engine_prompt_error: str


class _RewardPost(TypedDict):
    """What a reward post said, accepted or refused."""

    id: str
    proxy: str
    seq: int
    t: float
    episode: str
    reward: float
    task_id: str | None


class _RewardFields(_RewardPost):
    type: Literal["reward"]
    metadata: dict[str, Any] | None


class RewardRecord(_RewardFields, total=False):
    """A verifier's reward for an episode; `reward_policy` is absent in files written before it existed."""

    reward_policy: Literal["last", "first"]


class RefusedRewardRecord(_RewardPost):
    """A reward post the proxy refused because the episode already had one (`openforge_reward_policy=first`)."""

    type: Literal["reward_refused"]
    error: str


# What follows the header. Records are typed as the format writes them; a damaged file can yield maps that
# break these types, so a reader checks every field it uses. In a signed file each also ends with `mac`.
FlowRecord = ExchangeRecord | RewardRecord | RefusedRewardRecord


class NotAFlowFile(Exception):
    """A file that does not start with a header record."""


def pack(record: Mapping[str, Any]) -> bytes:
    """Serialise one record; bytes stay bytes (msgpack bin), str stays str."""
    return msgpack.packb(record, use_bin_type=True)


def read_key(path: str | os.PathLike[str]) -> bytes:
    """A flow key from its file (one trailing newline dropped); ValueError with a sentence if it cannot be one."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8").removesuffix("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the flow key file {str(path)!r}: {getattr(e, 'strerror', None) or e}") from None
    if len(text) < MIN_KEY_CHARS or not text.isprintable():
        raise ValueError(f"the flow key in {str(path)!r} must be at least {MIN_KEY_CHARS} printable characters "
                         "(e.g. `openssl rand -hex 32`)")
    return text.encode()


def _mac(key: bytes, previous: bytes, body: bytes) -> bytes:
    """A record's MAC: over the previous record's MAC (the header: a fixed domain) and its bytes before the MAC."""
    return hmac.new(key, previous + body, hashlib.sha256).digest()


def sign(record: Mapping[str, Any], key: bytes, previous: bytes | None) -> tuple[bytes, bytes]:
    """(the packed record ending with its `mac` field, that MAC); `previous`: the MAC of the record before it,
    None for the header."""
    if "mac" in record:
        raise ValueError("a record to sign already has a mac field")
    body = pack({**record, "mac": bytes(MAC_BYTES)})[:-MAC_BYTES]
    mac = _mac(key, _HEADER_DOMAIN if previous is None else previous, body)
    return body + mac, mac


def check_mac(raw: bytes, key: bytes, previous: bytes | None) -> bytes | None:
    """The MAC of a record's raw bytes if it is signed and its MAC holds after `previous`, else None."""
    body, mac = raw[:-MAC_BYTES], raw[-MAC_BYTES:]
    if len(raw) < len(MAC_FIELD) + MAC_BYTES or not body.endswith(MAC_FIELD):
        return None
    expected = _mac(key, _HEADER_DOMAIN if previous is None else previous, body)
    return mac if hmac.compare_digest(mac, expected) else None


@dataclass
class FlowWriter:
    """Appends records to size-rotated files named after the proxy instance and its start time.

    Each record goes to the OS in one `write` call before `write` returns (no buffer in this process), so
    once the proxy has answered a call, `kill -9` cannot lose its record. fsync (surviving a crash of the
    machine) runs at most every `fsync_interval` seconds, never per record, and in a background thread (on
    a duplicate of the file descriptor) so a slow disk never stalls the proxy's event loop.
    `fsync_interval=0` fsyncs every record, inline.

    A write that fails (disk full, directory gone or read-only) raises OSError and leaves no partial record:
    the file is cut back to its last whole record and closed, and the next write starts a new file.

    With a `key` (a flow key's bytes) every record is signed, chained over the file's records before it.
    """

    directory: Path
    instance: str
    max_bytes: int = 256 << 20
    fsync_interval: float = 1.0
    started: float = field(default_factory=time.time)
    key: bytes | None = field(default=None, repr=False)
    _fd: int | None = field(default=None, init=False, repr=False)
    _last_mac: bytes | None = field(default=None, init=False, repr=False)  # of the current file's last record
    _file_seq: int = field(default=0, init=False)
    _size: int = field(default=0, init=False)
    _last_fsync: float = field(default=0.0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _syncer: threading.Thread | None = field(default=None, init=False, repr=False)
    paths: list[Path] = field(default_factory=list, init=False)

    def write(self, record: FlowRecord) -> None:
        data = pack(record)
        with self._lock:
            signed = len(MAC_FIELD) + MAC_BYTES if self.key is not None else 0
            if self._fd is None or self._size + len(data) + signed > self.max_bytes:
                self._rotate()
            assert self._fd is not None
            mac = None
            if self.key is not None:
                data, mac = sign(record, self.key, self._last_mac)
            try:
                _write_all(self._fd, data)
            except OSError:
                self._abandon()
                raise
            self._size += len(data)
            self._last_mac = mac
            now = time.monotonic()
            if now - self._last_fsync >= self.fsync_interval:
                self._last_fsync = now
                if self.fsync_interval <= 0:
                    os.fsync(self._fd)
                elif self._syncer is None or not self._syncer.is_alive():
                    self._syncer = threading.Thread(target=_fsync_and_close, args=(os.dup(self._fd),),
                                                    name="openforge-fsync", daemon=True)
                    self._syncer.start()

    def close(self) -> None:
        with self._lock:
            self._close_file()
            syncer, self._syncer = self._syncer, None
        if syncer is not None:
            syncer.join()

    @property
    def current_path(self) -> Path | None:
        return self.paths[-1] if self.paths else None

    def _rotate(self) -> None:
        self._close_file()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file_seq += 1
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.started))
        path = self.directory / f"openforge-{self.instance}-{stamp}-{self._file_seq:04d}{SUFFIX}"
        fields = FileHeader(type="header", v=FORMAT_VERSION, proxy=self.instance, started=self.started,
                            file_seq=self._file_seq, created=time.time())
        header, mac = sign(fields, self.key, None) if self.key is not None else (pack(fields), None)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            _write_all(fd, header)
        except OSError:
            os.close(fd)
            path.unlink(missing_ok=True)  # a file without a whole header is no flow file
            raise
        self._fd, self._size, self._last_mac = fd, len(header), mac
        self.paths.append(path)

    def _abandon(self) -> None:
        """After a failed write: cut the file back to its last whole record, close it (best effort)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, self._size)
        except OSError:
            pass  # the reader then reports a torn or corrupt tail for this file
        os.close(fd)

    def _close_file(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    """`os.write` until all of `data` is written (one call unless interrupted or the disk fills up)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class FlowFile:
    """One flow file opened for reading: iterate `records()`, then look at `torn_tail` / `error` /
    `bad_records` / `unauthenticated`.

    With a `key`, only records whose MAC holds are yielded: an unsigned file yields none, and a record whose
    MAC fails ends the file there (`unauthenticated` says where and why). Without one MACs are not checked.
    """

    path: Path
    key: bytes | None = field(default=None, repr=False)
    header: FileHeader | None = None
    file_id: str = ""
    n_records: int = 0
    n_bytes: int = 0
    torn_tail: bool = False  # the last record was cut short (kill -9 mid-write): skipped
    error: str | None = None  # the file stops being readable at some offset (corruption)
    unauthenticated: str | None = None  # with a key: why nothing from some offset on is used
    bad_records: list[str] = field(default_factory=list)  # objects skipped as undecodable (a map used as a key)

    def records(self) -> Iterator[FlowRecord]:
        """Yield exchange and reward records in file order, streaming (bounded memory).

        Every decoded map after the header but a repeated header is yielded, whatever its fields (a record
        of unknown or missing `type` is the caller's to report). An object that msgpack can delimit but
        Python cannot hold (a map used as a map key) is skipped (`bad_records`) and reading goes on; the
        file stops being readable where the bytes stop decoding at all (`error`, the records before it
        yielded). Text that is not UTF-8 decodes with U+FFFD: a flipped byte in a string spoils that string,
        not the rest of the file.
        """
        self.n_bytes = self.path.stat().st_size
        last_mac: bytes | None = None
        end = 0
        with open(self.path, "rb") as f, open(self.path, "rb") as raw:
            for start, end, obj in _objects(f, raw):
                if isinstance(obj, _Corrupt):
                    self.error = f"corrupt data after byte {start}: {obj.error}"
                    return
                if self.key is not None:
                    raw.seek(start)
                    last_mac = check_mac(raw.read(end - start), self.key, last_mac)
                    if last_mac is None:
                        self.unauthenticated = (f"{'unsigned' if start == 0 else 'bad'} MAC at byte {start}: "
                                                "nothing from there on is used")
                        return
                if isinstance(obj, _Undecodable):
                    self.bad_records.append(f"undecodable record at byte {start}: {obj.error}")
                    continue
                if not isinstance(obj, dict):
                    self.error = f"not a flow record at offset {start}"
                    return
                if obj.get("type") == "header":
                    if self.header is None:
                        self._set_header(obj)
                    continue
                if self.header is None:
                    self.error = "no header record: not an OpenForge flow file"
                    return
                self.n_records += 1
                yield cast(FlowRecord, obj)
            if end < self.n_bytes:
                self.torn_tail = True
            if self.header is None and self.error is None:
                self.error = "empty or unreadable: no header record"

    def _set_header(self, header: dict[str, Any]) -> None:
        if header.get("v") != FORMAT_VERSION:
            raise UnsupportedVersion(
                f"{self.path}: flow format version {header.get('v')!r}, this reader knows {FORMAT_VERSION}"
            )
        self.header = cast(FileHeader, header)
        self.file_id = header_id(self.header)


@dataclass
class _Undecodable:
    """An object msgpack delimits but Python cannot build (a map as a map key): skipped, reading goes on."""

    error: str


@dataclass
class _Corrupt:
    """Bytes that do not decode: the file ends here for a reader."""

    error: str


def _unpacker(f: IO[bytes]) -> msgpack.Unpacker:
    return msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=MAX_RECORD_BYTES,
                            unicode_errors="replace")


def _objects(f: IO[bytes], raw: IO[bytes]) -> Iterator[tuple[int, int, Any]]:
    """(start, end, object) of each msgpack object of `f`, an `_Undecodable` for one Python cannot hold, then
    a `_Corrupt` where decoding stops. `raw`: a second handle on the file, to find an undecodable one's end."""
    unpacker, base, end = _unpacker(f), 0, 0  # end: after the last whole object (tell() counts a torn one's)
    while True:
        try:
            obj = next(unpacker)
        except StopIteration:
            return
        except (TypeError, ValueError) as e:  # a map key Python cannot hash; a bad UTF-8 key, ...
            raw.seek(end)
            probe = _unpacker(raw)
            try:
                probe.skip()
            except Exception:  # noqa: BLE001 - it does not even delimit: corruption
                yield end, end, _Corrupt(f"{type(e).__name__}: {e}")
                return
            start, end = end, end + probe.tell()
            yield start, end, _Undecodable(f"{type(e).__name__}: {e}")
            f.seek(end)
            unpacker, base = _unpacker(f), end
            continue
        except Exception as e:  # noqa: BLE001 - any other undecodable byte
            yield end, end, _Corrupt(f"{type(e).__name__}: {e}")
            return
        start, end = end, base + unpacker.tell()
        yield start, end, obj


class UnsupportedVersion(Exception):
    """A flow file written by a newer (or unknown) format version."""


def open_flow_file(path: str | os.PathLike[str], key: bytes | None = None) -> FlowFile:
    return FlowFile(Path(path), key)


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """The file's header record, decoding nothing past it (whether a file is new is decided on it alone).

    Raises NotAFlowFile when the file does not start with one. The version is not checked here:
    `FlowFile.records()` refuses another version (UnsupportedVersion).
    """
    try:
        with open(path, "rb") as f:
            header = next(iter(msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=HEADER_MAX_BYTES)))
    except Exception as e:  # noqa: BLE001 - any undecodable start (or none) means the same thing
        raise NotAFlowFile(f"not a flow file: {e}") from None
    if not isinstance(header, dict) or header.get("type") != "header":
        raise NotAFlowFile("no header record: not an OpenForge flow file")
    return cast(FileHeader, header)


def header_id(header: FileHeader) -> str:
    """The file id downstream de-duplicates on: sha256 of the packed header (stable across renames)."""
    return hashlib.sha256(pack(header)).hexdigest()[:32]


def expand_paths(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files as given, directories expanded to their flow files (sorted, so ingestion order is stable)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(p.rglob(f"*{SUFFIX}")))
        else:
            out.append(p)
    return out
