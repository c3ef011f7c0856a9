"""Per-episode client keys: what an episode's agent presents as its API key instead of the run's client token.

The runner (or a Job's episode process) holds the client token; each episode's agent gets only
`episode_client_key(token, episode, role)`, which names its episode (and the role its calls were planned
under, when not the proxy's default) and carries an HMAC of both under the token. The proxy, which holds the
token, checks the HMAC and admits the key only for that episode's own LLM calls as that role (docs/security.md,
Episode keys), so a key that leaks from one workspace opens nothing else, and the next episode's key is another.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable
from typing import NamedTuple

PREFIX = "ofec-"  # marks a derived key in a header, so it is never mistaken for a token
_DOMAIN = b"openforge-episode-client\0"
_MAC_HEX = 64


class KeyScope(NamedTuple):
    """What an episode key opens: `episode`'s LLM calls as `role` (None: the proxy's default role)."""

    episode: str
    role: str | None


def _mac(token: bytes, episode: bytes, role: bytes) -> str:
    # the episode's length first: ("ab", "c") and ("a", "bc") are other keys
    return hmac.new(token, _DOMAIN + b"%d:" % len(episode) + episode + role, hashlib.sha256).hexdigest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def episode_client_key(client_token: str | bytes, episode: str, role: str | None = None) -> str:
    """`PREFIX`, the episode id (URL-safe base64, unpadded), `.`, the role likewise and `.` when one is given,
    then the HMAC-SHA256 of both under the token (hex)."""
    token = client_token.encode() if isinstance(client_token, str) else client_token
    raw = episode.encode("utf-8", "surrogateescape")
    named = (role or "").encode("utf-8", "surrogateescape")
    return f"{PREFIX}{_b64(raw)}.{_b64(named) + '.' if named else ''}{_mac(token, raw, named)}"


def _unb64(text: bytes) -> bytes | None:
    try:
        return base64.urlsafe_b64decode(text + b"=" * (-len(text) % 4)) or None
    except (binascii.Error, ValueError):
        return None


def key_scope(key: bytes, tokens: Iterable[bytes]) -> KeyScope | None:
    """What an episode key derived under one of `tokens` opens; None for anything else."""
    if not key.startswith(PREFIX.encode()):
        return None
    *names, mac = key[len(PREFIX):].split(b".")
    if len(mac) != _MAC_HEX or len(names) not in (1, 2):
        return None
    raw, role = _unb64(names[0]), _unb64(names[1]) if len(names) == 2 else b""
    if raw is None or role is None:
        return None
    found = False
    for token in tokens:  # every token compared, in constant time each
        found |= hmac.compare_digest(mac, _mac(token, raw, role).encode())
    if not found:
        return None
    return KeyScope(raw.decode("utf-8", "surrogateescape"), role.decode("utf-8", "surrogateescape") or None)
