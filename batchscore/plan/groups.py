"""From the (enlarged) tree's first-level nodes to prefix groups worth sharing, and savings.

A first-level node becomes a shared group when it is worth it: at least two requests, and a
prefix of at least `min_prefix_tokens` after aligning it down to the KV block size (only
whole blocks can be shared; the remainder moves into the members' suffixes). Everything else
is flattened into plain requests. Saving ratios follow BatchLLM Eq. 1:
R_saving = 1 - processed_tokens / logical_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchscore.plan.enlarge import Enlarged
from batchscore.plan.tree import PrefixTree, TokenTable
from batchscore.plan.types import GroupMember, PrefixGroup


@dataclass
class Unit:
    """What the ordering policies move around: a shared group, or one flattened request.

    `rows` index the TokenTable (input positions). A flattened request has `prefix_len` 0.
    """

    prefix_len: int
    rows: list[int]
    processed_tokens: int
    first_row: int  # smallest input position among `rows`

    @property
    def shared(self) -> bool:
        return self.prefix_len > 0


@dataclass
class SharingRule:
    """When a first-level node is worth a group, and how its prefix is aligned."""

    min_prefix_tokens: int = 16
    block_size: int = 1

    def shared_len(self, depth: int, leaves: int) -> int:
        """Tokens of a node at `depth` with `leaves` requests computed once; 0 = flatten."""
        aligned = depth - depth % self.block_size
        if leaves < 2 or aligned == 0 or aligned < self.min_prefix_tokens:
            return 0
        return aligned


def saved_tokens(tree: PrefixTree, shape: Enlarged, rule: SharingRule) -> int:
    """Tokens the first-level groups of `shape` save over plain prefill: sum of (n-1)*prefix."""
    return sum(
        (shape.leaves[v] - 1) * rule.shared_len(tree.depth[v], shape.leaves[v])
        for v in shape.first_level
    )


def make_units(
    tree: PrefixTree, shape: Enlarged, rule: SharingRule, shortest_first: bool = True
) -> list[Unit]:
    """One Unit per shared first-level node, one per request of every flattened node.

    Units come out in the shape's first-level order. Rows within a unit run shortest first
    (then by input position) so engine batches are even, or by input position alone when
    not `shortest_first` (the `input` baseline).
    Members are found without walking the tree: a node's subtree is the sorted range
    [lo, hi), and a forked node's range nests inside its old ancestor's, so painting the
    ranges outermost first leaves every sorted position owned by its first-level group.
    """
    first_level = shape.first_level
    owner = np.zeros(len(tree.order), dtype=np.int64)
    by_depth = sorted(range(len(first_level)), key=lambda i: tree.depth[first_level[i]])
    for i in by_depth:
        node = first_level[i]
        owner[tree.lo[node] : tree.hi[node]] = i
    sorted_rows = np.asarray(tree.order, dtype=np.int64)
    row_lengths = tree.table.lengths[sorted_rows]
    keys = (sorted_rows, row_lengths, owner) if shortest_first else (sorted_rows, owner)
    grouped = sorted_rows[np.lexsort(keys)]  # by owner, then (length,) input position
    counts = np.bincount(owner, minlength=len(first_level))
    token_sums = np.bincount(owner, weights=row_lengths, minlength=len(first_level))
    bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
    lengths = tree.table.lengths.tolist()

    units: list[Unit] = []
    for i, node in enumerate(first_level):
        rows = grouped[bounds[i] : bounds[i + 1]].tolist()
        prefix_len = rule.shared_len(tree.depth[node], len(rows))
        if prefix_len:
            processed = int(token_sums[i]) - (len(rows) - 1) * prefix_len
            units.append(Unit(prefix_len, rows, processed, min(rows)))
        else:
            units.extend(Unit(0, [r], lengths[r], r) for r in rows)
    return units


def to_prefix_group(unit: Unit, table: TokenTable, row_ids: list[int], options: list | None = None) -> PrefixGroup:
    """Materialize a shared unit as a PrefixGroup (members' suffixes are views, not copies).

    `options` (by input position, or None) are the rows' OptionTokens, handed to the members."""
    arrays = table.arrays
    start = unit.prefix_len
    members = [GroupMember(row_ids[r], arrays[r][start:], options[r] if options else None) for r in unit.rows]
    return PrefixGroup(arrays[unit.rows[0]][:start], members)


def flat_group(rows: list[int], table: TokenTable, row_ids: list[int], options: list | None = None) -> PrefixGroup:
    """A PrefixGroup with an empty prefix holding plain requests (suffix = whole prompt)."""
    arrays = table.arrays
    members = [GroupMember(row_ids[r], arrays[r], options[r] if options else None) for r in rows]
    return PrefixGroup(np.zeros(0, dtype=np.int32), members)
