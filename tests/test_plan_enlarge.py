"""First-level enlargement DP, groups worth sharing, block alignment, paper numbers."""

import numpy as np
import pytest

from batchscore.prepare.synthetic import industry, microbench, table3
from batchscore.plan import PlanOptions, build_plan, requests_from_token_lists
from batchscore.plan.enlarge import enlarge, plain_first_level
from batchscore.plan.tree import TokenTable, build_tree


def seq(*runs):
    return np.concatenate([np.asarray(r, dtype=np.int32) for r in runs])


HEAD = list(range(1000, 1004))  # 4 tokens shared by everything
LONG = list(range(2000, 2010))  # 10 tokens shared by 3 prompts
SHORT = [3000, 3001]  # 2 tokens shared by 2 prompts


def example():
    return [
        seq(HEAD, LONG, [1]), seq(HEAD, LONG, [2]), seq(HEAD, LONG, [3]),
        seq(HEAD, SHORT, [4]), seq(HEAD, SHORT, [5]),
    ]


def test_fork_when_gain_beats_penalty():
    # LONG: gain (3-1)*10 = 20 > penalty 4 -> forked. SHORT: gain 2 < 4 -> stays under HEAD.
    plan = build_plan(requests_from_token_lists(example()), PlanOptions(min_prefix_tokens=1))
    prefixes = sorted(g.prefix_len for g in plan.groups)
    assert prefixes == [4, 14]
    by_len = {g.prefix_len: sorted(m.row_id for m in g.members) for g in plan.groups}
    assert by_len == {14: [0, 1, 2], 4: [3, 4]}
    # 3*15 + 2*7 = 59 logical tokens
    assert plan.stats.first_level_saving_ratio == pytest.approx(4 * 4 / 59)
    assert plan.stats.saving_ratio == pytest.approx((2 * 14 + 1 * 4) / 59)


def test_tie_does_not_fork():
    # gain (2-1)*4 == penalty 4: keep one group.
    lists = [seq(HEAD, [9, 9, 9, 9], [1]), seq(HEAD, [9, 9, 9, 9], [2]), seq(HEAD, [8])]
    arrays = [np.asarray(a, dtype=np.int32) for a in lists]
    tree = build_tree(TokenTable(arrays, np.asarray([len(a) for a in arrays]), 5000))
    shape = enlarge(tree)
    assert shape.first_level == plain_first_level(tree).first_level
    # One more token tips it.
    lists[0] = seq(HEAD, [9, 9, 9, 9, 9], [1])
    lists[1] = seq(HEAD, [9, 9, 9, 9, 9], [2])
    plan = build_plan(requests_from_token_lists(lists), PlanOptions(min_prefix_tokens=1))
    assert sorted(g.prefix_len for g in plan.groups) == [0, 9]


def test_enlarge_off_keeps_first_level():
    options = PlanOptions(min_prefix_tokens=1, enlarge=False)
    plan = build_plan(requests_from_token_lists(example()), options)
    assert [g.prefix_len for g in plan.groups] == [4]
    assert plan.stats.saving_ratio == plan.stats.first_level_saving_ratio


def test_flattening_merges_plain_requests_into_one_empty_prefix_group():
    lists = example() + [[1, 2, 3], [7, 8], [9]]
    plan = build_plan(requests_from_token_lists(lists), PlanOptions(min_prefix_tokens=5))
    shared = [g for g in plan.groups if g.prefix_len]
    plain = [g for g in plan.groups if not g.prefix_len]
    assert [g.prefix_len for g in shared] == [14]
    assert len(plain) == 1  # r_group order puts the short plain requests next to each other
    assert sorted(m.row_id for m in plain[0].members) == [3, 4, 5, 6, 7]
    for member in plain[0].members:
        assert member.suffix.tolist() == list(lists[member.row_id])
    lengths = [len(m.suffix) for m in plain[0].members]
    assert lengths == sorted(lengths)


def test_block_alignment_moves_remainder_into_suffixes():
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 1000, 37)
    lists = [np.concatenate([prefix, rng.integers(0, 1000, 5)]) for _ in range(4)]
    plan = build_plan(requests_from_token_lists(lists), PlanOptions(block_size=16))
    (group,) = plan.groups
    assert group.prefix_len == 32
    for m in group.members:
        assert len(m.suffix) == 10
        assert np.array_equal(np.concatenate([group.prefix, m.suffix]), lists[m.row_id])
    stats = plan.stats
    assert stats.unaligned_saving_ratio == pytest.approx(3 * 37 / 168)
    assert stats.saving_ratio == pytest.approx(3 * 32 / 168)


@pytest.mark.parametrize("setting,expected", [("A", 0.486), ("B", 0.397)])
def test_table3_saving(setting, expected):
    plan = build_plan(requests_from_token_lists(table3(setting)))
    assert plan.stats.num_requests == 6400 and plan.stats.logical_tokens == 6_400_000
    assert abs(plan.stats.saving_ratio - expected) <= 0.003
    assert len(plan.groups) == 50


def test_microbench_reaches_upper_bound():
    exact = build_plan(requests_from_token_lists(microbench(num_requests=320, poisson=False))).stats
    assert exact.saving_ratio == pytest.approx(1 - (2000 + 16 * 200) / (16 * 2200))
    assert abs(exact.saving_ratio - 0.852) <= 0.001
    assert exact.saving_ratio == pytest.approx(exact.multilevel_saving_ratio)
    noisy = build_plan(requests_from_token_lists(microbench(num_requests=800))).stats
    assert abs(noisy.saving_ratio - 0.852) <= 0.003
    assert noisy.saving_ratio == pytest.approx(noisy.multilevel_saving_ratio)


def test_industry_needs_enlargement():
    # A shared 64-token header makes the plain first level useless; the DP recovers sharing.
    stats = build_plan(requests_from_token_lists(industry(num_requests=600))).stats
    assert stats.first_level_saving_ratio < 0.1
    assert stats.saving_ratio > 0.6
    assert stats.saving_ratio <= stats.multilevel_saving_ratio
