"""Compact prefix tree: shape, duplicates, prefixes, deep chains, sort order."""

import numpy as np

from batchscore.plan import build_plan, requests_from_token_lists
from batchscore.plan.tree import TokenTable, build_tree, lexicographic_order


def tree_of(token_lists):
    arrays = [np.asarray(t, dtype=np.int32) for t in token_lists]
    lengths = np.asarray([len(a) for a in arrays], dtype=np.int64)
    return build_tree(TokenTable(arrays, lengths, max(int(a.max()) for a in arrays)))


def path_tokens(tree, node):
    """Tokens from the root to the end of `node`."""
    parts = []
    while node:
        parts.append(tree.node_tokens(node))
        node = tree.parent[node]
    return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int32)


def check_invariants(tree, token_lists):
    ends = {}
    for node in range(tree.num_nodes):
        for seq in tree.rows[node]:
            ends[seq] = node
        # Children have distinct first tokens, in increasing order: a compact tree.
        firsts = [int(tree.node_tokens(c)[0]) for c in tree.children[node]]
        assert firsts == sorted(set(firsts))
        if node:
            assert tree.depth[node] > tree.depth[tree.parent[node]]
            # An inner node without rows of its own branches (else it would be merged away).
            assert tree.rows[node] or len(tree.children[node]) >= 2
    assert sorted(ends) == list(range(len(token_lists)))
    for seq, node in ends.items():
        assert path_tokens(tree, node).tolist() == list(token_lists[seq])
    leaves = tree.leaves
    for node in range(tree.num_nodes):
        assert leaves[node] == len(tree.rows[node]) + sum(leaves[c] for c in tree.children[node])


def test_small_tree_shape():
    lists = [[1, 2, 3], [1, 2], [1, 2, 3], [4], [1, 5], [1, 2, 3, 4, 5]]
    tree = tree_of(lists)
    check_invariants(tree, lists)
    # root -> [1] -> {[2] -> {[3] -> [4 5]}, [5]} and root -> [4]
    assert tree.num_nodes == 7
    assert tree.stored_tokens() == 7  # 1,2,3,4,5 + 5 + 4
    assert sorted(len(tree.rows[v]) for v in range(tree.num_nodes)) == [0, 0, 1, 1, 1, 1, 2]


def test_duplicates_share_one_node():
    lists = [[7, 8, 9]] * 4
    tree = tree_of(lists)
    check_invariants(tree, lists)
    assert tree.num_nodes == 2 and tree.rows[1] == [0, 1, 2, 3]
    assert tree.stored_tokens() == 3


def test_prompt_that_prefixes_another_becomes_member_with_empty_suffix():
    lists = [list(range(100, 140)), list(range(100, 120))]
    tree = tree_of(lists)
    check_invariants(tree, lists)
    plan = build_plan(requests_from_token_lists(lists))
    (group,) = plan.groups
    assert group.prefix_len == 20
    assert sorted(len(m.suffix) for m in group.members) == [0, 20]


def test_prompts_sharing_nothing():
    lists = [[i, i + 1, i + 2] for i in range(0, 30, 3)]
    tree = tree_of(lists)
    check_invariants(tree, lists)
    assert tree.children[0] and all(not tree.children[c] for c in tree.children[0])
    plan = build_plan(requests_from_token_lists(lists))
    assert len(plan.groups) == 1 and plan.groups[0].prefix_len == 0
    assert plan.stats.saving_ratio == 0.0 and plan.stats.multilevel_saving_ratio == 0.0


def test_deep_chain_5000_levels_without_recursion():
    base = np.arange(1, 5001, dtype=np.int32)
    lists = [base[:k] for k in range(1, 5001)]
    tree = tree_of(lists)
    assert tree.num_nodes == 5001
    assert max(tree.depth) == 5000 and tree.stored_tokens() == 5000
    plan = build_plan(requests_from_token_lists(lists))
    rows = sorted(m.row_id for g in plan.groups for m in g.members)
    assert rows == list(range(5000))
    assert plan.stats.processed_tokens >= 5000


def test_lexicographic_order_matches_tuple_sort_with_wide_ids():
    rng = np.random.default_rng(3)
    lists = [rng.integers(0, 3, size=rng.integers(1, 6)).tolist() for _ in range(200)]
    lists += [[70000, 1], [65535], [65536, 0], [1, 70000]]
    arrays = [np.asarray(t, dtype=np.int32) for t in lists]
    table = TokenTable(arrays, np.asarray([len(a) for a in arrays]), 70000)
    order = lexicographic_order(table)
    assert [lists[i] for i in order] == sorted(lists)
    assert order == sorted(range(len(lists)), key=lambda i: (lists[i], i))  # stable
    check_invariants(build_tree(table), lists)
