"""Placement of prefix groups over workers: coverage, order, balance, splitting, baseline."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchscore.prepare.synthetic import microbench
from batchscore.plan import PlanOptions, build_plan, requests_from_token_lists
from batchscore.plan import Placement, place_groups, round_robin_requests
from batchscore.plan.types import GroupMember, PrefixGroup

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def group(prefix_len, suffix_lens, first_row, token=1):
    """A group with a `prefix_len` prefix of `token`s and members with the given suffix lengths."""
    members = [
        GroupMember(first_row + i, np.full(n, 7 + i, dtype=np.int32))
        for i, n in enumerate(suffix_lens)
    ]
    return PrefixGroup(np.full(prefix_len, token, dtype=np.int32), members)


@st.composite
def plans(draw):
    """Groups in plan order: prefixed and plain, of one or many members, row ids shuffled."""
    count = draw(st.integers(0, 8))
    groups, row = [], 0
    for g in range(count):
        prefix_len = draw(st.sampled_from([0, 0, 3, 20, 200]))
        suffixes = draw(st.lists(st.integers(0 if prefix_len else 1, 40), min_size=1, max_size=12))
        groups.append(group(prefix_len, suffixes, row, token=g + 1))
        row += len(suffixes)
    rows = draw(st.permutations(range(row)))
    for g in groups:
        for m in g.members:
            m.row_id = 100 + rows[m.row_id]
    return groups


def prompts_of(groups):
    return {
        m.row_id: np.concatenate([g.prefix, m.suffix]).tolist() for g in groups for m in g.members
    }


def plan_index(groups):
    return {m.row_id: i for i, g in enumerate(groups) for m in g.members}


def check_placement(groups, placement: Placement, num_workers):
    """Each member once, prompts reproduced, plan order per worker, costs add up."""
    assert [w.worker for w in placement.workers] == list(range(num_workers))
    where = plan_index(groups)
    seen = {}
    for worker in placement.workers:
        order = []
        for g in worker.groups:
            assert g.members
            indices = {where[m.row_id] for m in g.members}
            assert len(indices) == 1  # a worker's group comes from one plan group
            order.append(indices.pop())
            original = groups[order[-1]]
            assert np.array_equal(g.prefix, original.prefix)
            positions = [original.members.index(m) for m in g.members]
            assert positions == sorted(positions)  # members keep plan order
            for m in g.members:
                assert m.row_id not in seen
                seen[m.row_id] = np.concatenate([g.prefix, m.suffix]).tolist()
        assert order == sorted(order) and len(set(order)) == len(order)  # plan order
        assert worker.cost == sum(g.processed_tokens for g in worker.groups)
    assert seen == prompts_of(groups)
    plan_total = sum(g.processed_tokens for g in groups)
    assert placement.total_processed_tokens == sum(w.cost for w in placement.workers)
    assert placement.total_processed_tokens == plan_total + placement.split_extra_tokens
    if plan_total:
        mean = placement.total_processed_tokens / num_workers
        assert placement.imbalance == pytest.approx(max(w.cost for w in placement.workers) / mean)
    else:
        assert placement.imbalance == 1.0


def holders(groups, placement):
    """Plan group index -> set of workers holding at least one of its members."""
    where = plan_index(groups)
    out = {}
    for worker in placement.workers:
        for g in worker.groups:
            out.setdefault(where[g.members[0].row_id], set()).add(worker.worker)
    return out


def layout(placement):
    return [
        [(g.prefix.tolist(), [m.row_id for m in g.members]) for g in w.groups]
        for w in placement.workers
    ]


@SETTINGS
@given(plans(), st.integers(1, 9))
def test_every_member_once_in_plan_order(groups, num_workers):
    check_placement(groups, place_groups(groups, num_workers), num_workers)


@SETTINGS
@given(plans(), st.integers(1, 9))
def test_only_groups_above_fair_share_are_split(groups, num_workers):
    placement = place_groups(groups, num_workers)
    fair = sum(g.processed_tokens for g in groups) / num_workers
    split = {i for i, ws in holders(groups, placement).items() if len(ws) > 1}
    for i in split:
        assert groups[i].prefix_len == 0 or groups[i].processed_tokens > fair
    assert placement.split_extra_tokens == sum(
        groups[i].prefix_len * (len(ws) - 1) for i, ws in holders(groups, placement).items()
    )


@SETTINGS
@given(plans(), st.integers(1, 9))
def test_deterministic(groups, num_workers):
    assert layout(place_groups(groups, num_workers)) == layout(place_groups(groups, num_workers))


@SETTINGS
@given(plans(), st.integers(1, 9))
def test_round_robin_baseline(groups, num_workers):
    placement = round_robin_requests(groups, num_workers)
    check_placement(groups, placement, num_workers)
    rows = sorted(prompts_of(groups))
    for worker in placement.workers:
        for g in worker.groups:
            for m in g.members:
                assert rows.index(m.row_id) % num_workers == worker.worker


@SETTINGS
@given(plans())
def test_one_worker_is_the_plan(groups):
    placement = place_groups(groups, 1)
    assert len(placement.workers) == 1
    assert all(a is b for a, b in zip(placement.workers[0].groups, groups))
    assert len(placement.workers[0].groups) == len(groups)
    assert placement.split_extra_tokens == 0
    assert placement.total_processed_tokens == sum(g.processed_tokens for g in groups)


def test_no_split_when_every_group_fits_the_fair_share():
    groups = [
        group(50, [10] * 3, 0, 1),
        group(60, [5] * 4, 3, 2),
        group(40, [30], 7, 3),
        group(70, [1] * 2, 8, 4),
    ]
    placement = place_groups(groups, 2)
    check_placement(groups, placement, 2)
    assert placement.split_extra_tokens == 0
    kept = [g for w in placement.workers for g in w.groups]
    assert sorted(map(id, kept)) == sorted(map(id, groups))  # the same objects, uncut


def test_big_group_is_replicated_into_few_parts():
    big = group(100, [10] * 40, 0, 1)  # 500 tokens, prefix 100
    small = [group(20, [10] * 2, 40 + 2 * i, i + 2) for i in range(10)]  # 40 each
    groups = [small[0], big] + small[1:]
    placement = place_groups(groups, 4)  # fair share 225
    check_placement(groups, placement, 4)
    parts = len(holders(groups, placement)[1])
    assert 2 <= parts <= 4
    assert placement.split_extra_tokens == 100 * (parts - 1)
    assert placement.imbalance <= 1.1


def test_prefix_heavy_group_is_not_cut_when_replicas_would_not_pay():
    heavy = group(1000, [5, 5], 0, 1)  # 1010 tokens, nearly all prefix
    groups = [heavy, group(10, [1] * 3, 2, 2), group(10, [1] * 3, 5, 3)]
    placement = place_groups(groups, 2)
    check_placement(groups, placement, 2)
    assert placement.split_extra_tokens == 0


def test_plain_requests_split_freely():
    plain = group(0, [10] * 8, 0)
    placement = place_groups([plain], 4)
    check_placement([plain], placement, 4)
    assert [w.cost for w in placement.workers] == [20] * 4
    assert placement.imbalance == 1.0 and placement.split_extra_tokens == 0


def test_more_workers_than_requests():
    groups = [group(30, [5], 0, 1), group(0, [9, 9], 1)]
    placement = place_groups(groups, 8)
    check_placement(groups, placement, 8)
    assert sum(1 for w in placement.workers if w.groups) == 3
    assert sum(1 for w in placement.workers if not w.groups and w.cost == 0) == 5


def test_no_groups():
    placement = place_groups([], 3)
    assert [w.groups for w in placement.workers] == [[], [], []]
    assert placement.imbalance == 1.0 and placement.total_processed_tokens == 0


def test_bad_worker_count():
    with pytest.raises(ValueError, match="num_workers"):
        place_groups([], 0)
    with pytest.raises(ValueError, match="num_workers"):
        round_robin_requests([], 0)


def test_round_robin_counts_prefix_once_per_worker():
    groups = [group(100, [1, 2, 3], 0, 1)]  # rows 0, 1, 2
    placement = round_robin_requests(groups, 2)  # worker 0: rows 0, 2; worker 1: row 1
    assert [w.cost for w in placement.workers] == [104, 102]
    assert placement.split_extra_tokens == 100


def test_planned_microbench_is_balanced_without_replication():
    prompts = microbench(num_requests=256, prefix_len=300, distinct_len=30)
    requests = requests_from_token_lists(prompts)
    plan = build_plan(requests, PlanOptions())
    for num_workers in (2, 4):
        placement = place_groups(plan.groups, num_workers)
        check_placement(plan.groups, placement, num_workers)
        assert placement.imbalance <= 1.05
        assert placement.total_processed_tokens <= 1.02 * plan.stats.processed_tokens
        baseline = round_robin_requests(plan.groups, num_workers)
        assert baseline.total_processed_tokens > placement.total_processed_tokens
