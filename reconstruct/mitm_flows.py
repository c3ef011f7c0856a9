"""mitmproxy's own `-w` flow files, read as OpenForge exchange records.

A capture made with plain `mitmdump -w FILE` in front of an engine carries the same HTTP exchanges;
this turns each HTTP flow into the record shape of docs/flow-format.md (request = upstream request,
no injected fields, the response body whole) so the rest of reconstruct treats both alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from openforge.protocols.endpoints import protocol_name, strip_prefixes

SESSION_HEADERS = (
    ("x-openforge-episode", "header"),
    ("x-claude-code-session-id", "session_header"),
    ("session-id", "session_header"),
)


def is_mitm_file(path: Path) -> bool:
    """mitmproxy files are tnetstrings: they start with an ASCII length; ours start with a msgpack map."""
    with open(path, "rb") as f:
        first = f.read(1)
    return first.isdigit()


class MitmFile:
    """Streams records from a mitmproxy flow file; `file_id`, `n_records`, `error` like FlowFile."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file_id = ""
        self.n_records = 0
        self.n_bytes = path.stat().st_size
        self.torn_tail = False
        self.error: str | None = None

    def records(self) -> Iterator[dict[str, Any]]:
        from mitmproxy import http, io
        from mitmproxy.exceptions import FlowReadException

        with open(self.path, "rb") as f:
            try:
                for flow in io.FlowReader(f).stream():
                    if not self.file_id:
                        self.file_id = hashlib.sha256(f"mitmproxy:{flow.id}".encode()).hexdigest()[:32]
                    if not isinstance(flow, http.HTTPFlow):
                        continue
                    self.n_records += 1
                    yield {**_record(flow), "seq": self.n_records}
            except FlowReadException as e:
                self.error = f"mitmproxy flow file unreadable: {e}"
            except Exception as e:  # noqa: BLE001 - a corrupt flow fails in many ways; the file stops there
                self.error = f"mitmproxy flow file unreadable: {type(e).__name__}: {e}"
        if not self.file_id and self.error is None:
            self.error = "no flows in mitmproxy file"


def _message(m: Any) -> dict[str, Any]:
    return {"headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in m.headers.fields]}


def _record(flow: Any) -> dict[str, Any]:
    req, resp = flow.request, flow.response
    path, prefixes = strip_prefixes(req.path)
    episode, source = prefixes.episode, "path" if prefixes.episode else None
    for name, kind in SESSION_HEADERS:
        if episode is None and req.headers.get(name):
            episode, source = req.headers[name], kind
    request = {**_message(req), "method": req.method, "url": req.pretty_url, "body": req.raw_content}
    response = None
    if resp is not None:
        streamed = "text/event-stream" in resp.headers.get("content-type", "")
        response = {**_message(resp), "status": resp.status_code, "body": resp.content, "chunks": None,
                    "streamed": streamed}
    return {
        "type": "exchange",
        "id": flow.id,
        "episode": episode,
        "episode_source": source,
        "role": "agent",
        "toolchain": None,
        "protocol": protocol_name(req.method, path),
        "model": None,
        "t_start": req.timestamp_start,
        "t_first_byte": resp.timestamp_start if resp else None,
        "t_end": resp.timestamp_end if resp else None,
        "complete": resp is not None and flow.error is None,
        "client_request": request,
        "upstream_request": request,
        "response": response,
        "error": flow.error.msg if flow.error else None,
    }
