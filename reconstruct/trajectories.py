"""An episode's calls as a prefix tree of token ids; each root-to-leaf chain is one training sample.

A call continues a chain when its prompt ids start exactly with that chain's ids so far (prompt +
completion of the chain's last call): the tokens in between (tool results, user turns, template glue)
join at loss mask 0. Otherwise it hangs off the longest chain it does extend, or starts a new root.
Every trainable call's completion is trainable in exactly one sample: the first leaf (in call order) below
it. A call that is not trainable (another role, a prompt the engine rendered otherwise) stays at mask 0.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

DRIFT_CLASSES = ("template", "retokenization", "client_rewrite", "other")


@dataclass
class TreeCall:
    call_id: str
    prompt: np.ndarray  # int32
    completion: np.ndarray  # int32
    logprobs: np.ndarray | None  # float32, aligned with completion
    token_source: str  # engine | retokenized | mixed
    conv_prefixes: list[str] = field(default_factory=list)  # loose conversation hashes, see episodes.py
    conv_end: str = ""
    trainable: bool = True  # False: its completion stays at loss mask 0 (not the policy's, or template drift)
    toolchain: str | None = None
    policy_version: int | None = None  # the proxy's policy version when the call went to the engine

    @property
    def end(self) -> int:
        return len(self.prompt) + len(self.completion)


@dataclass
class SampleRow:
    """One chain of calls as a training sample: what becomes a row of the `samples` table."""

    path: list[int]  # indices of the calls on this chain, root first
    owned: list[int]  # calls whose completion is trainable here
    input_ids: np.ndarray
    loss_mask: np.ndarray  # uint8
    logprobs: np.ndarray | None
    token_source: str


def _extends(prompt: np.ndarray, prev: TreeCall) -> bool:
    n, k = len(prev.prompt), len(prev.completion)
    if n + k > len(prompt):
        return False
    return np.array_equal(prompt[:n], prev.prompt) and np.array_equal(prompt[n : n + k], prev.completion)


def build_tree(calls: list[TreeCall]) -> list[int | None]:
    """Parent index per call (calls in start order): the longest earlier chain its prompt extends."""
    parents: list[int | None] = []
    by_end: list[tuple[int, int]] = []  # (-end, index) of earlier calls, longest first: the first match is the best
    for i, c in enumerate(calls):
        parents.append(next((j for _, j in by_end if _extends(c.prompt, calls[j])), None))
        bisect.insort(by_end, (-c.end, i))
    return parents


def near_misses(calls: list[TreeCall], parents: list[int | None]) -> list[tuple[int, int]]:
    """(call, conversational parent) wherever the conversation continues a call but the tokens do not."""
    out = []
    ends: dict[str, int] = {}  # conversation end hash -> latest earlier call ending there
    for i, c in enumerate(calls):
        conv_parent = next((ends[h] for h in reversed(c.conv_prefixes) if h in ends), None)
        if conv_parent is not None and not _extends(c.prompt, calls[conv_parent]):
            out.append((i, conv_parent))
        ends[c.conv_end] = i
    return out


def chains(calls: list[TreeCall], parents: list[int | None]) -> list[SampleRow]:
    """One sample per leaf; each call's completion is owned by the first leaf below it."""
    children: list[list[int]] = [[] for _ in calls]
    for i, p in enumerate(parents):
        if p is not None:
            children[p].append(i)
    owner = [-1] * len(calls)
    for i in reversed(range(len(calls))):  # children come after parents, so this is bottom-up
        owner[i] = owner[children[i][0]] if children[i] else i
    samples = []
    for leaf in (i for i in range(len(calls)) if not children[i]):
        path = [leaf]
        while parents[path[-1]] is not None:
            path.append(parents[path[-1]])  # type: ignore[arg-type]
        path.reverse()
        last = calls[leaf]
        ids = np.concatenate([last.prompt, last.completion]).astype(np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        owned = [i for i in path if owner[i] == leaf]
        trained = [i for i in owned if calls[i].trainable]
        have_lp = all(calls[i].logprobs is not None for i in trained)
        lps = np.full(len(ids), np.nan, dtype=np.float32) if have_lp else None
        for i in trained:
            start = len(calls[i].prompt)
            stop = start + len(calls[i].completion)
            mask[start:stop] = 1
            if lps is not None:
                lps[start:stop] = calls[i].logprobs
        sources = {calls[i].token_source for i in path}
        samples.append(
            SampleRow(path, owned, ids, mask, lps, sources.pop() if len(sources) == 1 else "mixed")
        )
    return samples
