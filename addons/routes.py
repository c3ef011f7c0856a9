"""Route planning, pure: where a call goes on the engine, with which headers, model and forced sampling,
and which episode it belongs to. No mitmproxy objects here: the routing addon (`proxy.py`) applies the plan.
"""

from __future__ import annotations

from typing import Any

from . import options, wire

Fields = tuple[tuple[bytes, bytes], ...]  # mitmproxy's raw `Headers.fields`
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id")  # toolchains' own session ids


def upstream_path(s: options.Settings, path: str, query: str) -> str:
    """The engine's path for a request: under the upstream prefix, credential query parameters removed."""
    query = wire.public_query(query)
    return s.upstream_prefix + path + (f"?{query}" if query else "")


def upstream_headers(fields: Fields, s: options.Settings, llm: bool, h2: bool) -> Fields:
    """The request's headers for the engine, in one pass over the raw fields (mitmproxy's `Headers` scan
    every field per lookup or assignment): every credential header and our own `x-openforge-*` dropped,
    Host set (HTTP/2 and 3 carry it in `:authority`: only overwritten there), our key added, and for LLM
    calls `accept-encoding: identity` (we read their answers)."""
    host = f"{s.upstream_host}:{s.upstream_port}".encode()
    drop = wire.DROP_UPSTREAM_LLM_BYTES if llm else wire.DROP_UPSTREAM_BYTES
    out: list[tuple[bytes, bytes]] = []
    has_host = False
    for k, v in fields:
        name = k.lower()
        if name in drop or wire.is_secret_header(name):
            continue
        if name == b"host":
            v, has_host = host, True
        out.append((k, v))
    if not (has_host or h2):
        out.insert(0, (b"Host", host))
    if llm:
        out.append((b"accept-encoding", b"identity"))
    if s.upstream_key:
        out.append((b"authorization", f"Bearer {s.upstream_key}".encode()))
    return tuple(out)


def apply_route(route: options.Route, body: dict[str, Any]) -> list[str]:
    """Map the body's model to the engine's and force the route's sampling fields; the fields changed."""
    if isinstance(body.get("model"), str):
        body["model"] = route.upstream_model(body["model"])
    forced = []
    for key, value in route.sampling.items():
        if body.get(key) != value:
            body[key] = value
            forced.append(key)
    return forced


def episode(from_path: str | None, headers: dict[str, str], proxy_user: str | None) -> tuple[str | None, str | None]:
    """(episode, where it came from) of a call: its `/e/<episode>/` prefix, the X-OpenForge-Episode header,
    the proxy-auth user name, a toolchain's session header; else (None, None). `headers`: lower-case names."""
    if from_path:
        return from_path, "path"
    if value := headers.get("x-openforge-episode"):
        return value, "header"
    if proxy_user:
        return proxy_user, "proxy_auth"
    for name in SESSION_HEADERS:
        if value := headers.get(name):
            return value, "session_header"
    return None, None
