"""The OpenForge mitmproxy addon, loaded by `mitmdump -s addons/openforge.py --set openforge_upstream_url=...`.

Routes every LLM call a toolchain makes to the RL inference engine, asks the engine for the exact token
ids and logprobs, hides those extras from the toolchain, and records each exchange to a flow file
(docs/flow-format.md). Options and behaviour: docs/addon.md.

Fail closed: once a request is recognised as an LLM call, any failure in here answers the client with an
error; it never goes upstream with the client's credentials or unrecorded.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import math
import secrets
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

from mitmproxy import ctx, exceptions, http
from mitmproxy.net.http import http1
from mitmproxy.proxy.layers.http import _http1
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from . import access, flowfile, options, profiles, translate, wire
from .exchange import (
    Exchange,
    RequestParts,
    ResponseParts,
    body_has_token_ids,
    stream_has_token_ids,
)

logger = logging.getLogger("openforge")
META = "openforge"
UPSTREAM_OK_TTL = 2.0  # seconds a successful upstream answer vouches for reachability (skips the probe)
_KEY_HEADERS = (b"authorization", b"x-api-key")  # where our upstream key sits once the request went upstream
_SERVER_LOG = logging.getLogger("mitmproxy.proxy.server")
# Reward posts: values past these are a verifier's bug or an attack, never a training signal.
MAX_REWARD_BODY = 1 << 20
MAX_METADATA_BYTES = 64 << 10
MAX_METADATA_DEPTH = 32
MAX_ID_CHARS = 256  # episode and task ids
_INT64 = (-(1 << 63), (1 << 64) - 1)  # what msgpack can write
MAX_WARNED_ROLES = 100


class Refused(Exception):
    """A request the proxy answers itself with an error of the client's protocol (and records)."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class _NoStreamingLine(logging.Filter):
    """Drops mitmproxy's `Streaming response from <host>.`, logged for every streamed answer just before its
    first chunk is forwarded. mitmproxy's handlers cost ~0.3 ms per line (formatted twice, and a cross-thread
    wakeup of the event loop for the legacy `add_log` event): time to first token (bench/proxy_overhead.py).
    The per-call line says more."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("Streaming response from "))


class _ErrorPages:
    """Replaces mitmproxy's text/html error page, for a flow whose `error` hook armed one, with an error
    object of the client's protocol.

    mitmproxy 11 and 12 send their own page after the `error` hook whatever the hook sets (letting
    `flow.response` override it is mitmproxy PR #7999, unmerged). `_http1.make_error_response(status, message)`
    builds that page from the very string the flow's `error.msg` holds, so an armed page is matched by that
    string's identity (oldest first when mitmproxy reuses one message for several flows). mitmproxy 12 runs
    the rest of the hook's event on a later pass of the event loop, so a page waits up to `PAGE_TTL` s; one
    never asked for (the client had gone) is dropped then. HTTP/2 clients still get mitmproxy's page (its
    HTTP/2 layer builds it inline).
    """

    PAGE_TTL = 5.0

    def __init__(self) -> None:
        self._pages: list[tuple[str, bytes, float]] = []  # (flow.error.msg, page, deadline)
        self._original: Callable[..., bytes] | None = None

    def install(self) -> None:
        if self._original is None:
            self._original = _http1.make_error_response
            _http1.make_error_response = self.make

    def uninstall(self) -> None:
        if self._original is not None and _http1.make_error_response == self.make:
            _http1.make_error_response = self._original
        self._original = None

    def arm(self, message: str, response: http.Response) -> None:
        now = time.monotonic()
        self._pages = [p for p in self._pages if p[2] > now]
        self._pages.append((message, http1.assemble_response(response), now + self.PAGE_TTL))

    def make(self, status_code: int, message: str = "") -> bytes:
        for i, (armed, page, _) in enumerate(self._pages):
            if armed is message:
                del self._pages[i]
                return page
        assert self._original is not None
        return self._original(status_code, message)


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
        self._error_pages = _ErrorPages()
        self._rewarded: set[str] = set()  # episodes rewarded here under openforge_reward_policy=first
        self._warned_roles: set[str] = set()

    # -- options -------------------------------------------------------------------------------------------
    def load(self, loader: Any) -> None:
        _SERVER_LOG.addFilter(self._log_filter)
        self._error_pages.install()
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
        logger.info(wire.printable(f"OpenForge {self.instance}: upstream {new.upstream_display} (key {key}), "
                                   f"profile {new.engine_profile}, translate {new.translate}, flows -> {new.flow_dir}"))
        logger.info(f"OpenForge routes (role -> engine model, forced sampling): "
                    f"{wire.printable(options.describe_routes(new.routes))}")
        allowed = wire.printable(",".join(new.allow_paths)) or "none"
        logger.info(f"OpenForge access: {len(new.client_tokens)} client token(s), {len(new.reward_tokens)} reward "
                    f"token(s), reward policy {new.reward_policy}, other engine paths allowed: {allowed}")
        self._warned_roles.clear()
        self._check_route(new, new.default_role)

    def running(self) -> None:
        self._running = True
        if self.settings is None:
            ctx.master.shutdown()
            return
        self._warn_open_listen(self.settings)
        if self._profile is None:
            self._start_detection(self.settings)

    @staticmethod
    def _warn_open_listen(s: options.Settings) -> None:
        """Anyone who reaches an open port can spend the upstream key: say so when nothing checks tokens."""
        if s.client_tokens:
            return
        hosts = {ProxyMode.parse(spec).listen_host(ctx.options.listen_host) for spec in ctx.options.mode}
        exposed = sorted(h or "every interface" for h in hosts if not access.is_loopback(h))
        if exposed:
            logger.warning(f"OpenForge: listening on {', '.join(exposed)} without openforge_client_tokens: anyone "
                           f"who reaches the port can spend the upstream key, post rewards and read the status; "
                           f"set client and reward tokens or use --listen-host 127.0.0.1 (docs/addon.md, Security)")

    def _check_route(self, s: options.Settings, role: str) -> None:
        """Warn once per role whose calls match no route while a routing table is set: they keep their model
        and get no forced sampling (an RL rollout at the client's temperature)."""
        if not s.routes or s.route(role) is not None or role in self._warned_roles:
            return
        if len(self._warned_roles) < MAX_WARNED_ROLES:
            self._warned_roles.add(role)
            logger.warning(f"OpenForge: role {wire.printable(repr(role))} has no route and there is no '*' route: "
                           f"its calls keep their model and get no forced sampling")

    def done(self) -> None:
        """Shutdown: write the exchanges still in flight as incomplete; close the file."""
        self._flush_lines()
        for flow in list(self._inflight.values()):
            ex: Exchange | None = flow.metadata.get(META)
            if ex is None:
                continue
            ex.error = ex.error or "proxy shut down while the exchange was in flight"
            self._write(ex, self._response_parts(flow, None, ex) if flow.response else None, complete=False)
        if self.writer is not None:
            self.writer.close()
            self.writer = None  # late error hooks of those flows must not open a new file
        _SERVER_LOG.removeFilter(self._log_filter)
        self._error_pages.uninstall()

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
            protocol = wire.protocol_of(flow.request.path.partition("?")[0]) or "other"
            flow.response = http.Response.make(
                503, wire.error_body(protocol, 503, "OpenForge proxy is not configured (see its log)", "not_configured"),
                {"content-type": "application/json"})
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
        except Refused as e:
            self._answer(flow, ex, e.status, e.message, e.kind)
        except Exception as e:  # noqa: BLE001 - fail closed: answer, never forward half-processed
            logger.exception(f"OpenForge: cannot process {flow.request.method} "
                             f"{wire.printable(wire.masked_url(flow.request.path))}")
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
                self._refuse_unrecorded(flow, ex, problem)

    def error(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.pop(META, None)
        if ex is None:
            return
        self._hide_key(flow)
        ex.error = ex.error or (flow.error.msg if flow.error else "unknown error")
        if flow.response is not None and flow.response.stream:  # the client has this answer's head already
            self._write(ex, self._response_parts(flow, None, ex), complete=False)
            self._log(flow, ex, "ERR")
            return
        s = self.settings
        upstream = s.upstream_display if s is not None else "engine"
        page = self._error_response(ex, 502, f"OpenForge: upstream {upstream} failed: {ex.error}", "upstream_error")
        page.headers["connection"] = "close"  # mitmproxy closes the client's connection after its error page
        if flow.error is not None:
            self._error_pages.arm(flow.error.msg, page)
        self._write(ex, ResponseParts(page.status_code, page.headers.fields, page.raw_content), complete=False)
        self._log(flow, ex, page.status_code)

    # -- request side ----------------------------------------------------------------------------------------
    def _begin(self, flow: http.HTTPFlow, s: options.Settings) -> Exchange | None:
        """Classify the request and check its token; for LLM calls strip the client's credentials and point
        it at the engine. Requests the proxy refuses are answered and recorded here."""
        req = flow.request
        path, _, query = req.path.partition("?")
        if path.startswith(wire.REWARD_PREFIX) or path == wire.STATUS_PATH:
            if path == wire.STATUS_PATH:
                self._status(flow, s)
            else:
                self._reward(flow, path, s)
            _mask_request(req)  # the verifier's or the probe's token
            return None
        direct = self._is_direct(flow)
        vendor = not direct and req.pretty_host.lower() in s.vendor_hosts
        prefixes = wire.Prefixes()
        if direct:
            path, prefixes = wire.strip_prefixes(path)
        kind = wire.classify(req.method, path) if (direct or vendor) else None
        if s.client_tokens and (direct or kind is not None) and not access.matches(
                access.presented(req.headers.fields, prefixes.token), s.client_tokens):
            self._refuse(flow, s, kind, path, prefixes, 401, "OpenForge: missing or unknown API key: present one "
                         "of the proxy's client tokens as the API key", "invalid_api_key")
            return None
        if kind is None:
            if direct and not s.allowed(path):
                self._refuse(flow, s, None, path, prefixes, 403, f"OpenForge: {path} is not an LLM endpoint; "
                             f"only paths listed in openforge_allow_paths are forwarded to the engine",
                             "permission_error")
                return None
            ex = self._new(flow, "other", path) if s.record_other else None
            if vendor and s.block_other:
                flow.response = self._error_response(None, 403, "blocked by OpenForge (openforge_block_other)",
                                                     "permission_error")
                if ex is not None:
                    self._write(ex, self._response_parts(flow, raw=flow.response.raw_content), complete=True)
                return None
            if direct:  # an engine path of openforge_allow_paths (/health, /tokenize, ...): reverse-proxied
                self._to_upstream(flow, s, _upstream_path(s, path, query))
            if ex is not None:
                self._track(flow, ex)
            return ex
        protocol, canonical = kind
        ex = self._new(flow, protocol, path)
        self._describe(flow, ex, prefixes, s)
        self._check_route(s, ex.role)
        self._track(flow, ex)
        self._to_upstream(flow, s, _upstream_path(s, canonical, query), llm=True)
        return ex

    def _describe(self, flow: http.HTTPFlow, ex: Exchange, prefixes: wire.Prefixes, s: options.Settings) -> None:
        """Role, episode and toolchain of a call."""
        headers = wire.header_map(flow.request.headers.fields)  # one pass; mitmproxy's get() scans per call
        ex.role = prefixes.role or headers.get("x-openforge-role") or s.default_role
        ex.episode, ex.episode_source = self._episode(flow, prefixes.episode, headers)
        ex.toolchain = wire.toolchain(headers.get("user-agent"))

    def _refuse(self, flow: http.HTTPFlow, s: options.Settings, kind: tuple[str, str] | None, path: str,
                prefixes: wire.Prefixes, status: int, message: str, error_kind: str) -> None:
        """Answer a request that may not go upstream, in its protocol's error shape; record and log it."""
        ex = self._new(flow, kind[0] if kind else "other", path)
        self._describe(flow, ex, prefixes, s)
        self._answer(flow, ex, status, message, error_kind)
        _mask_request(flow.request)

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
        fields (its `Headers` scan every field per lookup or assignment): every credential header dropped,
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
            if name in drop or wire.is_secret_header(name):
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
        body = _request_json(req.content) if req.method == "POST" else None
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

    def _reward(self, flow: http.HTTPFlow, path: str, s: options.Settings) -> None:
        """POST /openforge/v1/episodes/<episode>/reward: recorded here, never forwarded."""
        episode, _, rest = path[len(wire.REWARD_PREFIX):].partition("/")
        episode = unquote(episode)
        try:
            record = self._reward_record(flow, episode, rest, s)
        except Refused as e:
            status, answer = e.status, {"error": e.message}
            if e.status in (401, 403, 409):
                logger.warning(f"OpenForge: reward refused ({e.status}) episode={wire.printable(episode[:MAX_ID_CHARS])}: "
                               f"{wire.printable(e.message)}")
        else:
            problem = self._write_record(record)
            if problem:
                status, answer = 503, {"error": f"reward not recorded: {problem}"}
            else:
                if s.reward_policy == "first":
                    self._rewarded.add(episode)
                status, answer = 200, {"ok": True, "id": record["id"], "episode": episode}
                logger.info(f"reward episode={wire.printable(episode)} reward={record['reward']:g}")
        flow.response = http.Response.make(status, json.dumps(answer).encode(), {"content-type": "application/json"})

    def _reward_record(self, flow: http.HTTPFlow, episode: str, rest: str, s: options.Settings) -> dict[str, Any]:
        """The reward record a post makes; `Refused` (in the order a client can fix it) when it makes none."""
        req = flow.request
        if rest != "reward" or not episode:
            raise Refused(404, "use POST /openforge/v1/episodes/<episode>/reward", "not_found")
        if req.method != "POST":
            raise Refused(405, "use POST", "method_not_allowed")
        if s.guarded:
            given = access.presented(req.headers.fields, None)
            if not (s.reward_tokens and access.matches(given, s.reward_tokens)):
                if access.matches(given, s.client_tokens):
                    raise Refused(403, "posting a reward needs a reward token (openforge_reward_tokens); a client "
                                  "token is not enough", "permission_error")
                raise Refused(401, "missing or unknown reward token", "invalid_api_key")
        if len(episode) > MAX_ID_CHARS or not episode.isprintable():
            raise Refused(400, f"the episode id must be 1-{MAX_ID_CHARS} printable characters", "invalid_request_error")
        body = _json_object(req.content) if len(req.content or b"") <= MAX_REWARD_BODY else None
        reward = body.get("reward") if body is not None else None
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise Refused(400, 'body must be a JSON object (at most 1 MiB) with a numeric "reward"',
                          "invalid_request_error")
        if isinstance(reward, float) and not math.isfinite(reward):
            raise Refused(400, "reward must be a finite number", "invalid_request_error")
        if not -flowfile.MAX_ABS_REWARD <= reward <= flowfile.MAX_ABS_REWARD:
            limit = flowfile.MAX_ABS_REWARD
            raise Refused(400, f"reward must be between {-limit:g} and {limit:g}", "invalid_request_error")
        task_id = body.get("task_id")
        if task_id is not None and len(str(task_id)) > MAX_ID_CHARS:
            raise Refused(400, f"task_id must be at most {MAX_ID_CHARS} characters", "invalid_request_error")
        metadata = body.get("metadata")
        if metadata is not None:
            _check_metadata(metadata)
        if s.reward_policy == "first" and episode in self._rewarded:
            raise Refused(409, f"episode {episode!r} already has a reward and openforge_reward_policy is first: "
                          "this one is not recorded", "conflict")
        seq = next(self._seq)
        return {"type": "reward", "id": self._record_id(seq), "proxy": self.instance, "seq": seq, "t": time.time(),
                "episode": episode, "reward": float(reward), "task_id": None if task_id is None else str(task_id),
                "metadata": metadata, "reward_policy": s.reward_policy}

    def _status(self, flow: http.HTTPFlow, s: options.Settings) -> None:
        """GET /openforge/v1/status: a readiness probe, answered here. `write_error`: why the last record
        could not be written (calls are answered 503 meanwhile); it stays ready, so traffic can retry."""
        if s.guarded and not access.matches(access.presented(flow.request.headers.fields, None),
                                            s.client_tokens + s.reward_tokens):
            flow.response = http.Response.make(
                401, b'{"ok": false, "error": "missing or unknown token (a client or reward token)"}',
                {"content-type": "application/json"})
            return
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
        except TimeoutError:
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
            self._refuse_unrecorded(flow, ex, problem)
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

    def _refuse_unrecorded(self, flow: http.HTTPFlow, ex: Exchange, problem: str) -> None:
        """Replace an answer whose record could not be written by a 503 in the client's protocol."""
        flow.response = self._error_response(ex, 503, _unrecorded_message(problem), "recording_failed")

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
                        else (profiles.loads(body), False))
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

    @staticmethod
    def _error_response(ex: Exchange | None, status: int, message: str, kind: str) -> http.Response:
        """An error answer in the client's own protocol shape (the one it spoke, when translated)."""
        protocol = _client_protocol(ex) if ex is not None else "chat"
        return http.Response.make(status, wire.error_body(protocol, status, message, kind),
                                  {"content-type": "application/json"})

    def _answer(self, flow: http.HTTPFlow, ex: Exchange | None, status: int, message: str, kind: str) -> None:
        """Answer the client from the proxy in its own protocol's error shape, and record it."""
        flow.response = self._error_response(ex, status, message, kind)
        body = flow.response.raw_content
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
            line = (f"{flow.request.method} {ex.path} {ex.protocol} model={ex.model}->{ex.upstream_model} "
                    f"role={ex.role} episode={ex.episode} {req_bytes}B->{resp_bytes}B {status} {latency:.0f}ms")
            sys.stdout.write(f"[{stamp}] {wire.printable(line)}\n")
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


def _mask_request(req: http.Request) -> None:
    """Mask the credentials of a request that stays here, so mitmproxy's own flow output shows none."""
    req.path = wire.masked_url(req.path)
    req.headers.fields = tuple((k, wire.mask(v.decode("utf-8", "surrogateescape")).encode())
                               if wire.is_secret_header(k) else (k, v) for k, v in req.headers.fields)


def _upstream_path(s: options.Settings, path: str, query: str) -> str:
    """The engine's path for a request: under the upstream prefix, credential query parameters removed."""
    query = wire.public_query(query)
    return s.upstream_prefix + path + (f"?{query}" if query else "")


def _parse_object(data: bytes | None) -> dict[str, Any] | None:
    """A JSON object, else None; RecursionError when nested too deeply for Python's parser."""
    if not data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _json_object(data: bytes | None) -> dict[str, Any] | None:
    """`_parse_object`, with a body nested too deeply read as no object."""
    try:
        return _parse_object(data)
    except RecursionError:
        return None


def _request_json(data: bytes | None) -> dict[str, Any] | None:
    """`_parse_object` of a client's request, refusing one nested too deeply to parse: forwarded as it is,
    it would hand the engine what the proxy itself cannot read, and go unrecorded as a call."""
    try:
        return _parse_object(data)
    except RecursionError:
        raise Refused(400, "OpenForge: the request body is nested too deeply to parse", "invalid_request_error") from None


def _check_metadata(metadata: Any) -> None:
    """Refuse reward metadata that is not a JSON object, too big, too deep, or holds a number a record
    cannot keep (non-finite, or an integer past 64 bits)."""
    if not isinstance(metadata, dict):
        raise Refused(400, '"metadata" must be a JSON object', "invalid_request_error")
    stack: list[tuple[Any, int]] = [(metadata, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_METADATA_DEPTH:
            raise Refused(400, f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep", "invalid_request_error")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, float) and not math.isfinite(value) or (
                isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]):
            raise Refused(400, "metadata numbers must be finite and fit in 64 bits", "invalid_request_error")
    if len(json.dumps(metadata)) > MAX_METADATA_BYTES:
        raise Refused(400, f"metadata must be at most {MAX_METADATA_BYTES >> 10} KiB of JSON", "invalid_request_error")


def _error_message(obj: dict[str, Any] | None) -> str | None:
    if not obj:
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or obj.get("message") or obj.get("detail") or "") or None

