"""The OpenForge mitmproxy addon: `mitmdump -s addons/openforge.py --set openforge_upstream_url=...`.

Routes every LLM call a toolchain makes to the RL inference engine, asks the engine for the exact token
ids and logprobs, hides those extras from the toolchain, and records each exchange to a flow file
(docs/flow-format.md). Options and behaviour: docs/addon.md.

Fail closed: once a request is recognised as an LLM call, any failure in here answers the client with an
error; it never goes upstream with the client's credentials or unrecorded.
"""

from __future__ import annotations

import sys
from pathlib import Path

# mitmdump -s puts this file's folder on sys.path, not the repo root: make `addons.*` importable.
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import asyncio  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import secrets  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from typing import Any  # noqa: E402
from urllib.parse import unquote  # noqa: E402

from mitmproxy import ctx, exceptions, http  # noqa: E402
from mitmproxy.proxy.mode_specs import ReverseMode  # noqa: E402

from addons import flowfile, options, profiles, translate, wire  # noqa: E402
from addons.exchange import (  # noqa: E402
    Exchange, RequestParts, ResponseParts, body_has_token_ids, stream_has_token_ids,
)

logger = logging.getLogger("openforge")
META = "openforge"
UPSTREAM_OK_TTL = 2.0  # seconds a successful upstream answer vouches for reachability (skips the probe)
_KEY_HEADERS = (b"authorization", b"x-api-key")  # where our upstream key sits once the request went upstream
_SERVER_LOG = logging.getLogger("mitmproxy.proxy.server")


class _NoStreamingLine(logging.Filter):
    """Drops mitmproxy's `Streaming response from <host>.`, logged for every streamed answer just before its
    first chunk is forwarded. mitmproxy's handlers cost ~0.3 ms per line (formatted twice, and a cross-thread
    wakeup of the event loop for the legacy `add_log` event): time to first token (bench/proxy_overhead.py).
    The per-call line says more."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("Streaming response from "))


class OpenForge:
    def __init__(self) -> None:
        self.settings: options.Settings | None = None
        self.writer: flowfile.FlowWriter | None = None
        self.instance = secrets.token_hex(4)
        self.started = time.time()
        self._seq = itertools.count(1)
        self._id_prefix = secrets.token_hex(12)  # record ids: this + the sequence number (uuid4 costs a syscall)
        self._inflight: dict[str, http.HTTPFlow] = {}  # exchange id -> flow
        self._flush_scheduled = False  # a stdout flush of the per-call lines waits for the end of this pass
        self._records = 0
        self._write_error: str | None = None  # why the last write failed; None once one succeeds
        self._profile: str | None = None
        self._detecting: asyncio.Future[str | None] | None = None
        self._upstream_ok_at = float("-inf")
        self._proxy_users: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._running = False
        self._load_error: str | None = None
        self._call_lines = True
        self._log_filter = _NoStreamingLine()

    # -- options -------------------------------------------------------------------------------------------
    def load(self, loader: Any) -> None:
        _SERVER_LOG.addFilter(self._log_filter)
        # A `--set` given twice makes mitmproxy drop this whole script without a word; catch it first.
        deferred = getattr(loader.master.options, "deferred", {})
        for spec in options.SPECS:
            values = getattr(deferred.get(spec.name), "val", None)
            if isinstance(values, list) and len(values) > 1:
                self._load_error = f"{spec.name} is set {len(values)} times; set it once"
                deferred[spec.name] = type(deferred[spec.name])(values[-1:])
            loader.add_option(spec.name, str, spec.default(), spec.help)

    def configure(self, updated: set[str]) -> None:
        if "termlog_verbosity" in updated:  # `mitmdump -q` silences the per-call lines too
            self._call_lines = ctx.options.termlog_verbosity in ("info", "alert", "debug")
        if not updated & options.NAMES:
            return
        try:
            if self._load_error:
                raise options.BadOption(self._load_error)
            new = options.parse({name: getattr(ctx.options, name) for name in options.NAMES})
        except options.BadOption as e:
            if self._running:
                raise exceptions.OptionsError(str(e)) from None
            # At startup mitmproxy would merely disable this script and keep proxying: stop instead.
            # mitmdump exits with status 1 on an error logged during startup; `running` backs that up.
            self.settings = None
            logger.error(f"OpenForge cannot start: {e}")
            return
        if ctx.options.connection_strategy != "lazy":
            # Eager connections reach the client's original host before we can reroute (or answer a 502).
            ctx.options.connection_strategy = "lazy"
        self._apply(new)

    def _apply(self, new: options.Settings) -> None:
        old = self.settings
        if old is None or (old.flow_dir, old.flow_max_bytes, old.fsync_interval) != (
            new.flow_dir, new.flow_max_bytes, new.fsync_interval
        ):
            if self.writer is not None:
                self.writer.close()
            self.writer = flowfile.FlowWriter(new.flow_dir, self.instance, new.flow_max_bytes,
                                              new.fsync_interval, started=self.started)
        if old is None or (old.upstream_url, old.upstream_key, old.engine_profile) != (
            new.upstream_url, new.upstream_key, new.engine_profile
        ):
            self._profile = None if new.engine_profile == "auto" else new.engine_profile
            self._upstream_ok_at = float("-inf")
        self.settings = new
        key = wire.mask(new.upstream_key) if new.upstream_key else "none"
        logger.info(f"OpenForge {self.instance}: upstream {new.upstream_display} (key {key}), "
                    f"profile {new.engine_profile}, translate {new.translate}, flows -> {new.flow_dir}")

    def running(self) -> None:
        self._running = True
        if self.settings is None:
            ctx.master.shutdown()
        elif self._profile is None:
            self._start_detection(self.settings)

    def done(self) -> None:
        """Shutdown: write the exchanges still in flight as incomplete; close the file."""
        self._flush_lines()
        for flow in list(self._inflight.values()):
            ex: Exchange = flow.metadata[META]
            ex.error = ex.error or "proxy shut down while the exchange was in flight"
            self._write(ex, self._response_parts(flow, None, ex) if flow.response else None, complete=False)
        if self.writer is not None:
            self.writer.close()
            self.writer = None  # late error hooks of those flows must not open a new file
        _SERVER_LOG.removeFilter(self._log_filter)

    # -- hooks ---------------------------------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Forward mode: remember the proxy-auth user of a CONNECT tunnel as the episode of its requests."""
        user = wire.proxy_auth_user(flow.request.headers.get("proxy-authorization"))
        if user:
            self._proxy_users[flow.client_conn] = user

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        s = self.settings
        if s is None:
            flow.response = http.Response.make(503, b"OpenForge proxy is not configured (see its log)\n")
            return
        ex: Exchange | None = None
        protocol = "chat"
        try:
            ex = self._begin(flow, s)
            if ex is None or ex.protocol == "other":
                return
            protocol = ex.protocol
            problem = await self._upstream_problem(flow, s)
            if problem:
                self._answer(flow, ex, 502, f"OpenForge: upstream {s.upstream_display} unreachable: {problem}",
                             "upstream_unreachable")
                return
            ex.engine_profile = await self._engine_profile(s)
            self._prepare(flow, ex, s)
        except translate.TranslationError as e:
            self._answer(flow, ex, e.status, e.message, "invalid_request_error")
        except Exception as e:  # noqa: BLE001 - fail closed: answer, never forward half-processed
            logger.exception(f"OpenForge: cannot process {flow.request.method} {flow.request.path}")
            if ex is None:
                flow.response = http.Response.make(
                    500, wire.error_body(protocol, 500, f"OpenForge proxy error: {e}", "proxy_error"),
                    {"content-type": "application/json"})
            else:
                self._answer(flow, ex, 500, f"OpenForge proxy error: {type(e).__name__}: {e}", "proxy_error")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.get(META)
        if ex is None or flow.response is None:
            return
        ex.t_first_byte = flow.response.timestamp_start or time.time()
        if ex.protocol == "other":  # passed through as the client sent it (credentials swapped if direct)
            req = flow.request
            ex.upstream_request = RequestParts(req.method, req.url, req.headers.fields, req.raw_content)
        s = self.settings
        if s is not None and (flow.request.host, flow.request.port) == (s.upstream_host, s.upstream_port):
            self._upstream_ok_at = time.monotonic()
        self._hide_key(flow)
        if ex.protocol == "other" or not wire.is_event_stream(flow.response.headers.fields):
            return
        ex.streamed = True
        if ex.translated is not None and flow.response.status_code == 200:
            ex.translator = translate.stream_translator(ex.translated["from"], ex.client_body or {})
            ex.client_chunks = []
        elif ex.injected and ex.protocol in ("chat", "completions"):
            ex.rewriter = profiles.SseStripper(ex.injected)
        if ex.translator is not None or ex.rewriter is not None:
            flow.response.headers.pop("content-length", None)
        ex.on_end = functools.partial(self._end_stream, flow, ex)
        flow.response.stream = ex.on_chunk

    def response(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.pop(META, None)
        if ex is None or flow.response is None:
            return
        if ex.streamed:
            if ex.on_end is not None:  # the stream callable never saw the end of the stream
                self._end_stream(flow, ex)
            if not ex.written:  # cut the answer short: the client's HTTP response never completes
                flow.kill()
            return
        try:
            self._finish(flow, ex)
        except Exception as e:  # noqa: BLE001 - still write what we have
            logger.exception("OpenForge: cannot finish the exchange record")
            ex.error = ex.error or f"proxy error while finishing: {type(e).__name__}: {e}"
            problem = self._write(ex, self._response_parts(flow, None, ex), complete=False)
            if problem:
                self._refuse(flow, ex, problem)

    def error(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.pop(META, None)
        if ex is None:
            return
        self._hide_key(flow)
        ex.error = ex.error or (flow.error.msg if flow.error else "unknown error")
        response = self._response_parts(flow, None, ex) if flow.response is not None else None
        self._write(ex, response, complete=False)
        self._log(flow, ex, "ERR")

    # -- request side ----------------------------------------------------------------------------------------
    def _begin(self, flow: http.HTTPFlow, s: options.Settings) -> Exchange | None:
        """Classify the request; for LLM calls strip the client's credentials and point it at the engine."""
        req = flow.request
        path, _, query = req.path.partition("?")
        if path.startswith(wire.REWARD_PREFIX):
            self._reward(flow, path)
            return None
        if path == wire.STATUS_PATH:
            self._status(flow, s)
            return None
        direct = self._is_direct(flow)
        vendor = not direct and req.pretty_host.lower() in s.vendor_hosts
        episode = role = None
        if direct:
            path, episode, role = wire.strip_prefixes(path)
        kind = wire.classify(req.method, path) if (direct or vendor) else None
        if kind is None:
            ex = self._new(flow, "other", path) if s.record_other else None
            if vendor and s.block_other:
                flow.response = http.Response.make(
                    403, b'{"error": "blocked by OpenForge (openforge_block_other)"}',
                    {"content-type": "application/json"})
                if ex is not None:
                    self._write(ex, self._response_parts(flow, raw=flow.response.raw_content), complete=True)
                return None
            if direct:  # the engine's other endpoints (/health, /tokenize, ...): reverse-proxied
                self._to_upstream(flow, s, s.upstream_prefix + path + (f"?{query}" if query else ""))
            if ex is not None:
                self._track(flow, ex)
            return ex
        protocol, canonical = kind
        ex = self._new(flow, protocol, path)
        headers = wire.header_map(req.headers.fields)  # one pass; mitmproxy's get() scans every field per call
        ex.role = role or headers.get("x-openforge-role") or s.default_role
        ex.episode, ex.episode_source = self._episode(flow, episode, headers)
        ex.toolchain = wire.toolchain(headers.get("user-agent"))
        self._track(flow, ex)
        self._to_upstream(flow, s, s.upstream_prefix + canonical + (f"?{query}" if query else ""), llm=True)
        return ex

    def _new(self, flow: http.HTTPFlow, protocol: str, path: str) -> Exchange:
        req = flow.request
        seq = next(self._seq)
        ex = Exchange(self._record_id(seq), seq, self.instance, req.timestamp_start, protocol, path)
        ex.role = self.settings.default_role if self.settings else ""
        ex.client_request = RequestParts(req.method, req.pretty_url, req.headers.fields, req.raw_content)
        return ex

    def _record_id(self, seq: int) -> str:
        return f"{self._id_prefix}{seq:08x}"

    def _track(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        flow.metadata[META] = ex
        self._inflight[ex.id] = flow

    def _is_direct(self, flow: http.HTTPFlow) -> bool:
        """Addressed to the proxy itself (reverse mode, or a base URL pointing here) rather than proxied."""
        if isinstance(flow.client_conn.proxy_mode, ReverseMode):
            return True
        sockname = flow.client_conn.sockname
        return bool(sockname) and flow.request.port == sockname[1]

    def _episode(self, flow: http.HTTPFlow, from_path: str | None,
                 headers: dict[str, str]) -> tuple[str | None, str | None]:
        if from_path:
            return from_path, "path"
        if value := headers.get("x-openforge-episode"):
            return value, "header"
        auth = flow.metadata.get("proxyauth")
        user = auth[0] if auth else self._proxy_users.get(flow.client_conn) or wire.proxy_auth_user(
            headers.get("proxy-authorization"))
        if user:
            return user, "proxy_auth"
        for name in ("x-claude-code-session-id", "session-id", "session_id"):
            if value := headers.get(name):
                return value, "session_header"
        return None, None

    def _to_upstream(self, flow: http.HTTPFlow, s: options.Settings, path: str, llm: bool = False) -> None:
        """Point the request at the engine. The headers are rewritten in one pass over mitmproxy's raw
        fields (its `Headers` scan every field per lookup or assignment): the client's credentials dropped,
        Host set, our key added, and for LLM calls `accept-encoding: identity` (we read their answers)."""
        req = flow.request
        req.scheme = s.upstream_scheme
        if (req.host, req.port) != (s.upstream_host, s.upstream_port):  # in reverse mode mitmproxy did it
            req.host, req.port = s.upstream_host, s.upstream_port
        authority = f"{s.upstream_host}:{s.upstream_port}"
        host = authority.encode()
        h2 = req.is_http2 or req.is_http3  # there `:authority` is the host header; Host only overwritten
        drop = wire.DROP_UPSTREAM_LLM_BYTES if llm else wire.DROP_UPSTREAM_BYTES
        fields: list[tuple[bytes, bytes]] = []
        has_host = False
        for k, v in req.headers.fields:
            name = k.lower()
            if name in drop:
                continue
            if name == b"host":
                v, has_host = host, True
            fields.append((k, v))
        if not (has_host or h2):
            fields.insert(0, (b"Host", host))
        if llm:
            fields.append((b"accept-encoding", b"identity"))
        if s.upstream_key:
            fields.append((b"authorization", f"Bearer {s.upstream_key}".encode()))
        req.headers.fields = tuple(fields)
        if h2:
            req.authority = authority
        req.path = path

    def _prepare(self, flow: http.HTTPFlow, ex: Exchange, s: options.Settings) -> None:
        """Routing, translation and token-id injection on the body; then freeze what goes upstream."""
        req = flow.request
        body = _json_object(req.content) if req.method == "POST" else None
        if body is not None:
            if isinstance(body.get("model"), str):
                ex.model = body["model"]
            engine_protocol = ex.protocol
            client_protocol = "anthropic" if ex.protocol == "anthropic_count_tokens" else ex.protocol
            if translate.needs_translation(client_protocol, ex.engine_profile, s.translate):
                if ex.protocol == "anthropic_count_tokens":
                    chat, dropped = translate.count_tokens_request(body), []
                else:
                    chat, dropped = translate.request_to_chat(ex.protocol, body)
                ex.translated = {"from": ex.protocol, "to": "chat", "dropped": dropped}
                ex.client_body = body
                body, engine_protocol = chat, "chat"
                req.path = s.upstream_prefix + wire.CANONICAL["chat"]
                if s.upstream_key and "x-api-key" in req.headers:
                    del req.headers["x-api-key"]
            elif ex.protocol in wire.ANTHROPIC_PROTOCOLS and s.upstream_key:
                req.headers["x-api-key"] = s.upstream_key
            route = s.route(ex.role)
            if route is not None:
                if isinstance(body.get("model"), str):
                    body["model"] = route.upstream_model(body["model"])
                for key, value in route.sampling.items():
                    if body.get(key) != value:
                        body[key] = value
                        ex.injected.append(key)
            ex.upstream_model = body.get("model") if isinstance(body.get("model"), str) else None
            ex.injected += profiles.inject(ex.engine_profile, engine_protocol, body)
            if ex.injected or ex.translated or route is not None:
                _set_body(req, profiles.encode_json(body).encode())
        ex.upstream_request = RequestParts(req.method, req.url, req.headers.fields, req.raw_content)

    def _reward(self, flow: http.HTTPFlow, path: str) -> None:
        """POST /openforge/v1/episodes/<episode>/reward: recorded here, never forwarded."""
        episode, _, rest = path[len(wire.REWARD_PREFIX):].partition("/")
        episode = unquote(episode)
        status, answer = 200, {}
        body = _json_object(flow.request.content or b"")
        if rest != "reward" or not episode:
            status, answer = 404, {"error": "use POST /openforge/v1/episodes/<episode>/reward"}
        elif flow.request.method != "POST":
            status, answer = 405, {"error": "use POST"}
        elif body is None or isinstance(body.get("reward"), bool) or not isinstance(body.get("reward"), (int, float)):
            status, answer = 400, {"error": 'body must be a JSON object with a numeric "reward"'}
        elif body.get("metadata") is not None and not isinstance(body.get("metadata"), dict):
            status, answer = 400, {"error": '"metadata" must be a JSON object'}
        else:
            seq = next(self._seq)
            record = {"type": "reward", "id": self._record_id(seq), "proxy": self.instance,
                      "seq": seq, "t": time.time(), "episode": episode,
                      "reward": float(body["reward"]),
                      "task_id": None if body.get("task_id") is None else str(body["task_id"]),
                      "metadata": body.get("metadata")}
            problem = self._write_record(record)
            if problem:
                status, answer = 503, {"error": f"reward not recorded: {problem}"}
            else:
                answer = {"ok": True, "id": record["id"], "episode": episode}
                logger.info(f"reward episode={episode} reward={record['reward']:g}")
        flow.response = http.Response.make(status, json.dumps(answer).encode(),
                                           {"content-type": "application/json"})

    def _status(self, flow: http.HTTPFlow, s: options.Settings) -> None:
        """GET /openforge/v1/status: a readiness probe, answered here. `write_error`: why the last record
        could not be written (calls are answered 503 meanwhile); it stays ready, so traffic can retry."""
        writer = self.writer
        ok = writer is not None
        answer = {"ok": ok, "write_error": self._write_error, "proxy": self.instance, "started": self.started,
                  "upstream": s.upstream_display, "engine_profile": self._profile,
                  "flow_file": str(writer.current_path) if writer and writer.current_path else None,
                  "records": self._records, "in_flight": len(self._inflight)}
        flow.response = http.Response.make(200 if ok else 503, json.dumps(answer).encode(),
                                           {"content-type": "application/json"})

    # -- engine --------------------------------------------------------------------------------------------
    async def _upstream_problem(self, flow: http.HTTPFlow, s: options.Settings) -> str | None:
        """None if the engine accepts connections; probed only when no answer arrived recently and this
        client's connection has no open connection to the engine that mitmproxy would reuse."""
        if time.monotonic() - self._upstream_ok_at < UPSTREAM_OK_TTL:
            return None
        server = flow.server_conn
        if server.connected and server.address == (s.upstream_host, s.upstream_port):
            return None
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(s.upstream_host, s.upstream_port), 3.0)
        except asyncio.TimeoutError:
            return "connect timed out"
        except OSError as e:
            return e.strerror or str(e)
        writer.close()
        self._upstream_ok_at = time.monotonic()
        return None

    def _start_detection(self, s: options.Settings) -> asyncio.Future[str | None]:
        if self._detecting is None or self._detecting.done():
            url = f"{s.upstream_scheme}://{s.upstream_host}:{s.upstream_port}{s.upstream_prefix}/v1/models"
            self._detecting = asyncio.ensure_future(asyncio.to_thread(profiles.detect, url, s.upstream_key))
        return self._detecting

    async def _engine_profile(self, s: options.Settings) -> str:
        if self._profile is not None:
            return self._profile
        found = await asyncio.shield(self._start_detection(s))
        if found is not None and self._profile is None and s is self.settings:
            self._profile = found
            logger.info(f"OpenForge: engine profile detected: {found}")
        return found or "generic"

    # -- response side -------------------------------------------------------------------------------------
    def _finish(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        """A non-streamed answer: make the client's (stripped or translated) and record the exchange, all
        before mitmproxy sends it (it does once this hook returns); unrecorded, the client gets a 503."""
        resp = flow.response
        assert resp is not None
        ex.t_end = time.time()
        client_response = None
        response = self._response_parts(flow, raw=resp.raw_content)
        has_ids = False
        if ex.translated is not None:
            has_ids = body_has_token_ids(resp.content)
            self._translate_body(flow, ex)
            client_response = self._response_parts(flow, raw=resp.raw_content)
        elif ex.protocol != "other":
            has_ids = self._strip_body(resp, ex)
        status = resp.status_code
        problem = self._record(ex, response, client_response, has_ids)
        if problem:
            self._refuse(flow, ex, problem)
            status = 503
        self._log(flow, ex, status, flush=False)
        self._flush_soon()

    def _end_stream(self, flow: http.HTTPFlow, ex: Exchange) -> bytes | None:
        """`Exchange.on_end`: the stream has ended and its terminal event is held. Record the exchange now,
        so the client has its whole answer only once the record is in the OS; unrecorded, return the error
        event it gets instead (the `response` hook then cuts the answer short). Never raises."""
        ex.on_end = None
        try:
            ex.t_end = time.time()
            response = self._response_parts(flow, None, ex)
            client_response = response._replace(chunks=ex.client_chunks) if ex.client_chunks is not None else None
            problem = self._record(ex, response, client_response, None)
        except Exception as e:  # noqa: BLE001 - never raise into mitmproxy's stream handling
            logger.exception("OpenForge: cannot record a streamed exchange")
            problem = f"proxy error: {type(e).__name__}: {e}"
        status = flow.response.status_code if flow.response is not None else "ERR"
        self._log(flow, ex, 503 if problem else status, flush=False)
        self._flush_soon()
        return _error_event(_client_protocol(ex), _unrecorded_message(problem)) if problem else None

    def _record(self, ex: Exchange, response: ResponseParts, client_response: ResponseParts | None,
                has_ids: bool | None) -> str | None:
        """Write the exchange's record (flushed to the OS); why not, if it could not be written."""
        try:
            if has_ids is None:
                has_ids = (ex.rewriter is not None and ex.rewriter.saw_ids) or stream_has_token_ids(ex.chunks)
            return self._write(ex, response, complete=True, client_response=client_response, has_ids=has_ids)
        except Exception as e:  # noqa: BLE001 - still write what we have
            logger.exception("OpenForge: cannot write the exchange record")
            ex.error = ex.error or f"proxy error while recording: {type(e).__name__}: {e}"
            return self._write(ex, None, complete=False)

    def _refuse(self, flow: http.HTTPFlow, ex: Exchange, problem: str) -> None:
        """Replace an answer whose record could not be written by a 503 in the client's protocol."""
        body = wire.error_body(_client_protocol(ex), 503, _unrecorded_message(problem), "recording_failed")
        flow.response = http.Response.make(503, body, {"content-type": "application/json"})

    def _flush_soon(self) -> None:
        """Flush the per-call lines once per pass of the event loop, after the answers of this pass."""
        if self._flush_scheduled:
            return
        try:
            asyncio.get_running_loop().call_soon(self._flush_lines)
            self._flush_scheduled = True
        except RuntimeError:  # no event loop (hooks called directly): now
            self._flush_lines()

    def _flush_lines(self) -> None:
        self._flush_scheduled = False
        if self._call_lines:
            try:
                sys.stdout.flush()
            except OSError:
                self._call_lines = False

    @staticmethod
    def _strip_body(resp: http.Response, ex: Exchange) -> bool:
        """Remove injected fields from a JSON answer (parsed once, for both jobs); whether it has token ids.

        Prompt ids we asked for are dropped unparsed: an agent's prompt has tens of thousands.
        """
        body = resp.content
        marks = profiles.markers(ex.injected) if resp.status_code == 200 else ()
        if not body or not any(m in body for m in marks):  # nothing of ours in it: leave the bytes alone
            return body_has_token_ids(body)
        try:
            obj, cut = (profiles.loads_without_prompt_ids(body) if "return_token_ids" in ex.injected
                        else (json.loads(body), False))
        except ValueError:
            return False
        if not isinstance(obj, dict):
            return False
        has_ids = cut or profiles.has_token_ids(obj)
        if profiles.strip(obj, ex.injected):
            _set_body(resp, profiles.encode_json(obj).encode())
        return has_ids

    def _translate_body(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        resp = flow.response
        assert resp is not None and ex.translated is not None
        source = ex.translated["from"]
        client = "anthropic" if source == "anthropic_count_tokens" else source
        engine = _json_object(resp.content)
        try:
            if resp.status_code >= 400 or engine is None:
                message = _error_message(engine) or resp.get_text(strict=False) or f"engine answered {resp.status_code}"
                out = translate.error_body(client, resp.status_code if resp.status_code >= 400 else 502, message)
                if resp.status_code < 400:
                    resp.status_code = 502
            elif source == "anthropic_count_tokens":
                out = translate.count_tokens_response(engine)
            else:
                out = translate.response_from_chat(source, engine, ex.client_body or {})
        except translate.TranslationError as e:
            out, resp.status_code = translate.error_body(client, e.status, e.message), e.status
            ex.error = e.message
        resp.content = json.dumps(out, ensure_ascii=False).encode()
        resp.headers["content-type"] = "application/json"

    def _answer(self, flow: http.HTTPFlow, ex: Exchange | None, status: int, message: str, kind: str) -> None:
        """Answer the client from the proxy in its own protocol's error shape, and record it."""
        protocol = _client_protocol(ex) if ex is not None else "chat"
        body = wire.error_body(protocol, status, message, kind)
        flow.response = http.Response.make(status, body, {"content-type": "application/json"})
        if ex is not None:
            flow.metadata.pop(META, None)
            if ex.model is None:  # answered before the body was read (engine down)
                model = (_json_object(ex.client_request.body) or {}).get("model")
                ex.model = model if isinstance(model, str) else None
            ex.error = message
            ex.upstream_request = None
            ex.t_end = time.time()
            self._write(ex, self._response_parts(flow, raw=body), complete=True)
            self._log(flow, ex, status)

    @staticmethod
    def _response_parts(flow: http.HTTPFlow, raw: bytes | None, ex: Exchange | None = None) -> ResponseParts:
        resp = flow.response
        assert resp is not None
        streamed = ex is not None and ex.streamed
        return ResponseParts(resp.status_code, resp.headers.fields, None if streamed else raw,
                             ex.chunks if streamed else None)

    def _hide_key(self, flow: http.HTTPFlow) -> None:
        """The request has gone upstream: mask our key in the flow so no other addon or log shows it."""
        headers = flow.request.headers
        headers.fields = tuple(
            (k, wire.mask(v.decode("utf-8", "surrogateescape")).encode()) if k.lower() in _KEY_HEADERS else (k, v)
            for k, v in headers.fields
        )

    # -- output --------------------------------------------------------------------------------------------
    def _write(self, ex: Exchange, response: ResponseParts | None, complete: bool,
               client_response: ResponseParts | None = None, has_ids: bool = False) -> str | None:
        """Write the exchange's record once; why not, if it could not be written."""
        if ex.written:  # at shutdown, before mitmproxy's own error hook for the same flow
            return None
        if ex.t_end is None:
            ex.t_end = time.time()
        record = ex.record(response, client_response, complete, has_ids)
        self._inflight.pop(ex.id, None)
        problem = self._write_record(record)
        ex.written = problem is None
        return problem

    def _write_record(self, record: dict[str, Any]) -> str | None:
        """Append a record to the flow file, flushed to the OS; why not, if it could not be written (logged:
        the caller answers its client with an error instead). A later write tries again."""
        if self.writer is None:
            return "the proxy is shutting down"
        try:
            self.writer.write(record)
        except OSError as e:
            self._write_error = f"cannot write a flow file in {self.writer.directory}: {e.strerror or e}"
            logger.error(f"OpenForge: {record['type']} record {record['id']} not written: {self._write_error}")
            return self._write_error
        self._records += 1
        self._write_error = None
        return None

    def _log(self, flow: http.HTTPFlow, ex: Exchange, status: int | str, flush: bool = True) -> None:
        """The masked per-call line, printed straight to stdout in mitmdump's line format.

        Through `logging`, mitmproxy turns every line into an `add_log` event dispatched to all its addons:
        that cost 0.6 ms of CPU per request, half of what the addon costs (bench/proxy_overhead.py).
        Lines written with `flush=False` are flushed once per event-loop pass (`_flush_soon`).
        """
        if not self._call_lines:
            return
        req_bytes = len(ex.client_request.body or b"")
        resp_bytes = sum(len(c[1]) for c in ex.chunks) if ex.streamed else (
            len(flow.response.raw_content or b"") if flow.response is not None else 0)
        now = time.time()
        latency = ((ex.t_end or now) - ex.t_start) * 1000
        stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
        try:
            sys.stdout.write(f"[{stamp}] {flow.request.method} {ex.path} {ex.protocol} model={ex.model}->"
                             f"{ex.upstream_model} role={ex.role} episode={ex.episode} {req_bytes}B->{resp_bytes}B "
                             f"{status} {latency:.0f}ms\n")
            if flush:
                sys.stdout.flush()
        except OSError:  # stdout gone (closed pipe): the flow file still has the call
            self._call_lines = False


def _set_body(message: http.Message, data: bytes) -> None:
    """`message.content = data`, minus mitmproxy's per-call header scans when the body is not encoded."""
    fields = message.headers.fields
    names = [k.lower() for k, _ in fields]
    if b"content-encoding" in names:
        message.content = data  # mitmproxy re-encodes it
        return
    message.raw_content = data
    if b"transfer-encoding" not in names:
        length = str(len(data)).encode()
        message.headers.fields = tuple((k, length) if n == b"content-length" else (k, v)
                                       for (k, v), n in zip(fields, names))
        if b"content-length" not in names:
            message.headers.fields += ((b"content-length", length),)


def _client_protocol(ex: Exchange) -> str:
    return ex.translated["from"] if ex.translated is not None else ex.protocol


def _unrecorded_message(problem: str) -> str:
    return f"OpenForge: the answer was not delivered because it could not be recorded ({problem})"


def _error_event(protocol: str, message: str) -> bytes:
    """An SSE error event in the client's protocol: Anthropic and Responses name it, Chat sends bare data."""
    body = wire.error_body(protocol, 503, message, "recording_failed")
    named = protocol in wire.ANTHROPIC_PROTOCOLS or protocol == "responses"
    return (b"event: error\n" if named else b"") + b"data: " + body + b"\n\n"


def _json_object(data: bytes | None) -> dict[str, Any] | None:
    if not data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _error_message(obj: dict[str, Any] | None) -> str | None:
    if not obj:
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or obj.get("message") or obj.get("detail") or "") or None


addons = [OpenForge()]
