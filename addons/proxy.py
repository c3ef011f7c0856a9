"""The OpenForge mitmproxy addon, loaded by `mitmdump -s addons/openforge.py --set openforge_upstream_url=...`.

Routes every LLM call a toolchain makes to the RL inference engine, asks the engine for the exact token
ids and logprobs, hides those extras from the toolchain, and records each exchange to a flow file
(docs/flow-format.md). Options and behaviour: docs/addon.md.

Fail closed: once a request is recognised as an LLM call, any failure in here answers the client with an
error; it never goes upstream with the client's credentials or unrecorded.

This is the routing addon: mitmproxy's hooks, in the order a call takes them. Each other concern is a
plain part it calls: `options` (declared and parsed once), `routes` (pure route planning), `engine`
(reachability probe, profile), `control` (reward, policy, pause and status endpoints; `pause` holds calls),
`recorder` (flow file, in-flight exchanges, shutdown), `calllog` (the per-call line), `errors` and `bodies`
(what the client gets).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from typing import Any

from mitmproxy import ctx, exceptions, http, tcp, udp
from mitmproxy.proxy.mode_specs import ProxyMode, ReverseMode

from openforge.protocols import client_keys, endpoints
from openforge.protocols.engine_ids import body_has_token_ids
from openforge.protocols.errors import ProtocolError

from . import (
    access,
    bodies,
    calllog,
    control,
    errors,
    flowfile,
    options,
    profiles,
    prompt_ids,
    routes,
    secrecy,
    translate,
    wire,
)
from .calllog import CallLog
from .control import Control
from .errors import Refused
from .exchange import Exchange, RequestParts, ResponseParts
from .recorder import META, Recorder, response_parts
from .upstream import UpstreamProbe, check_role_upstreams

logger = logging.getLogger("openforge")
_KEY_HEADERS = (b"authorization", b"x-api-key")  # where our upstream key sits once the request went upstream
MAX_WARNED_ROLES = 100


class OpenForge:
    """The routing addon; `recorder`, `engine`, `control` and `calllog` are its parts (docs/addon.md, Structure)."""

    def __init__(self) -> None:
        self.settings: options.Settings | None = None
        self.recorder = Recorder()
        self.engine = UpstreamProbe()
        self.role_engines: dict[str, UpstreamProbe] = {}  # upstream URL -> what is known of a role's own upstream
        self.control = Control(self.recorder, self.engine)
        self.calllog = CallLog()
        self._error_pages = errors.ErrorPages()
        self._proxy_users: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._running = False
        self._load_error: str | None = None
        self._warned_roles: set[str] = set()

    # -- options -------------------------------------------------------------------------------------------
    def load(self, loader: Any) -> None:
        secrecy.make_nondumpable()  # before any secret is read
        self.calllog.install()
        self._error_pages.install()
        self._load_error = options.declare(loader)

    def configure(self, updated: set[str]) -> None:
        if "termlog_verbosity" in updated:  # `mitmdump -q` silences the per-call lines too
            self.calllog.enabled = ctx.options.termlog_verbosity in calllog.VERBOSE
        if not updated & options.NAMES:
            return
        try:
            if self._load_error:
                raise options.BadOption(self._load_error)
            new = options.parse({name: getattr(ctx.options, name) for name in options.NAMES})
            check_role_upstreams(new)
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
        self.control.configure(new, updated)

    def _apply(self, new: options.Settings) -> None:
        self.recorder.configure(new)
        self.engine.configure(new)
        urls = {up.url for up in new.role_upstreams().values()}
        self.role_engines = {url: self.role_engines.get(url) or UpstreamProbe() for url in urls}
        for role in new.role_upstreams():
            self.role_engines[new.for_role(role).upstream_url].configure(new.for_role(role))
        self.settings = new
        key = wire.mask(new.upstream_key) if new.upstream_key else "none"
        logger.info(wire.printable(f"OpenForge {self.recorder.instance}: upstream {new.upstream_display} (key {key}), "
                                   f"profile {new.engine_profile}, translate {new.translate}, flows -> {new.flow_dir}"))
        logger.info(f"OpenForge routes (role -> engine model, forced sampling): "
                    f"{wire.printable(options.describe_routes(new.routes))}")
        allowed = wire.printable(",".join(new.allow_paths)) or "none"
        hosts = wire.printable(",".join(new.allow_hosts)) or "none"
        logger.info(f"OpenForge access: {len(new.client_tokens)} client token(s), {len(new.reward_tokens)} reward "
                    f"token(s), reward policy {new.reward_policy}, other engine paths allowed: {allowed}, other "
                    f"hosts allowed in forward mode: {hosts}, flow files {'signed' if new.flow_key else 'unsigned'}")
        self._warned_roles.clear()
        self._check_route(new, new.default_role)

    def running(self) -> None:
        self._running = True
        if self.settings is None:
            ctx.master.shutdown()
            return
        self._warn_open_listen(self.settings)
        if self.engine.profile is None:
            self.engine.start_detection(self.settings)

    @staticmethod
    def _warn_open_listen(s: options.Settings) -> None:
        """Anyone who reaches an open port can spend the upstream key: say so when nothing checks tokens."""
        if s.client_tokens:
            return
        hosts = {ProxyMode.parse(spec).listen_host(ctx.options.listen_host) for spec in ctx.options.mode}
        exposed = sorted(h or "every interface" for h in hosts if not access.is_loopback(h))
        if exposed:
            logger.warning(f"OpenForge: listening on {', '.join(exposed)} without openforge_client_tokens: anyone "
                           f"who reaches the port can spend the upstream key, post rewards, set the policy version, "
                           f"pause the proxy and read the status; set client and reward tokens or use "
                           f"--listen-host 127.0.0.1 (docs/addon.md, Security)")

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
        """Shutdown: the per-call lines flushed, the exchanges in flight written as incomplete, the file closed."""
        self.calllog.flush()
        self.recorder.done()
        self.calllog.uninstall()
        self._error_pages.uninstall()

    # -- hooks ---------------------------------------------------------------------------------------------
    def http_connect(self, flow: http.HTTPFlow) -> None:
        """Forward mode: a tunnel only to a vendor host (or one of `openforge_allow_hosts`); remember its
        proxy-auth user as the episode of its requests."""
        s = self.settings
        host = flow.request.host.lower()
        if s is None:
            flow.response = errors.protocol_error("other", 503, "OpenForge proxy is not configured (see its log)",
                                                  "not_configured")
            return
        if host not in s.vendor_hosts and not s.host_allowed(host):
            self._refuse(flow, s, None, flow.request.pretty_url, endpoints.Prefixes(), 403,
                         f"OpenForge: no tunnel to {host}: forward mode reaches only openforge_vendor_hosts and "
                         "openforge_allow_hosts", "permission_error")
            return
        user = wire.proxy_auth_user(flow.request.headers.get("proxy-authorization"))
        if user:
            self._proxy_users[flow.client_conn] = user

    def tcp_start(self, flow: tcp.TCPFlow | udp.UDPFlow) -> None:
        """A raw stream (SOCKS or transparent mode, a tunnel that does not speak HTTP): only to a vendor host
        or one of `openforge_allow_hosts`, like a request; another is cut and logged."""
        s = self.settings
        address = flow.server_conn.address
        host = (flow.server_conn.sni or (address[0] if address else "")).lower()
        if s is not None and (host in s.vendor_hosts or s.host_allowed(host)):
            return
        logger.warning(f"OpenForge: {type(flow).__name__[:3].upper()} stream to {wire.printable(host or '?')} "
                       f"refused: forward mode reaches only openforge_vendor_hosts and openforge_allow_hosts")
        flow.kill()

    udp_start = tcp_start

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response or flow.error or not flow.live:
            return
        s = self.settings
        if s is None:
            protocol = endpoints.protocol_of(flow.request.path.partition("?")[0]) or "other"
            flow.response = errors.protocol_error(protocol, 503, "OpenForge proxy is not configured (see its log)",
                                                  "not_configured")
            return
        ex: Exchange | None = None
        protocol = "chat"
        try:
            ex = self._begin(flow, s)
            if ex is None or ex.protocol == "other":
                return
            protocol = ex.protocol
            await self.control.pause.wait()
            ex.policy_version = self.control.policy_version  # the weights it will meet, a held call's too
            rs, upstream = s.for_role(ex.role), self._engine_for(s, ex.role)
            problem = await upstream.problem(flow, rs)
            if problem:
                self._answer(flow, ex, 502, f"OpenForge: upstream {rs.upstream_display} unreachable: {problem}",
                             "upstream_unreachable")
                return
            ex.engine_profile = await upstream.profile_for(rs)
            self._prepare(flow, ex, rs)
        except ProtocolError as e:
            self._answer(flow, ex, e.status, e.message, "invalid_request_error")
        except Refused as e:
            self._answer(flow, ex, e.status, e.message, e.kind)
        except Exception as e:  # fail closed: answer, never forward half-processed
            logger.exception(f"OpenForge: cannot process {flow.request.method} "
                             f"{wire.printable(wire.masked_url(flow.request.path))}")
            if ex is None:
                flow.response = errors.protocol_error(protocol, 500, f"OpenForge proxy error: {e}", "proxy_error")
            else:
                self._answer(flow, ex, 500, f"OpenForge proxy error: {type(e).__name__}: {e}", "proxy_error")

    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.get(META)
        if ex is None or flow.response is None:
            return
        if ex.prompt_ids is not None:  # asked beside the call: almost always answered before the engine's answer
            ex.engine_prompt_ids, ex.engine_prompt_error = await prompt_ids.result(ex.prompt_ids)
            ex.prompt_ids = None
        ex.t_first_byte = flow.response.timestamp_start or time.time()
        if ex.protocol == "other":  # passed through as the client sent it (credentials swapped if direct)
            req = flow.request
            ex.upstream_request = RequestParts(req.method, req.url, req.headers.fields, req.raw_content)
        s = self.settings
        if s is not None:
            rs = s.for_role(ex.role) if ex.protocol != "other" else s
            if (flow.request.host, flow.request.port) == (rs.upstream_host, rs.upstream_port):
                self._engine_for(s, ex.role if ex.protocol != "other" else None).answered()
        self._hide_key(flow)
        if ex.protocol == "other" or not wire.is_event_stream(flow.response.headers.fields):
            return
        ex.streamed = True
        if ex.translated is not None and flow.response.status_code == 200:
            ex.translator = translate.stream_translator(ex.translated["from"], ex.client_body or {})
            ex.client_chunks = []
        elif ex.injected and ex.protocol in ("chat", "completions", "responses"):
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
        except Exception as e:  # still write what we have
            logger.exception("OpenForge: cannot finish the exchange record")
            ex.error = ex.error or f"proxy error while finishing: {type(e).__name__}: {e}"
            problem = self.recorder.write(ex, response_parts(flow, None, ex), complete=False)
            if problem:
                self._refuse_unrecorded(flow, ex, problem)

    def error(self, flow: http.HTTPFlow) -> None:
        ex: Exchange | None = flow.metadata.pop(META, None)
        if ex is None:
            return
        self._hide_key(flow)
        ex.error = ex.error or (flow.error.msg if flow.error else "unknown error")
        if flow.response is not None and flow.response.stream:  # the client has this answer's head already
            self.recorder.write(ex, response_parts(flow, None, ex), complete=False)
            self.calllog.line(flow, ex, "ERR")
            return
        s = self.settings
        upstream = "engine" if s is None else (s if ex.protocol == "other" else s.for_role(ex.role)).upstream_display
        page = errors.error_response(ex, 502, f"OpenForge: upstream {upstream} failed: {ex.error}", "upstream_error")
        page.headers["connection"] = "close"  # mitmproxy closes the client's connection after its error page
        if flow.error is not None:
            self._error_pages.arm(flow.error.msg, page)
        self.recorder.write(ex, ResponseParts(page.status_code, page.headers.fields, page.raw_content), complete=False)
        self.calllog.line(flow, ex, page.status_code)

    # -- request side ----------------------------------------------------------------------------------------
    def _begin(self, flow: http.HTTPFlow, s: options.Settings) -> Exchange | None:
        """Classify the request and check its token; for LLM calls strip the client's credentials and point
        it at the engine. Requests the proxy refuses are answered and recorded here."""
        req = flow.request
        path, _, query = req.path.partition("?")
        if control.handles(path):
            self.control.answer(flow, path, s)
            _mask_request(req)  # the verifier's or the probe's token
            return None
        direct = self._is_direct(flow)
        host = req.pretty_host.lower()
        vendor = not direct and host in s.vendor_hosts
        prefixes = endpoints.Prefixes()
        if direct:
            path, prefixes = endpoints.strip_prefixes(path)
        kind = endpoints.classify(req.method, path) if (direct or vendor) else None
        scope = None  # what an episode key opens; None for a client token (or no check)
        if s.client_tokens:  # in every mode, to every host
            given = access.presented(req.headers.fields, prefixes.token)
            if not access.matches(given, s.client_tokens):
                scope = access.key_scope(given, s.client_tokens)
                if scope is None:
                    self._refuse(flow, s, kind or endpoints.classify(req.method, path), path, prefixes, 401,
                                 "OpenForge: missing or unknown API key: present one of the proxy's client tokens "
                                 "as the API key", "invalid_api_key")
                    return None
                if not (direct and kind is not None):
                    self._refuse_scope(flow, s, kind or endpoints.classify(req.method, path), path, prefixes, scope)
                    return None
        if not (direct or vendor or s.host_allowed(host)):  # forward mode is an LLM gateway, not an open proxy
            self._refuse(flow, s, endpoints.classify(req.method, path), path, prefixes, 403,
                         f"OpenForge: {host} is not an LLM vendor host: forward mode reaches only "
                         "openforge_vendor_hosts and openforge_allow_hosts", "permission_error")
            return None
        if kind is None:
            if direct and not s.allowed(path):
                self._refuse(flow, s, None, path, prefixes, 403, f"OpenForge: {path} is not an LLM endpoint; "
                             f"only paths listed in openforge_allow_paths are forwarded to the engine",
                             "permission_error")
                return None
            ex = self._new(flow, "other", path) if s.record_other else None
            if vendor and s.block_other:
                flow.response = errors.error_response(None, 403, "blocked by OpenForge (openforge_block_other)",
                                                     "permission_error")
                if ex is not None:
                    self.recorder.write(ex, response_parts(flow, raw=flow.response.raw_content), complete=True)
                return None
            if direct:  # an engine path of openforge_allow_paths (/health, /tokenize, ...): reverse-proxied
                self._to_upstream(flow, s, routes.upstream_path(s, path, query))
            if ex is not None:
                self.recorder.track(flow, ex)
            return ex
        protocol, canonical = kind
        ex = self._new(flow, protocol, path)
        self._describe(flow, ex, prefixes, s)
        if scope is not None and (ex.episode != scope.episode or ex.role != (scope.role or s.default_role)):
            self._refuse_scope(flow, s, kind, path, prefixes, scope)
            return None
        over = self.recorder.episode_calls.admit(ex.episode, s.episode_max_calls, s.episode_max_tokens)
        if over is not None:  # 403: SDKs retry 429 and 5xx, and a budget does not come back
            self._answer(flow, ex, 403, over, "budget_exhausted")
            _mask_request(req)
            return None
        self._check_route(s, ex.role)
        self.recorder.track(flow, ex)
        rs = s.for_role(ex.role)
        self._to_upstream(flow, rs, routes.upstream_path(rs, canonical, query), llm=True)
        return ex

    def _engine_for(self, s: options.Settings, role: str | None) -> UpstreamProbe:
        """What is known of the upstream a role's calls go to (the proxy's own unless its route names one)."""
        if role is None:
            return self.engine
        rs = s.for_role(role)
        return self.engine if rs is s else self.role_engines[rs.upstream_url]

    def _describe(self, flow: http.HTTPFlow, ex: Exchange, prefixes: endpoints.Prefixes, s: options.Settings) -> None:
        """Role, episode and toolchain of a call."""
        headers = wire.header_map(flow.request.headers.fields)  # one pass; mitmproxy's get() scans per call
        ex.role = prefixes.role or headers.get("x-openforge-role") or s.default_role
        ex.episode, ex.episode_source = routes.episode(prefixes.episode, headers, self._proxy_user(flow, headers))
        ex.toolchain = wire.toolchain(headers.get("user-agent"))

    def _refuse(self, flow: http.HTTPFlow, s: options.Settings, kind: tuple[str, str] | None, path: str,
                prefixes: endpoints.Prefixes, status: int, message: str, error_kind: str) -> None:
        """Answer a request that may not go upstream, in its protocol's error shape; record and log it."""
        ex = self._new(flow, kind[0] if kind else "other", path)
        self._describe(flow, ex, prefixes, s)
        self._answer(flow, ex, status, message, error_kind)
        _mask_request(flow.request)

    def _refuse_scope(self, flow: http.HTTPFlow, s: options.Settings, kind: tuple[str, str] | None, path: str,
                      prefixes: endpoints.Prefixes, scope: client_keys.KeyScope) -> None:
        """Refuse (403) a request made with an episode key outside what it opens; recorded and counted as the
        key's episode's, whichever episode or role it named."""
        ex = self._new(flow, kind[0] if kind else "other", path)
        self._describe(flow, ex, prefixes, s)
        tried = f"episode {ex.episode!r} as role {ex.role!r}" if kind is not None and self._is_direct(flow) else path
        ex.episode, ex.episode_source = scope.episode, "key"
        self.recorder.episode_calls.refused_scope(scope.episode)
        self._answer(flow, ex, 403, wire.printable(f"OpenForge: {access.scope_text(scope, s.default_role)}, not "
                                                   f"{tried}"), "permission_error")
        _mask_request(flow.request)

    def _new(self, flow: http.HTTPFlow, protocol: str, path: str) -> Exchange:
        req = flow.request
        record_id, seq = self.recorder.next_id()
        ex = Exchange(record_id, seq, self.recorder.instance, req.timestamp_start, protocol, path)
        ex.role = self.settings.default_role if self.settings else ""
        ex.policy_version = self.control.policy_version
        ex.client_request = RequestParts(req.method, req.pretty_url, req.headers.fields, req.raw_content)
        return ex

    def _is_direct(self, flow: http.HTTPFlow) -> bool:
        """Addressed to the proxy itself (reverse mode, or a base URL pointing here) rather than proxied."""
        if isinstance(flow.client_conn.proxy_mode, ReverseMode):
            return True
        sockname = flow.client_conn.sockname
        return bool(sockname) and flow.request.port == sockname[1]

    def _proxy_user(self, flow: http.HTTPFlow, headers: dict[str, str]) -> str | None:
        """The proxy-auth user name of a forward-mode request (its own header, or its CONNECT tunnel's)."""
        auth = flow.metadata.get("proxyauth")
        return auth[0] if auth else self._proxy_users.get(flow.client_conn) or wire.proxy_auth_user(
            headers.get("proxy-authorization"))

    def _to_upstream(self, flow: http.HTTPFlow, s: options.Settings, path: str, llm: bool = False) -> None:
        """Point the request at the engine, with the headers `routes.upstream_headers` plans."""
        req = flow.request
        req.scheme = s.upstream_scheme
        if (req.host, req.port) != (s.upstream_host, s.upstream_port):  # in reverse mode mitmproxy did it
            req.host, req.port = s.upstream_host, s.upstream_port
        h2 = req.is_http2 or req.is_http3  # there `:authority` is the host header
        req.headers.fields = routes.upstream_headers(req.headers.fields, s, llm, h2)
        if h2:
            req.authority = f"{s.upstream_host}:{s.upstream_port}"
        req.path = path

    def _prepare(self, flow: http.HTTPFlow, ex: Exchange, s: options.Settings) -> None:
        """Routing, translation and token-id injection on the body; then freeze what goes upstream. `s`: the
        settings of the call's role (its upstream)."""
        req = flow.request
        body = bodies.request_json(req.content) if req.method == "POST" else None
        if body is not None:
            if isinstance(body.get("model"), str):
                ex.model = body["model"]
            engine_protocol = ex.protocol
            client_protocol = "anthropic" if ex.protocol == "anthropic_count_tokens" else ex.protocol
            if translate.needs_translation(client_protocol, ex.engine_profile, s.translate):
                dropped: list[str] = []
                if ex.protocol == "anthropic_count_tokens":
                    chat = translate.count_tokens_request(body)
                else:
                    chat, dropped = translate.request_to_chat(ex.protocol, body)
                ex.translated = flowfile.Translation({"from": ex.protocol, "to": "chat", "dropped": dropped})
                ex.client_body = body
                body, engine_protocol = chat, "chat"
                req.path = s.upstream_prefix + endpoints.CANONICAL["chat"]
            elif ex.protocol in endpoints.ANTHROPIC_PROTOCOLS and s.upstream_key:
                req.headers["x-api-key"] = s.upstream_key
            route = s.route(ex.role)
            if route is not None:
                ex.injected += routes.apply_route(route, body)
            ex.upstream_model = body.get("model") if isinstance(body.get("model"), str) else None
            ex.injected += profiles.inject(ex.engine_profile, engine_protocol, body)
            ex.injected += profiles.normalize(ex.engine_profile, engine_protocol, body)
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            if profiles.unstream(ex.engine_profile, engine_protocol, body):
                ex.restream, ex.restream_usage = True, usage
                ex.injected.append("stream")
            if ex.injected or ex.translated or route is not None:
                bodies.set_body(req, profiles.encode_json(body).encode())
            if prompt_ids.wanted(s, ex.engine_profile, engine_protocol):
                ex.prompt_ids = prompt_ids.start(s, req.content or b"")
        ex.upstream_request = RequestParts(req.method, req.url, req.headers.fields, req.raw_content)

    # -- response side -------------------------------------------------------------------------------------
    def _finish(self, flow: http.HTTPFlow, ex: Exchange) -> None:
        """A non-streamed answer: make the client's (stripped or translated) and record the exchange, all
        before mitmproxy sends it (it does once this hook returns); unrecorded, the client gets a 503."""
        resp = flow.response
        assert resp is not None
        ex.t_end = time.time()
        client_response = None
        response = response_parts(flow, raw=resp.raw_content)
        has_ids = False
        if ex.restream:
            has_ids = bodies.restream_body(resp, ex)
            client_response = response_parts(flow, raw=resp.raw_content)
        elif ex.translated is not None:
            has_ids = body_has_token_ids(resp.content)
            bodies.translate_body(resp, ex)
            client_response = response_parts(flow, raw=resp.raw_content)
        elif ex.protocol != "other":
            has_ids = bodies.strip_body(resp, ex)
        status = resp.status_code
        problem = self.recorder.record(ex, response, client_response, has_ids)
        if problem:
            self._refuse_unrecorded(flow, ex, problem)
            status = 503
        self.calllog.line(flow, ex, status, flush=False)
        self.calllog.flush_soon()

    def _end_stream(self, flow: http.HTTPFlow, ex: Exchange) -> bytes | None:
        """`Exchange.on_end`: the stream has ended and its terminal event is held. Record the exchange now,
        so the client has its whole answer only once the record is in the OS; unrecorded, return the error
        event it gets instead (the `response` hook then cuts the answer short). Never raises."""
        ex.on_end = None
        try:
            ex.t_end = time.time()
            response = response_parts(flow, None, ex)
            client_response = response._replace(chunks=ex.client_chunks) if ex.client_chunks is not None else None
            problem = self.recorder.record(ex, response, client_response, None)
        except Exception as e:  # never raise into mitmproxy's stream handling
            logger.exception("OpenForge: cannot record a streamed exchange")
            problem = f"proxy error: {type(e).__name__}: {e}"
        status = flow.response.status_code if flow.response is not None else "ERR"
        self.calllog.line(flow, ex, 503 if problem else status, flush=False)
        self.calllog.flush_soon()
        if not problem:
            return None
        return errors.error_event(errors.client_protocol(ex), errors.unrecorded_message(problem))

    def _refuse_unrecorded(self, flow: http.HTTPFlow, ex: Exchange, problem: str) -> None:
        """Replace an answer whose record could not be written by a 503 in the client's protocol."""
        flow.response = errors.error_response(ex, 503, errors.unrecorded_message(problem), "recording_failed")

    def _answer(self, flow: http.HTTPFlow, ex: Exchange | None, status: int, message: str, kind: str) -> None:
        """Answer the client from the proxy in its own protocol's error shape, and record it."""
        flow.response = errors.error_response(ex, status, message, kind)
        body = flow.response.raw_content
        if ex is not None:
            flow.metadata.pop(META, None)
            if ex.model is None:  # answered before the body was read (engine down)
                model = (bodies.json_object(ex.client_request.body) or {}).get("model")
                ex.model = model if isinstance(model, str) else None
            ex.error = message
            ex.upstream_request = None
            ex.t_end = time.time()
            self.recorder.write(ex, response_parts(flow, raw=body), complete=True)
            self.calllog.line(flow, ex, status)

    def _hide_key(self, flow: http.HTTPFlow) -> None:
        """The request has gone upstream: mask our key in the flow so no other addon or log shows it."""
        headers = flow.request.headers
        headers.fields = tuple(
            (k, wire.mask(v.decode("utf-8", "surrogateescape")).encode()) if k.lower() in _KEY_HEADERS else (k, v)
            for k, v in headers.fields
        )


def _mask_request(req: http.Request) -> None:
    """Mask the credentials of a request that stays here, so mitmproxy's own flow output shows none."""
    req.path = wire.masked_url(req.path)
    req.headers.fields = tuple((k, wire.mask(v.decode("utf-8", "surrogateescape")).encode())
                               if wire.is_secret_header(k) else (k, v) for k, v in req.headers.fields)
