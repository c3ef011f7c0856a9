"""Prompt ids stored as a suffix of the episode's previous call: agent prompts grow by one turn per call.

Stored in full, an episode of n calls costs O(n^2) tokens in `call_tokens` (every prompt repeats the
system prompt and the whole history). Instead each call's prompt is stored as `prefix_len` tokens of an
earlier call's prompt + completion (`prefix_call_id`, same episode) followed by its own suffix.
`split` does it while ingesting; `expand` undoes it when an episode is rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np

from openforge.reconstruct.answer_json import RawIds


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class _Last(NamedTuple):
    call_id: str
    full: np.ndarray  # prompt + completion ids
    n_prompt: int
    raw: RawIds | None  # the prompt as the engine's JSON text, when it came that way


class PrefixSplitter:
    """Remembers each episode's latest call (id, prompt + completion ids), up to `max_cells` ids in all.

    An episode pushed out of memory (least recently seen first) simply stores its next prompt in full.
    """

    def __init__(self, max_cells: int = 4_000_000) -> None:
        self.max_cells = max_cells
        self._last: OrderedDict[str, _Last] = OrderedDict()
        self._cells = 0

    def split(self, episode: str, call_id: str, prompt: list[int] | np.ndarray | RawIds,
              completion: np.ndarray) -> tuple[str | None, int, np.ndarray]:
        """(prefix call id or None, prefix length, suffix to store) for this call's prompt.

        A `RawIds` prompt that starts with the previous call's prompt text is parsed only after it.
        Raises ValueError for ids that are not integers.
        """
        base = self._last.pop(episode, None)
        if base is not None:
            self._cells -= _cells(base)
        tail = prompt.tail_after(base.raw) if isinstance(prompt, RawIds) and base and base.raw else None
        if tail is not None:
            ids = np.concatenate([base.full[:base.n_prompt], int32(tail)])  # type: ignore[union-attr]
        else:
            ids = int32(prompt.parse() if isinstance(prompt, RawIds) else prompt)
        prefix_id, k = None, 0
        if base is not None:
            k = common_prefix(ids, base.full)
            prefix_id = base.call_id if k else None
        last = _Last(call_id, np.concatenate([ids, completion]), len(ids),
                     prompt if isinstance(prompt, RawIds) else None)
        self._last[episode] = last
        self._cells += _cells(last)
        while self._cells > self.max_cells and len(self._last) > 1:
            _, old = self._last.popitem(last=False)
            self._cells -= _cells(old)
        return prefix_id, k, ids[k:]

    def forget(self, call_id: str) -> None:
        """Drop the episode whose latest call is `call_id` (a call not stored after all): its next prompt is
        then stored whole, not as a suffix of a call that is not there."""
        for episode, last in self._last.items():
            if last.call_id == call_id:
                self._cells -= _cells(self._last.pop(episode))
                return


def _cells(last: _Last) -> int:
    """Memory held for an episode, in int32-sized cells."""
    return len(last.full) + (len(last.raw.text) // 4 if last.raw is not None else 0)


def int32(ids: list[int] | np.ndarray) -> np.ndarray:
    """Token ids as int32 (`fromiter` with a known count: the fastest way from a Python list).

    Raises ValueError for what does not convert (a string, null, a number beyond int32).
    """
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int32, copy=False)
    try:
        return np.fromiter(ids, np.int32, len(ids))
    except (TypeError, OverflowError) as e:
        raise ValueError(f"token ids must be integers: {e}") from None


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
