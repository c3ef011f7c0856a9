"""The recorder: owns the flow file, the record ids and the exchanges in flight.

Durable before released: the routing addon asks `record` for an exchange's record before mitmproxy sends
the client its answer (or the terminal event of its stream), and answers with an error when it could not
be written. At shutdown the exchanges still in flight are written as incomplete.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from typing import Any

from mitmproxy import http

from openforge.protocols.engine_ids import stream_has_token_ids

from . import flowfile, options
from .episode_calls import EpisodeCalls
from .exchange import Exchange, ResponseParts

logger = logging.getLogger("openforge")
META = "openforge"  # the flow.metadata key of a flow's Exchange


def response_parts(flow: http.HTTPFlow, raw: bytes | None, ex: Exchange | None = None) -> ResponseParts:
    """What a record keeps of the flow's response: the body, or the chunks of a streamed one."""
    resp = flow.response
    assert resp is not None
    if ex is not None and ex.streamed:
        return ResponseParts(resp.status_code, resp.headers.fields, None, ex.chunks)
    return ResponseParts(resp.status_code, resp.headers.fields, raw, None)


class Recorder:
    """`instance` names this proxy in every record and flow file; `records` counts the records written,
    `write_error` says why the last write failed (None once one succeeds)."""

    def __init__(self) -> None:
        self.instance = secrets.token_hex(4)
        self.started = time.time()
        self.writer: flowfile.FlowWriter | None = None
        self.inflight: dict[str, http.HTTPFlow] = {}  # exchange id -> flow
        self.records = 0
        self.write_error: str | None = None
        self.episode_calls = EpisodeCalls()  # how each episode's calls were answered
        self._seq = itertools.count(1)
        self._id_prefix = secrets.token_hex(12)  # record ids: this + the sequence number (uuid4 costs a syscall)
        self._where: tuple[Any, ...] | None = None  # the writer's (directory, max bytes, fsync interval, key)

    def configure(self, s: options.Settings) -> None:
        """Open the flow file's writer, again when its directory, size, fsync interval or key changed."""
        self.episode_calls.count_tokens = s.episode_max_tokens > 0
        where = (s.flow_dir, s.flow_max_bytes, s.fsync_interval, s.flow_key)
        if where == self._where:
            return
        if self.writer is not None:
            self.writer.close()
        self.writer = flowfile.FlowWriter(s.flow_dir, self.instance, s.flow_max_bytes, s.fsync_interval,
                                          started=self.started, key=s.flow_key)
        self._where = where

    def next_id(self) -> tuple[str, int]:
        """A new record's (id, sequence number)."""
        seq = next(self._seq)
        return f"{self._id_prefix}{seq:08x}", seq

    def track(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        """Attach the exchange to its flow; it is in flight until its record is written."""
        flow.metadata[META] = ex
        self.inflight[ex.id] = flow

    def record(self, ex: Exchange, response: ResponseParts, client_response: ResponseParts | None,
               has_ids: bool | None) -> str | None:
        """Write a finished exchange's record (flushed to the OS); why not, if it could not be written.
        `has_ids` None: look for token ids in the stream."""
        try:
            if has_ids is None:
                has_ids = (ex.rewriter is not None and ex.rewriter.saw_ids) or stream_has_token_ids(ex.chunks)
            return self.write(ex, response, complete=True, client_response=client_response, has_ids=has_ids)
        except Exception as e:  # still write what we have
            logger.exception("OpenForge: cannot write the exchange record")
            ex.error = ex.error or f"proxy error while recording: {type(e).__name__}: {e}"
            return self.write(ex, None, complete=False)

    def write(self, ex: Exchange, response: ResponseParts | None, complete: bool,
              client_response: ResponseParts | None = None, has_ids: bool = False) -> str | None:
        """Write the exchange's record once; why not, if it could not be written."""
        if ex.written:  # at shutdown, before mitmproxy's own error hook for the same flow
            return None
        if ex.t_end is None:
            ex.t_end = time.time()
        record = ex.record(response, client_response, complete, has_ids)
        self.inflight.pop(ex.id, None)
        problem = self.write_record(record)
        ex.written = problem is None
        self.episode_calls.add(ex, response if problem is None else None)
        return problem

    def write_record(self, record: flowfile.FlowRecord) -> str | None:
        """Append a record to the flow file, flushed to the OS; why not, if it could not be written (logged:
        the caller answers its client with an error instead). A later write tries again."""
        if self.writer is None:
            return "the proxy is shutting down"
        try:
            self.writer.write(record)
        except OSError as e:
            self.write_error = f"cannot write a flow file in {self.writer.directory}: {e.strerror or e}"
            logger.error(f"OpenForge: {record['type']} record {record['id']} not written: {self.write_error}")
            return self.write_error
        self.records += 1
        self.write_error = None
        return None

    def done(self) -> None:
        """Shutdown: write the exchanges still in flight as incomplete; close the file."""
        for flow in list(self.inflight.values()):
            ex: Exchange | None = flow.metadata.get(META)
            if ex is None:
                continue
            ex.error = ex.error or "proxy shut down while the exchange was in flight"
            self.write(ex, response_parts(flow, None, ex) if flow.response else None, complete=False)
        if self.writer is not None:
            self.writer.close()
            self.writer = None  # late error hooks of those flows must not open a new file
