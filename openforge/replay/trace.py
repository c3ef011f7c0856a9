"""A captured trace as replay reads it: its exchanges in order, the protocol of a path, a request's side.

Only the standard library and msgpack (via addons.flowfile), so replay runs anywhere the proxy does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit

from openforge.addons.flowfile import expand_paths, open_flow_file
from openforge.protocols.endpoints import protocol_of

Side = Literal["client", "engine"]


class ReplayError(Exception):
    """Bad input for a replay (no usable exchanges, unreadable trace): shown to the user without a traceback."""


def load_exchanges(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """All complete exchange records with a response, in (t_start, seq) order, from files or directories."""
    files = expand_paths(list(paths))
    if not files:
        raise ReplayError(f"no flow files found in {', '.join(map(str, paths))}")
    out: list[dict[str, Any]] = []
    for path in files:
        if not path.exists():
            raise ReplayError(f"{path}: no such file")
        flow = open_flow_file(path)
        # replay reads records as plain dicts: matching and serving only look keys up
        out.extend(cast(dict[str, Any], r) for r in flow.records() if r.get("type") == "exchange" and r.get("response"))
        if flow.error:
            raise ReplayError(f"{path}: {flow.error}")
    out.sort(key=lambda r: (r.get("t_start") or 0.0, r.get("seq") or 0))
    return out


def protocol_of_path(path: str) -> str:
    """The wire protocol a request path speaks (same names as the flow format's `protocol` field)."""
    return protocol_of(urlsplit(path).path.rstrip("/")) or "other"


def json_body(body: bytes | None) -> Any:
    if not body:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def request_of(exchange: dict[str, Any], side: Side) -> dict[str, Any] | None:
    return exchange.get("client_request") if side == "client" else exchange.get("upstream_request")


def common_prefix(a: list[Any], b: list[Any]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

