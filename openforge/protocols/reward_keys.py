"""Per-episode reward keys: what a verifier presents to post the reward of ONE episode.

The loop (or `openforge rollout`) holds the reward token; each episode's verifier gets only
`episode_reward_key(token, episode)`, so a key that leaks can reward that one episode, once, and no other.
The proxy, which holds the token, recomputes the key from the episode in the reward URL.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "ofep-"  # marks a derived key in a header, so it is never mistaken for a token


def episode_reward_key(reward_token: str | bytes, episode: str) -> str:
    """HMAC-SHA256 of the episode id under the reward token, hex, with `PREFIX`."""
    key = reward_token.encode() if isinstance(reward_token, str) else reward_token
    mac = hmac.new(key, b"openforge-episode-reward\0" + episode.encode("utf-8", "surrogateescape"), hashlib.sha256)
    return PREFIX + mac.hexdigest()
