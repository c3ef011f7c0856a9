"""Which LLM protocol a request path speaks, and what its routing prefixes (`/e/`, `/r/`, `/k/`) say."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote

# (path suffix, protocol, canonical engine path); longest suffixes first.
_ENDPOINTS = (
    ("/messages/count_tokens", "anthropic_count_tokens", "/v1/messages/count_tokens"),
    ("/chat/completions", "chat", "/v1/chat/completions"),
    ("/completions", "completions", "/v1/completions"),
    ("/responses", "responses", "/v1/responses"),
    ("/messages", "anthropic", "/v1/messages"),
    ("/models", "models", "/v1/models"),
)
CANONICAL = {protocol: path for _, protocol, path in _ENDPOINTS}
ANTHROPIC_PROTOCOLS = frozenset({"anthropic", "anthropic_count_tokens"})
LLM_PROTOCOLS = ("chat", "completions", "responses", "anthropic")


def protocol_of(path: str) -> str | None:
    """The LLM protocol a path's suffix names, else None. `path` has no query string."""
    for suffix, protocol, _ in _ENDPOINTS:
        if path.endswith(suffix):
            return protocol
    return None


def classify(method: str, path: str) -> tuple[str, str] | None:
    """(protocol, canonical engine path) for an LLM endpoint, else None: `models` on GET, the rest on any
    other method. `path` has no query string."""
    protocol = protocol_of(path)
    if protocol is None or (protocol == "models") != (method == "GET"):
        return None
    return protocol, CANONICAL[protocol]


def protocol_name(method: str, path: str) -> str:
    """The flow format's `protocol` field for a recorded request: an LLM call is a POST (`models` any
    method), everything else is "other". `path` may carry a query string and a trailing slash."""
    protocol = protocol_of(path.partition("?")[0].rstrip("/"))
    if protocol is None or (protocol != "models" and method != "POST"):
        return "other"
    return protocol


@dataclass(slots=True)
class Prefixes:
    """What leading `/e/<episode>/`, `/r/<role>/` and `/k/<token>/` path segments (any order) said."""

    episode: str | None = None
    role: str | None = None
    token: str | None = None


def strip_prefixes(path: str) -> tuple[str, Prefixes]:
    """Remove leading `/e/<episode>/`, `/r/<role>/` and `/k/<token>/` segments: (the rest, what they said)."""
    found = Prefixes()
    while path.startswith(("/e/", "/r/", "/k/")):
        kind = path[1]
        end = path.find("/", 3)
        value, path = (path[3:], "/") if end < 0 else (path[3:end], path[end:])
        value = unquote(value)
        if kind == "e":
            found.episode = value or found.episode
        elif kind == "r":
            found.role = value or found.role
        else:
            found.token = value or found.token
    return path, found
