"""Episodes: the recorded episode id, else link calls whose conversation extends an earlier call's.

Toolchains rewrite history between turns (cache markers move, a string becomes a one-element text
list, tool-call argument JSON is re-serialised, tool-call ids are rewritten, reasoning is dropped), so
conversations are compared after normalising those away: the *loose* key. The *strict* key keeps
argument bytes, ids and reasoning, and tells a client rewrite apart when tokens stop matching.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from reconstruct.tokenize import stable_json


def _h(prev: str, item: str) -> str:
    return hashlib.blake2b(f"{prev}\x00{item}".encode(), digest_size=8).hexdigest()


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, TypeError):
        return arguments


def loose_message(m: dict[str, Any]) -> str:
    """What survives every toolchain's rewriting: role, text, tool names and parsed arguments."""
    calls = [[tc["function"]["name"], _args(tc["function"].get("arguments", ""))] for tc in m.get("tool_calls") or []]
    return stable_json([m.get("role"), (m.get("content") or "").strip(), calls])


def strict_message(m: dict[str, Any]) -> str:
    calls = [[tc.get("id"), tc["function"]["name"], tc["function"].get("arguments", "")] for tc in m.get("tool_calls") or []]
    return stable_json([m.get("role"), m.get("content") or "", calls, m.get("tool_call_id"), m.get("reasoning_content")])


def chain_hashes(messages: list[dict[str, Any]], tools: Any, completion: dict[str, Any], key) -> tuple[list[str], str]:
    """Hashes of every conversation prefix (index k = first k messages) and of messages + completion."""
    h = _h("", stable_json(tools or []))
    prefixes = [h]
    for m in messages:
        h = _h(h, key(m))
        prefixes.append(h)
    return prefixes, _h(h, key(completion))


class Linker:
    """Assigns episode ids to calls without one, by the longest earlier conversation they extend."""

    def __init__(self, known_ends: dict[str, str] | None = None) -> None:
        self.ends: dict[str, str] = dict(known_ends or {})

    def assign(self, call_id: str, prefixes: list[str], end: str) -> str:
        episode = None
        for h in reversed(prefixes):
            episode = self.ends.get(h)
            if episode is not None:
                break
        episode = episode or f"conv-{call_id[:16]}"
        self.ends.setdefault(end, episode)
        return episode
