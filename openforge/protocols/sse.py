"""Server-sent events, read once: the same incremental reader for a whole recorded body and for a stream
arriving in network reads of any size."""

from __future__ import annotations

import re

# One complete event: (its `event:` name, its `data:` lines joined by "\n", its `error:` lines likewise, which
# some engines send their error under); None where it has no such line. A plain tuple: a stream has many.
Event = tuple[str | None, str | None, str | None]


def split_complete(buf: bytes) -> tuple[bytes, bytes]:
    """(the complete events at the start of `buf`, the partial one after them), split at the last blank line
    (LF or CRLF line ends); the bytes are not changed."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
    return buf[:end], buf[end:]


def parse_event(block: str) -> Event | None:
    """One event's lines (LF line ends), or None when it carries neither data nor error (comments only)."""
    if block[:6] == "data: " and "\n" not in block:  # the usual event: one data line
        return None, block[6:], None
    name: str | None = None
    data: list[str] = []
    error: list[str] = []
    for line in block.split("\n"):
        if not line or line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            data.append(value)
        elif field == "error":
            error.append(value)
        elif field == "event":
            name = value.strip()
    if not data and not error:
        return None
    return name, "\n".join(data) if data else None, "\n".join(error) if error else None


class SseReader:
    """Bytes in any split -> complete events; `flush()` returns an event the stream ended without closing.

    CRLF, CR and LF all end a line; a CR at the end of a read waits, as it may be half of a CRLF.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes, last: bool = False) -> list[Event]:
        """The events `data` completes; `last` when nothing follows it (a trailing CR ends its line)."""
        buf = self._buf + data
        hold = b""
        if buf.endswith(b"\r") and not last:
            buf, hold = buf[:-1], b"\r"
        complete, rest = split_complete(buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n"))
        self._buf = rest + hold
        return _events(complete)

    def flush(self) -> list[Event]:
        """The unterminated last event, if any (the stream closed without its blank line)."""
        rest, self._buf = self._buf, b""
        event = parse_event(rest.replace(b"\r\n", b"\n").replace(b"\r", b"\n").decode("utf-8", "replace"))
        return [] if event is None else [event]


def _events(complete: bytes) -> list[Event]:
    return [e for e in map(parse_event, complete.decode("utf-8", "replace").split("\n\n")) if e is not None]


def events(raw: bytes, torn: bool = False) -> list[Event]:
    """The events of a whole body; an unterminated last one too when `torn` (else it counts as cut short)."""
    reader = SseReader()
    out = reader.feed(raw, last=True)
    return out + reader.flush() if torn else out


# The event that tells a client its streamed answer is complete, at the start of a line: Chat and Completions
# `data: [DONE]`, Anthropic `message_stop`, Responses `response.completed` / `.incomplete` / `.failed`.
_TERMINAL = re.compile(rb"(?:^|\n)(?:data: ?\[DONE\]|"
                       rb"event: ?(?:message_stop|response\.(?:completed|incomplete|failed))\b)")
_TERMINAL_HINTS = (b"[DONE]", b"message_stop", b"response.completed", b"response.incomplete", b"response.failed")


def has_terminal_event(out: bytes) -> bool:
    """Whether bytes for the client hold its stream's terminal event (substring tests first: cheap)."""
    return any(h in out for h in _TERMINAL_HINTS) and _TERMINAL.search(out) is not None
