"""The proxy's control API as its tests drive it: a proxy with client and reward tokens set, in front of a
scripted engine, and the exchange records of one episode."""

from __future__ import annotations

from typing import Any

from openforge.addons.flowfile import ExchangeRecord, expand_paths, open_flow_file
from openforge.protocols.control import ControlClient

CLIENT_TOKEN = "of-client-TOKEN-0123456789abcdef"
REWARD_TOKEN = "of-reward-TOKEN-0123456789abcdef"
TOKENS_ENV = {"OPENFORGE_CLIENT_TOKENS": CLIENT_TOKEN, "OPENFORGE_REWARD_TOKENS": REWARD_TOKEN}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def exchanges(proxy: Any, episode: str) -> list[ExchangeRecord]:
    """The episode's exchange records; the status call first makes sure every answered call is written."""
    ControlClient(proxy.url, CLIENT_TOKEN).status()
    return [r for path in expand_paths([proxy.flow_dir]) for r in open_flow_file(path).records()
            if r["type"] == "exchange" and r["episode"] == episode]
