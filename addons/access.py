"""Who may use the proxy: client tokens (the operator's and the agent's API key), episode keys derived from them
(one episode's agent: `openforge.protocols.client_keys`), reward tokens (the verifier's), listen address.

A client presents its token where it would present an API key, so an unmodified toolchain needs nothing
but its key set to the token. Tokens are compared in constant time; nothing here logs a token.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from openforge.protocols import client_keys

MIN_TOKEN_CHARS = 16
# Headers a client puts its API key in: OpenAI / most SDKs (Bearer), Anthropic, Azure OpenAI.
_KEY_HEADERS = (b"authorization", b"x-api-key", b"api-key")


def parse_tokens(name: str, value: str) -> tuple[bytes, ...]:
    """Tokens from a comma- or line-separated list (`#` starts a comment line); each a printable word."""
    tokens: list[bytes] = []
    for line in value.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for token in line.split(","):
            token = token.strip()
            if not token:
                continue
            if not token.isascii() or not token.isprintable() or " " in token:
                raise ValueError(f"{name}: a token must be printable ASCII without spaces")
            if len(token) < MIN_TOKEN_CHARS:
                raise ValueError(f"{name}: a token must have at least {MIN_TOKEN_CHARS} characters "
                                 f"(e.g. `openssl rand -hex 24`), got one of {len(token)}")
            tokens.append(token.encode())
    return tuple(tokens)


def presented(fields: Iterable[tuple[bytes, bytes]], path_token: str | None) -> list[bytes]:
    """Every credential the request carries where a client sends its API key, plus a `/k/<token>/` prefix."""
    found = [path_token.encode("utf-8", "surrogateescape")] if path_token else []
    for k, v in fields:
        name = k.lower()
        if name in _KEY_HEADERS:
            scheme, sep, rest = v.strip().partition(b" ")
            found.append(rest.strip() if sep and scheme.lower() == b"bearer" else v.strip())
    return found


def matches(candidates: Iterable[bytes | str], tokens: tuple[bytes, ...]) -> bool:
    """Whether any candidate is one of `tokens`; every pair is compared, in constant time each."""
    hit = False
    for candidate in candidates:
        value = candidate.encode("utf-8", "surrogateescape") if isinstance(candidate, str) else candidate
        for token in tokens:
            hit |= hmac.compare_digest(value, token)
    return hit


def key_scope(candidates: Iterable[bytes], tokens: tuple[bytes, ...]) -> client_keys.KeyScope | None:
    """What the episode key (`client_keys.episode_client_key` under one of `tokens`) among `candidates` opens."""
    for candidate in candidates:
        if (scope := client_keys.key_scope(candidate, tokens)) is not None:
            return scope
    return None


def scope_text(scope: client_keys.KeyScope, default_role: str) -> str:
    """What an episode key opens, as a refusal says it."""
    return (f"this key opens only episode {scope.episode!r}'s own LLM calls (/e/{scope.episode}/...) as role "
            f"{scope.role or default_role!r}")


def is_loopback(host: str) -> bool:
    """Whether a listen address is reachable only from this machine ("" means every interface)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
