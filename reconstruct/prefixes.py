"""Prompt ids stored as a suffix of the episode's previous call: agent prompts grow by one turn per call.

Stored in full, an episode of n calls costs O(n^2) tokens in `call_tokens` (every prompt repeats the
system prompt and the whole history). Instead each call's prompt is stored as `prefix_len` tokens of an
earlier call's prompt + completion (`prefix_call_id`, same episode) followed by its own suffix.
`split` does it while ingesting; `expand` undoes it when an episode is rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixSplitter:
    """Remembers each episode's latest call (id, prompt + completion ids), up to `max_cells` ids in all.

    An episode pushed out of memory (least recently seen first) simply stores its next prompt in full.
    """

    def __init__(self, max_cells: int = 4_000_000) -> None:
        self.max_cells = max_cells
        self._last: OrderedDict[str, tuple[str, np.ndarray]] = OrderedDict()
        self._cells = 0

    def split(self, episode: str, call_id: str, prompt: np.ndarray, completion: np.ndarray) -> tuple[str | None, int, np.ndarray]:
        """(prefix call id or None, prefix length, suffix to store) for this call's prompt."""
        base = self._last.pop(episode, None)
        prefix_id, k = None, 0
        if base is not None:
            self._cells -= len(base[1])
            k = common_prefix(prompt, base[1])
            prefix_id = base[0] if k else None
        full = np.concatenate([prompt, completion])
        self._last[episode] = (call_id, full)
        self._cells += len(full)
        while self._cells > self.max_cells and len(self._last) > 1:
            _, (_, old) = self._last.popitem(last=False)
            self._cells -= len(old)
        return prefix_id, k, prompt[k:]


def expand(rows: list[dict[str, Any]]) -> None:
    """Replace each row's stored `prompt_ids` suffix by the full prompt, in place (one episode's rows)."""
    by_id = {r["call_id"]: r for r in rows}
    done: set[str] = {r["call_id"] for r in rows if r["prefix_call_id"] is None}
    for row in rows:
        chain = []  # rows whose base is not expanded yet, nearest first
        r = row
        while r["call_id"] not in done:
            chain.append(r)
            base = by_id.get(r["prefix_call_id"])
            if base is None or len(chain) > len(rows):
                raise ValueError(f"call {r['call_id']}: prefix call {r['prefix_call_id']} is not in its episode")
            r = base
        for r in reversed(chain):
            base = by_id[r["prefix_call_id"]]
            head = _head(base["prompt_ids"], base["completion_ids"], r["prefix_len"])
            r["prompt_ids"] = np.concatenate([head, r["prompt_ids"]])
            done.add(r["call_id"])


def _head(prompt: np.ndarray, completion: np.ndarray, k: int) -> np.ndarray:
    """The first k ids of prompt + completion, without building the whole sequence."""
    if k <= len(prompt):
        return prompt[:k]
    return np.concatenate([prompt, completion[: k - len(prompt)]])
