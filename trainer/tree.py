"""Tree mode: the samples of a group as one token tree in which every shared prefix is computed once.

Samples of an episode share prefixes token for token (a retry, a subagent, a template fork), and GRPO
groups share their task prompt. `build_tree` merges equal prefixes into nodes; a row lays nodes out in
depth-first order with position id = depth and an attention mask in which each node sees itself and its
ancestors only, so every node's hidden state is exactly the one it has in each of its samples. The token
of node n is predicted by its parent's logits: one parent may predict several children.

A node keeps the loss data (loss mask, engine logprob, advantage, coef) of the one sample in which its
token is trainable. Reconstruct makes that sample unique (a completion is trainable only in the first leaf
below it); when two samples do mark the same shared token trainable, the second one does not merge there
but gets its own copy of the rest of its chain, so the tree always computes what the chains compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from openforge.trainer.data import Sample
from openforge.trainer.packing import Row


@dataclass
class Tree:
    token: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)      # -1 for a root
    depth: list[int] = field(default_factory=list)       # the token's index in each of its samples
    children: list[list[int]] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)       # the sample in which the token is trainable, or -1
    count: list[int] = field(default_factory=list)       # samples whose chain passes through the node
    roots: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token)

    def add(self, parent: int, token: int, depth: int) -> int:
        self.token.append(token)
        self.parent.append(parent)
        self.depth.append(depth)
        self.children.append([])
        self.owner.append(-1)
        self.count.append(0)
        (self.children[parent] if parent >= 0 else self.roots).append(len(self.token) - 1)
        return len(self.token) - 1


def build_tree(samples: list[Sample]) -> Tree:
    """Merge the samples' equal prefixes (token arrays compared exactly); nodes are created parents first."""
    tree = Tree()
    child: dict[tuple[int, int], int] = {}  # (parent, token) -> the node shared by every sample that reaches it
    for i, s in enumerate(samples):
        node = -1
        for depth, (token, trainable) in enumerate(zip(s.input_ids.tolist(), s.loss_mask.tolist())):
            parent, node = node, child.get((node, token), -1)
            if node < 0 or (trainable and tree.owner[node] >= 0):  # new, or already trained for another sample
                node = tree.add(parent, token, depth)
                child.setdefault((parent, token), node)
            if trainable:
                tree.owner[node] = i
            tree.count[node] += 1
    return tree


def subtree_sizes(tree: Tree) -> np.ndarray:
    size = np.ones(len(tree), dtype=np.int64)
    for n in range(len(tree) - 1, -1, -1):  # children come after their parent
        if tree.parent[n] >= 0:
            size[tree.parent[n]] += size[n]
    return size


def preorder(tree: Tree, start: int) -> list[int]:
    out, stack = [], [start]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(reversed(tree.children[n]))
    return out


def ancestors(tree: Tree, node: int) -> list[int]:
    path = []
    while (node := tree.parent[node]) >= 0:
        path.append(node)
    return path[::-1]


def subtree_ends(parent: np.ndarray) -> np.ndarray:
    """One past the last position of each node's subtree in a preorder row (`parent`: each node's parent's
    position, -1 for a root): a query at q sees key k iff k <= q < end[k], the ancestor mask (`tree_row`) and,
    without materialising it, the FlexAttention one (trainer/attention.py)."""
    end = np.arange(1, len(parent) + 1)
    for i in range(len(parent) - 1, 0, -1):  # children come after their parent: a child's end is final first
        if parent[i] >= 0:
            end[parent[i]] = max(end[parent[i]], end[i])
    return end


def pieces(tree: Tree, row_tokens: int) -> list[list[int]]:
    """Cover the tree with pieces of at most `row_tokens` nodes, each a subtree-closed set led by its
    ancestor path (repeated as context), splitting only where a subtree does not fit.

    A piece is in depth-first order, ancestors first. A node's subtree that fits whole (with its path) is one
    piece; otherwise its children whose subtrees fit are grouped first-fit decreasing under one copy of the
    path, and the others are split further. A chain longer than a row cannot be split: ValueError.
    """
    size = subtree_sizes(tree)
    out: list[list[int]] = []
    stack = list(reversed(tree.roots))
    while stack:
        node = stack.pop()
        depth = tree.depth[node]
        if depth + size[node] <= row_tokens:
            out.append(ancestors(tree, node) + preorder(tree, node))
            continue
        if not tree.children[node]:
            raise ValueError(f"a sample of {depth + 1} tokens does not fit a row of {row_tokens}")
        path = ancestors(tree, node) + [node]
        room = row_tokens - len(path)
        fits = sorted((c for c in tree.children[node] if size[c] <= room), key=lambda c: -size[c])
        for group in first_fit(fits, [int(size[c]) for c in fits], room):
            out.append(path + [n for c in group for n in preorder(tree, c)])
        stack.extend(reversed([c for c in tree.children[node] if size[c] > room]))
    return out


def first_fit(items: list[int], sizes: list[int], capacity: int) -> list[list[int]]:
    """Bins of at most `capacity`, each item into the first bin it fits (decreasing sizes: FFD)."""
    bins: list[list[int]] = []
    free: list[int] = []
    for item, n in zip(items, sizes):
        i = next((i for i, f in enumerate(free) if f >= n), None)
        if i is None:
            bins.append([])
            free.append(capacity)
            i = len(bins) - 1
        bins[i].append(item)
        free[i] -= n
    return bins


def tree_rows(samples: list[Sample], coef: dict[str, float], row_tokens: int) -> list[Row]:
    """Rows of at most `row_tokens` nodes covering the samples' tree; each node's loss counts in one row."""
    if not samples:
        return []
    tree = build_tree(samples)
    return rows_of_pieces(tree, samples, coef, pieces(tree, row_tokens), row_tokens)


def rows_of_pieces(tree: Tree, samples: list[Sample], coef: dict[str, float], parts: list[list[int]],
                   row_tokens: int) -> list[Row]:
    """The pieces packed first-fit decreasing into rows (a row computes exactly its pieces' nodes)."""
    seen = np.zeros(len(tree), dtype=bool)
    fresh = []  # per piece: the nodes whose loss (and sample tokens) count here, the first piece holding them
    for nodes in parts:
        fresh.append(~seen[nodes])
        seen[nodes] = True
    order = sorted(range(len(parts)), key=lambda i: -len(parts[i]))
    rows = first_fit(order, [len(parts[i]) for i in order], row_tokens)
    return [tree_row(tree, samples, coef, [(parts[i], fresh[i]) for i in row]) for row in rows]


def tree_row(tree: Tree, samples: list[Sample], coef: dict[str, float],
             parts: list[tuple[list[int], np.ndarray]]) -> Row:
    """One packed row [1, T] of pieces: positions by depth, a [1, 1, T, T] ancestor mask, per-node loss data."""
    nodes = np.concatenate([np.asarray(p, dtype=np.int64) for p, _ in parts])
    counted = np.concatenate([f for _, f in parts])
    parent: list[int] = []  # each node's parent's position in the row
    for p, _ in parts:
        local = {n: len(parent) + i for i, n in enumerate(p)}
        parent += [local.get(tree.parent[n], -1) for n in p]
    owner = np.asarray(tree.owner)[nodes]
    trained = counted & (owner >= 0)
    behaviour = np.zeros(len(nodes), np.float32)
    has_behaviour = np.zeros(len(nodes), bool)
    advantage = np.zeros(len(nodes), np.float32)
    cf = np.zeros(len(nodes), np.float32)
    for i in np.flatnonzero(trained):
        s = samples[owner[i]]
        advantage[i], cf[i] = s.advantage, coef[s.sample_id]
        if s.behaviour_logprobs is not None:
            behaviour[i], has_behaviour[i] = s.behaviour_logprobs[tree.depth[nodes[i]]], True
    pos = torch.arange(len(nodes))
    end_t = torch.from_numpy(subtree_ends(np.asarray(parent, dtype=np.int64)))
    mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] < end_t[None, :])  # key is self or an ancestor
    t = lambda a: torch.from_numpy(np.asarray(a))[None]  # noqa: E731
    return Row(t(np.asarray(tree.token)[nodes]), t(np.asarray(tree.depth)[nodes]), mask[None, None], t(trained),
               t(behaviour), t(has_behaviour), t(advantage), t(cf),
               int(np.asarray(tree.count)[nodes][counted].sum()), parent=t(np.asarray(parent, dtype=np.int64)))


class TreeChoice:
    """Which rows each global batch trains on: `tree = true` tree rows, `false` the chains, `"auto"` whichever
    computes fewer tokens, said once per run and mode (`say`).

    Both compute the same loss and gradients (tree mode's tests), so the choice is per batch: the model is
    loaded with sdpa whenever tree mode may be used (`load_model`: flash-attention takes no tree mask), and
    sdpa runs packed chain rows too (restarting position ids make its block-diagonal mask). The count is
    exact and cheap: the tree's pieces (a dictionary walk over the batch's tokens) against the chain rows'
    length, before any forward pass. Rows with images stay chains (`rows_of` passes them without asking).
    """

    def __init__(self, setting: bool | str, row_tokens: int, say: Callable[[str], None]) -> None:
        self.setting, self.row_tokens, self.say = setting, row_tokens, say
        self.said: set[str] = set()

    def rows(self, samples: list[Sample], coef: dict[str, float], chains: list[Row]) -> list[Row]:
        """This rank's rows of `samples`: `chains` (their packed or padded chain rows) or their tree rows."""
        if self.setting is True:
            return tree_rows(samples, coef, self.row_tokens)
        if self.setting is False or not samples:
            return chains
        tree = build_tree(samples)
        parts = pieces(tree, self.row_tokens)
        in_tree, in_chains = sum(len(p) for p in parts), sum(r.input_ids.numel() for r in chains)
        if in_tree < in_chains:
            self.once("tree", f"tree mode: {kilo(in_tree)} tokens computed instead of {kilo(in_chains)} "
                              f"({in_chains / in_tree:.1f}x fewer)")
            return rows_of_pieces(tree, samples, coef, parts, self.row_tokens)
        self.once("chains", f"packed chains: {kilo(in_chains)} tokens computed (tree mode would compute "
                            f"{kilo(in_tree)}: too little shared)")
        return chains

    def once(self, mode: str, line: str) -> None:
        if mode not in self.said:
            self.said.add(mode)
            self.say(line)


def kilo(n: int) -> str:
    """9500 -> '9.5k', 800 -> '800'."""
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)
