"""The per-call log line: one masked, escaped line per call, printed straight to stdout.

`POST /v1/chat/completions chat model=claude-x->Qwen/Qwen3-8B role=agent episode=ep1 812B->3409B 200 153ms`
(docs/addon.md). Through `logging`, mitmproxy turns every line into an `add_log` event dispatched to all
its addons: that cost 0.6 ms of CPU per request, half of what the addon costs (bench/proxy_overhead.py).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from mitmproxy import http

from . import wire
from .exchange import Exchange

_SERVER_LOG = logging.getLogger("mitmproxy.proxy.server")
VERBOSE = ("info", "alert", "debug")  # termlog_verbosity levels that show the lines (`mitmdump -q` does not)


class _NoStreamingLine(logging.Filter):
    """Drops mitmproxy's `Streaming response from <host>.`, logged for every streamed answer just before its
    first chunk is forwarded. mitmproxy's handlers cost ~0.3 ms per line (formatted twice, and a cross-thread
    wakeup of the event loop for the legacy `add_log` event): time to first token (bench/proxy_overhead.py).
    The per-call line says more."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("Streaming response from "))


class CallLog:
    """Writes the per-call lines; `enabled` is off under `mitmdump -q` and once stdout is gone."""

    def __init__(self) -> None:
        self.enabled = True
        self._flush_scheduled = False  # a stdout flush of the lines waits for the end of this pass
        self._filter = _NoStreamingLine()

    def install(self) -> None:
        _SERVER_LOG.addFilter(self._filter)

    def uninstall(self) -> None:
        _SERVER_LOG.removeFilter(self._filter)

    def line(self, flow: http.HTTPFlow, ex: Exchange, status: int | str, flush: bool = True) -> None:
        """The call's line in mitmdump's format; written with `flush=False`, it is flushed once per pass of
        the event loop (`flush_soon`)."""
        if not self.enabled:
            return
        req_bytes = len(ex.client_request.body or b"")
        resp_bytes = sum(len(c[1]) for c in ex.chunks) if ex.streamed else (
            len(flow.response.raw_content or b"") if flow.response is not None else 0)
        now = time.time()
        latency = ((ex.t_end or now) - ex.t_start) * 1000
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        try:
            text = (f"{flow.request.method} {ex.path} {ex.protocol} model={ex.model}->{ex.upstream_model} "
                    f"role={ex.role} episode={ex.episode} {req_bytes}B->{resp_bytes}B {status} {latency:.0f}ms")
            sys.stdout.write(f"[{stamp}] {wire.printable(text)}\n")
            if flush:
                sys.stdout.flush()
        except OSError:  # stdout gone (closed pipe): the flow file still has the call
            self.enabled = False

    def flush_soon(self) -> None:
        """Flush the lines once per pass of the event loop, after the answers of this pass."""
        if self._flush_scheduled:
            return
        try:
            asyncio.get_running_loop().call_soon(self.flush)
            self._flush_scheduled = True
        except RuntimeError:  # no event loop (hooks called directly): now
            self.flush()

    def flush(self) -> None:
        self._flush_scheduled = False
        if self.enabled:
            try:
                sys.stdout.flush()
            except OSError:
                self.enabled = False
