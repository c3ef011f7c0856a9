"""Per-episode client keys: what an episode's agent presents as its API key instead of the run's client token.

The runner (or a Job's episode process) holds the client token; each episode's agent gets only
`episode_client_key(token, episode)`, which names its episode and carries an HMAC of it under the token. The
proxy, which holds the token, checks the HMAC and admits the key only for that episode's own LLM calls as the
policy role (docs/security.md, Episode keys), so a key that leaks from one workspace opens nothing else, and the
next episode's key is another.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable

PREFIX = "ofec-"  # marks a derived key in a header, so it is never mistaken for a token
_DOMAIN = b"openforge-episode-client\0"
_MAC_HEX = 64


def _mac(token: bytes, episode: bytes) -> str:
    return hmac.new(token, _DOMAIN + episode, hashlib.sha256).hexdigest()


def episode_client_key(client_token: str | bytes, episode: str) -> str:
    """`PREFIX`, the episode id (URL-safe base64, unpadded), `.`, the HMAC-SHA256 of the id under the token."""
    token = client_token.encode() if isinstance(client_token, str) else client_token
    raw = episode.encode("utf-8", "surrogateescape")
    return f"{PREFIX}{base64.urlsafe_b64encode(raw).decode().rstrip('=')}.{_mac(token, raw)}"


def key_episode(key: bytes, tokens: Iterable[bytes]) -> str | None:
    """The episode an episode key was derived for under one of `tokens`; None for anything else."""
    if not key.startswith(PREFIX.encode()):
        return None
    name, _, mac = key[len(PREFIX):].partition(b".")
    try:
        raw = base64.urlsafe_b64decode(name + b"=" * (-len(name) % 4))
    except (binascii.Error, ValueError):
        return None
    if len(mac) != _MAC_HEX or not raw:
        return None
    found = False
    for token in tokens:  # every token compared, in constant time each
        found |= hmac.compare_digest(mac, _mac(token, raw).encode())
    return raw.decode("utf-8", "surrogateescape") if found else None
