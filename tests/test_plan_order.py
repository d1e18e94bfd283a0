"""Ordering policies and the simulated prefix cache (PrefillOnly Fig. 5, BatchLLM ordering)."""

import numpy as np
import pytest

from batchscore.prepare.synthetic import microbench
from batchscore.plan import (
    PlanOptions,
    build_plan,
    requests_from_token_lists,
    simulate,
    simulate_groups,
)
from batchscore.plan.cache_sim import PrefixCache, block_keys
from batchscore.plan.srjf import SrjfJob, srjf_schedule


def arr(tokens):
    return np.asarray(tokens, dtype=np.int32)


# --- the cache simulator -----------------------------------------------------------------

def test_block_keys_name_whole_prefixes():
    a = arr([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = arr([1, 2, 3, 4, 0, 6, 7, 8])
    ka, kb = block_keys(a, 4), block_keys(b, 4)
    assert len(ka) == 2 and len(kb) == 2  # partial blocks are not cached
    assert ka[0] == kb[0] and ka[1] != kb[1]
    assert block_keys(arr([5, 6, 7, 8]), 4)[0] != ka[1]  # same block, other prefix


def test_lru_evicts_tails_first():
    cache = PrefixCache(capacity_tokens=6, block_size=1)
    cache.admit(block_keys(arr([1, 2, 3, 4]), 1))
    change = cache.admit(block_keys(arr([9, 8, 7]), 1))
    assert len(change.evicted) == 1
    assert cache.cached_tokens(block_keys(arr([1, 2, 3, 4]), 1)) == 3  # lost its last token


def test_simulate_counts_hits_and_last_token():
    seqs = [arr([1, 2, 3, 4]), arr([1, 2, 3, 4]), arr([1, 2, 9])]
    result = simulate(seqs, capacity_tokens=None, block_size=1)
    assert result.cached_per_request == [0, 3, 2]  # a full hit still computes its last token
    assert result.processed_tokens == 4 + 1 + 1
    assert result.hits == 2


# --- PrefillOnly Figure 5 ----------------------------------------------------------------

P_AD = list(range(100, 108))  # A and D share 8 tokens
P_BC = list(range(200, 208))  # B and C share 8 tokens
FIG5 = {
    "A": arr(P_AD + [1, 2]),  # 10 tokens
    "B": arr(P_BC + [3] * 6),  # 14
    "C": arr(P_BC + [4] * 4),  # 12
    "D": arr(P_AD + [5] * 8),  # 16
}
CAPACITY = 16  # holds one request


def fig5_jobs():
    jobs = []
    for name in "ABCD":
        keys = block_keys(FIG5[name], 1)
        jobs.append(SrjfJob(keys, len(FIG5[name]), len(FIG5[name]) - 1, [keys]))
    return jobs


def hits(order):
    return simulate([FIG5["ABCD"[i]] for i in order], CAPACITY, 1).hits


def test_figure5_fifo_and_plain_srjf_get_one_hit():
    assert hits([0, 1, 2, 3]) == 1  # FIFO: C reuses B
    plain = srjf_schedule(fig5_jobs(), PrefixCache(CAPACITY, 1), calibrate=False)
    assert ["ABCD"[i] for i in plain] == ["A", "C", "B", "D"]
    assert hits(plain) == 1  # B reuses C; A is evicted before D


def test_figure5_calibrated_srjf_gets_two_hits():
    order = srjf_schedule(fig5_jobs(), PrefixCache(CAPACITY, 1), lam=500.0)
    assert ["ABCD"[i] for i in order] == ["A", "D", "C", "B"]
    assert hits(order) == 2


def test_waiting_time_term_favours_earlier_arrivals():
    jobs = fig5_jobs()
    jobs[3].arrival_s = -1.0  # D has waited one second longer: 500 tokens of credit
    order = srjf_schedule(jobs, PrefixCache(CAPACITY, 1), lam=500.0)
    assert order[0] == 3


# --- plan ordering policies ---------------------------------------------------------------

def shuffled_microbench():
    return microbench(prefix_len=400, distinct_len=40, sharing_degree=8, num_requests=160, seed=2)


def test_r_group_order_is_smallest_group_first():
    plan = build_plan(requests_from_token_lists(shuffled_microbench()))
    costs = [g.processed_tokens for g in plan.groups]
    assert costs == sorted(costs)


def test_input_order_follows_first_member_position():
    lists = shuffled_microbench()
    plan = build_plan(requests_from_token_lists(lists), PlanOptions(order="input"))
    firsts = [min(m.row_id for m in g.members) for g in plan.groups]
    assert firsts == sorted(firsts)
    for g in plan.groups:
        rows = [m.row_id for m in g.members]
        assert rows == sorted(rows)


@pytest.mark.parametrize("order", ["r_group", "input", "srjf"])
def test_members_of_a_group_stay_together(order):
    lists = shuffled_microbench()
    options = PlanOptions(order=order, block_size=16, cache_tokens=2000)
    plan = build_plan(requests_from_token_lists(lists), options)
    assert sorted(m.row_id for g in plan.groups for m in g.members) == list(range(len(lists)))
    assert len(plan.groups) == 20


def test_input_order_thrashes_a_small_cache_r_group_reaches_first_level_saving():
    # 20 prefixes of ~400 tokens, a cache of ~5 requests: shuffled input order keeps losing
    # prefixes before their next member comes, r_group order runs each group back to back.
    block = 16
    lists = shuffled_microbench()
    requests = requests_from_token_lists(lists)
    capacity = 5 * 440
    grouped = build_plan(requests, PlanOptions(block_size=block))
    baseline = build_plan(requests, PlanOptions(order="input", block_size=block))
    as_given = simulate(lists, capacity, block)  # the input order, request by request
    by_group = simulate_groups(grouped.groups, capacity, block)
    in_input_groups = simulate_groups(baseline.groups, capacity, block)
    assert by_group.processed_tokens == grouped.stats.processed_tokens
    assert by_group.saving_ratio == pytest.approx(grouped.stats.saving_ratio)
    assert as_given.processed_tokens > 2.5 * by_group.processed_tokens
    assert in_input_groups.processed_tokens == by_group.processed_tokens  # groups are contiguous


def test_srjf_with_cache_is_deterministic_and_complete():
    lists = shuffled_microbench()
    options = PlanOptions(order="srjf", block_size=16, cache_tokens=3000)
    a = build_plan(requests_from_token_lists(lists), options)
    b = build_plan(requests_from_token_lists(lists), options)
    def rows(plan):
        return [[m.row_id for m in g.members] for g in plan.groups]

    assert rows(a) == rows(b)
    sim = simulate_groups(a.groups, 3000, 16)
    assert sim.processed_tokens == a.stats.processed_tokens
