"""Compact prefix (radix) tree over the token-id sequences of a whole batch.

A node holds a run of tokens shared by every request below it. The tree is built without
recursion and without a per-token Python loop: sort the sequences lexicographically, compute
the longest common prefix (LCP) of sorted neighbours with numpy, then build the tree from the
LCP array with a stack (the way a suffix tree is built from a suffix array).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TokenTable:
    """The prompts of the batch (int32 arrays, not copied) and their lengths, by input position.

    `max_token` (the largest id) picks the width of the sort keys.
    """

    arrays: list[np.ndarray]  # N arrays of [T_i] int32
    lengths: np.ndarray  # [N] int64
    max_token: int

    def __len__(self) -> int:
        return len(self.arrays)

    def sequence(self, i: int) -> np.ndarray:
        """The tokens of prompt `i` (the caller's array, not a copy)."""
        return self.arrays[i]


@dataclass
class PrefixTree:
    """A compact prefix tree; node 0 is the root (depth 0, no tokens, no parent).

    Node `v` covers token positions `[depth[parent[v]], depth[v])` of every sequence below it;
    `rep[v]` names one such sequence so the tokens can be sliced out of the `TokenTable`.
    `rows[v]` are the sequences (indices into the table) that end exactly at `v`: several when
    prompts are duplicates, and an inner node's rows are prompts that prefix longer ones.
    Children are kept in lexicographic order of their tokens. A subtree is a contiguous
    range of the sorted sequences, so leaf counts and members come from `lo`/`hi` in O(1).
    """

    table: TokenTable
    order: list[int]  # sequence indices in lexicographic order
    parent: list[int]  # parent[0] is 0 and never read: the root has no parent
    depth: list[int]
    rep: list[int]
    children: list[list[int]]
    rows: list[list[int]]
    lo: list[int]  # the subtree's sequences are order[lo[v]:hi[v]] (sorted, so contiguous)
    hi: list[int]

    @property
    def leaves(self) -> list[int]:
        """Requests ending in each node's subtree (BatchLLM's "leaves"); a new list per call."""
        return (np.asarray(self.hi) - np.asarray(self.lo)).tolist()

    @property
    def num_nodes(self) -> int:
        return len(self.depth)

    def node_tokens(self, v: int) -> np.ndarray:
        """The run of tokens node `v` holds (a view)."""
        if v == 0:
            return np.zeros(0, dtype=np.int32)
        return self.table.sequence(self.rep[v])[self.depth[self.parent[v]] : self.depth[v]]

    def stored_tokens(self) -> int:
        """Tokens stored in the whole tree: what computing every shared node once costs."""
        depth = np.asarray(self.depth, dtype=np.int64)
        parent = np.asarray(self.parent, dtype=np.int64)
        return int((depth[1:] - depth[parent[1:]]).sum())

    def bottom_up(self) -> np.ndarray:
        """Node ids, deepest first: every node comes before its parent."""
        return np.argsort(-np.asarray(self.depth, dtype=np.int64), kind="stable")


def build_tree(table: TokenTable) -> PrefixTree:
    """Build the compact prefix tree of every sequence in `table`; changes nothing it is given."""
    order = lexicographic_order(table)
    lcp = neighbour_lcp(table, order)
    return _tree_from_lcp(table, order, lcp)


def lexicographic_order(table: TokenTable) -> list[int]:
    """Sequence indices sorted lexicographically by tokens (stable: duplicates keep input order).

    Why bytes: big-endian unsigned bytes compare like the token sequence (a prefix of tokens is
    a prefix of bytes, and the first differing token decides the first differing byte), and
    Python sorts bytes with memcmp, so the sort never loops over tokens in Python. Two bytes
    per token when every id fits (most vocabularies), four otherwise: half the memory traffic.
    """
    width = ">u4" if table.max_token > 0xFFFF else ">u2"  # ids are validated non-negative
    keys = [a.astype(width).tobytes() for a in table.arrays]
    return sorted(range(len(keys)), key=keys.__getitem__)


def neighbour_lcp(table: TokenTable, order: list[int]) -> list[int]:
    """lcp[k] = common prefix length of sorted sequences k-1 and k (lcp[0] = 0)."""
    arrays = table.arrays
    lcp = [0] * len(order)
    prev = arrays[order[0]] if order else None
    for k in range(1, len(order)):
        cur = arrays[order[k]]
        m = min(prev.shape[0], cur.shape[0])
        diff = prev[:m] != cur[:m]
        first = int(diff.argmax())
        lcp[k] = first if diff[first] else m
        prev = cur
    return lcp


def _tree_from_lcp(table: TokenTable, order: list[int], lcp: list[int]) -> PrefixTree:
    """Stack construction: the stack is the path from the root to the last inserted sequence.

    For each sorted sequence, pop the path back to depth lcp, split an edge if lcp falls
    inside one, then hang the new sequence below. A node's sorted range closes when it is
    popped. O(N) nodes, O(N) Python steps.
    """
    lengths = table.lengths.tolist()
    n = len(order)
    parent = [0]
    depth = [0]
    rep = [order[0] if order else 0]
    children: list[list[int]] = [[]]
    rows: list[list[int]] = [[]]
    lo = [0]
    hi = [n]

    stack = [0]
    for k, (seq, shared) in enumerate(zip(order, lcp)):
        popped = 0
        while depth[stack[-1]] > shared:
            popped = stack.pop()
            hi[popped] = k
        top = stack[-1]
        if depth[top] < shared:
            # `shared` ends inside the edge to `popped` (top's last child): split that edge.
            mid = len(depth)
            parent.append(top)
            depth.append(shared)
            rep.append(seq)
            children.append([popped])
            rows.append([])
            lo.append(lo[popped])
            hi.append(n)
            children[top][-1] = mid
            parent[popped] = mid
            stack.append(mid)
            top = mid
        if lengths[seq] == depth[top]:
            rows[top].append(seq)  # a duplicate, or a prompt that prefixes later ones
        else:
            leaf = len(depth)
            parent.append(top)
            depth.append(lengths[seq])
            rep.append(seq)
            children.append([])
            rows.append([seq])
            lo.append(k)
            hi.append(n)  # closed when popped; nodes still on the stack at the end run to n
            children[top].append(leaf)
            stack.append(leaf)
    return PrefixTree(table, order, parent, depth, rep, children, rows, lo, hi)
