"""Episodes: the recorded episode id, else link calls whose conversation extends an earlier call's.

Toolchains rewrite history between turns (cache markers move, a string becomes a one-element text
list, tool-call argument JSON is re-serialised, tool-call ids are rewritten, reasoning is dropped), so
conversations are compared after normalising those away: the *loose* key. The *strict* key keeps
argument bytes, ids and reasoning, and tells a client rewrite apart when tokens stop matching.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from openforge.reconstruct.tokenize import stable_json


def _h(prev: str, item: str) -> str:
    return hashlib.blake2b(f"{prev}\x00{item}".encode(), digest_size=8).hexdigest()


def _args(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (ValueError, TypeError):
        return arguments


def _loose_content(content: Any) -> Any:
    """Stripped text; a list of parts (a message with images) as its stripped texts and image hashes."""
    if isinstance(content, list):
        return [p["text"].strip() if p["type"] == "text" else ["image", p.get("sha256")] for p in content]
    return (content or "").strip()


def loose_message(m: dict[str, Any]) -> str:
    """What survives every toolchain's rewriting: role, text, images, tool names and parsed arguments."""
    calls = [[tc["function"]["name"], _args(tc["function"].get("arguments", ""))] for tc in m.get("tool_calls") or []]
    return stable_json([m.get("role"), _loose_content(m.get("content")), calls])


def strict_message(m: dict[str, Any]) -> str:
    calls = [[tc.get("id"), tc["function"]["name"], tc["function"].get("arguments", "")]
             for tc in m.get("tool_calls") or []]
    return stable_json([m.get("role"), m.get("content") or "", calls, m.get("tool_call_id"),
                        m.get("reasoning_content")])


def chain_hashes(messages: list[dict[str, Any]], tools: Any, completion: dict[str, Any],
                 key: Callable[[dict[str, Any]], str]) -> tuple[list[str], str]:
    """Hashes of every conversation prefix (index k = first k messages) and of messages + completion."""
    h = _h("", stable_json(tools or []))
    prefixes = [h]
    for m in messages:
        h = _h(h, key(m))
        prefixes.append(h)
    return prefixes, _h(h, key(completion))


def _fingerprint(m: dict[str, Any]) -> tuple:
    """Every field `loose_message` and `strict_message` read, as a hashable tuple (cheap, no JSON)."""
    calls = tuple(
        (tc.get("id"), tc["function"]["name"], tc["function"].get("arguments", "")) for tc in m.get("tool_calls") or ()
    )
    content = m.get("content")
    if isinstance(content, list):  # a message with images: its parts (dicts) as one string
        content = ("parts", stable_json(content))
    return (m.get("role"), content, calls, m.get("tool_call_id"), m.get("reasoning_content"))


class ChainHasher:
    """`chain_hashes` for both keys at once, memoised per (previous hashes, message).

    Every call of an agent loop resends the whole conversation, so hashing it from scratch costs
    O(turns^2) JSON encodings per episode; with the memo each message is encoded once, and later
    calls only pay a tuple hash per message. Values are exactly `chain_hashes`'s (they are stored and
    compared across runs). The memo is cleared when full (entries, or the text its keys hold: tool outputs
    can be large), so memory stays bounded.

    `fresh` collects (strict prefix hash, JSON) for every tools list and message met for the first time
    (a memo miss): stored once in `call_messages`, they give back any call's conversation from its
    strict hashes, so no call stores its whole conversation (O(turns^2) bytes per episode).
    """

    def __init__(self, max_entries: int = 16384, max_chars: int = 32_000_000) -> None:
        self._memo: dict[tuple, tuple[str, str]] = {}
        self._tools: dict[str, str] = {}
        self._max = max_entries
        self._max_chars = max_chars
        self._chars = 0  # text held by the memo's keys
        self.fresh: list[tuple[str, str]] = []

    def hashes(
        self, messages: list[dict[str, Any]], tools: Any, completion: dict[str, Any]
    ) -> tuple[list[str], str, list[str], str]:
        """(loose prefixes, loose end, strict prefixes, strict end), as two `chain_hashes` calls give."""
        if len(self._memo) > self._max or self._chars > self._max_chars:
            self._memo.clear()
            self._tools.clear()
            self._chars = 0
        tools_json = stable_json(tools or [])
        root = self._tools.get(tools_json)
        if root is None:
            root = self._tools[tools_json] = _h("", tools_json)
            self.fresh.append((root, json.dumps(tools)))
        loose, strict = root, root
        loose_out, strict_out = [root], [root]
        for m in messages:
            loose, strict = self._step(loose, strict, m)
            loose_out.append(loose)
            strict_out.append(strict)
        loose_end, strict_end = self._step(loose, strict, completion)
        return loose_out, loose_end, strict_out, strict_end

    def _step(self, loose: str, strict: str, m: dict[str, Any]) -> tuple[str, str]:
        k = (loose, strict, _fingerprint(m))
        out = self._memo.get(k)
        if out is None:
            out = self._memo[k] = (_h(loose, loose_message(m)), _h(strict, strict_message(m)))
            message = json.dumps(m)
            self._chars += len(message)  # about the text the key holds
            self.fresh.append((out[1], message))
        return out


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
