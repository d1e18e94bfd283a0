"""BatchLLM's first-level prefix enlargement (Algorithm 1), without recursion.

The first-level nodes of the prefix tree (the root's children) are the natural prefix groups.
A first-level node can be short and shared by very different requests (a common instruction
header), so it hides the long prefixes that sub-groups share. The DP forks such a node: for a
node D, first solve each child; then for each grandchild g of child c,

    gain    = (leaves(g) - 1) * tokens(g)   # g's tokens computed once instead of leaves(g) times
    penalty = tokens(c)                     # c's tokens computed once more, in g's new group

and when gain > penalty, c is forked and merged into g: g becomes a child of D whose tokens are
c's followed by g's. Tie rule: gain == penalty does not fork (no saving, one more group).

With a KV block size, token counts are taken after aligning depths down to a block boundary,
since only whole blocks are shared; block_size=1 is exactly the paper's rule.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchscore.plan.tree import PrefixTree


@dataclass
class Enlarged:
    """The tree's shape after enlargement: new child lists and leaf counts (the tree is kept).

    `first_level` are the root's children after the DP, in output order: for each original
    root child c (lexicographic order), c itself if requests are still left under it, then the
    grandchildren forked out of c, in their lexicographic order.
    """

    children: list[list[int]]
    leaves: list[int]
    first_level: list[int]


def enlarge(tree: PrefixTree, block_size: int = 1) -> Enlarged:
    """Run Algorithm 1 on every node, deepest first; returns new lists, the tree is unchanged.

    Deepest-first order solves every child before its parent, which is what the paper's
    recursion does. A grandchild promoted to D was itself solved before, and its own children
    were not worth forking against its shorter penalty, so one pass suffices.
    """
    children = list(tree.children)  # child lists are replaced below, never changed in place
    leaves = tree.leaves
    aligned = [d - d % block_size for d in tree.depth]  # tokens that can be shared, per depth

    # Only a node with grandchildren can fork anything: the grandparents of inner nodes.
    parent = tree.parent
    workers = {parent[v] for v in range(1, tree.num_nodes) if children[v]}
    for node in [v for v in tree.bottom_up().tolist() if v in workers]:
        new_children: list[int] = []
        for child in children[node]:
            if not children[child]:
                new_children.append(child)
                continue
            penalty = aligned[child] - aligned[node]
            kept: list[int] = []
            forked: list[int] = []
            for grandchild in children[child]:
                gain = (leaves[grandchild] - 1) * (aligned[grandchild] - aligned[child])
                if gain > penalty:
                    forked.append(grandchild)
                    leaves[child] -= leaves[grandchild]
                else:
                    kept.append(grandchild)
            children[child] = kept
            if leaves[child] > 0:  # a fully forked child with no own rows disappears
                new_children.append(child)
            new_children.extend(forked)
        children[node] = new_children
    return Enlarged(children, leaves, first_level=children[0])


def plain_first_level(tree: PrefixTree) -> Enlarged:
    """The first-level groups without enlargement (the root's children as they are)."""
    return Enlarged(list(tree.children), tree.leaves, list(tree.children[0]))
