"""Placement: the plan's prefix groups spread over W workers with balanced cost.

Pure Python + numpy; never imports torch or vllm. Deterministic: no randomness, every tie is
broken by plan position, so each static shard of a job computes the same placement alone.

Cost is processed tokens (`PrefixGroup.processed_tokens`). The algorithm, after Preble's
"replicate hot prefixes" and longest-processing-time-first (LPT) scheduling:

1. Split only what must be split. A prefixed group stays whole unless it alone exceeds the
   fair share (total cost / W). Replicating a prefix on k workers costs (k - 1) * prefix
   tokens, which raises the mean load, so part counts come from a makespan level M: every
   group above M is cut into the fewest parts of cost <= M. The lowest useful M (the water
   level) is the smallest with total cost, replicas included, <= W * M; the few levels just
   above it where some part count changes are tried too (parts are whole and pack onto whole
   workers), and the level with the smallest predicted makespan wins, preferring fewer
   replicated tokens within 1% of it. A group whose prefix dominates is cut little or not at
   all. A cut group's members are shared out so the parts' costs are even, each part keeping
   the members' plan order.
2. Plain requests (empty-prefix groups) share nothing, so they are dealt one by one: cutting
   them costs nothing and the small ones fill the gaps LPT leaves.
3. LPT: items (whole groups, parts, plain requests) by cost, largest first, each to the least
   loaded worker (ties: lower worker index, then plan position).
4. Each worker runs its groups in plan order, so the planner's ordering policy holds per
   worker; parts of one group that land on one worker are merged back (prefix computed once).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from batchscore.plan.types import PrefixGroup


@dataclass
class WorkerAssignment:
    """What one worker runs: its groups in plan order and their processed tokens."""

    worker: int
    groups: list[PrefixGroup]  # in plan order
    cost: int  # processed tokens


@dataclass
class Placement:
    """Groups spread over workers.

    imbalance: max worker cost / mean worker cost (1.0 when there is no work).
    split_extra_tokens: prefix tokens computed more than once because a group's members sit
        on several workers (sum over groups of prefix_len * (workers holding it - 1)).
    total_processed_tokens: sum of worker costs = plan's processed tokens + split_extra_tokens.
    """

    workers: list[WorkerAssignment]
    imbalance: float
    split_extra_tokens: int
    total_processed_tokens: int


_MAKESPAN_SLACK = 0.01  # accept 1% more makespan for fewer replicated prefix tokens
_MAX_LEVELS = 32  # candidate split levels tried (each costs one LPT pass over the items)


@dataclass(frozen=True)
class _Item:
    """Members (indices, ascending) of plan group `group` placed as one unit, and its cost."""

    cost: int
    group: int
    members: tuple[int, ...]


def place_groups(groups: Sequence[PrefixGroup], num_workers: int) -> Placement:
    """Balance `groups` (plan order) over `num_workers` workers; changes nothing it is given.

    A group is kept on one worker unless it alone exceeds the fair share; it is then split
    into as few parts as balance needs: each part has the same prefix and a subset of the
    members (in their plan order), chosen so the parts' costs are even.
    Groups that are not split are passed through as the same objects.
    """
    _check_workers(num_workers)
    suffix_lens = [[m.work_tokens for m in g.members] for g in groups]
    costs = [g.prefix_len + sum(lens) for g, lens in zip(groups, suffix_lens)]
    if num_workers == 1:
        return _placement_from(groups, [[(0, tuple(range(len(g.members))))] for g in groups], 1)

    base: list[_Item] = []  # items every candidate level shares
    big: list[int] = []  # prefixed groups above the fair share: the only ones ever cut
    fair = -(-sum(costs) // num_workers)
    for index, group in enumerate(groups):
        if group.prefix_len == 0:  # plain requests: dealt one by one, free to separate
            base.extend(_Item(n, index, (i,)) for i, n in enumerate(suffix_lens[index]))
        elif costs[index] > fair:
            big.append(index)
        else:
            base.append(_Item(costs[index], index, tuple(range(len(group.members)))))
    base.sort(key=_lpt_key)

    parts_cache: dict[tuple[int, int], list[_Item]] = {}

    def cut(level: int) -> list[_Item]:
        items: list[_Item] = []
        for g in big:
            k = _part_count(groups[g], costs[g], level, num_workers)
            if (g, k) not in parts_cache:
                lens, prefix_len = suffix_lens[g], groups[g].prefix_len
                parts_cache[g, k] = [
                    _Item(prefix_len + sum(lens[i] for i in part), g, part)
                    for part in _share_out(lens, k)
                ]
            items.extend(parts_cache[g, k])
        return sorted(items, key=_lpt_key)

    best_items: list[_Item] = []
    if big:
        trials = []
        for level in _candidate_levels(groups, costs, big, num_workers):
            items = cut(level)
            makespan = _lpt_makespan(heapq.merge(items, base, key=_lpt_key), num_workers)
            extra = sum(it.cost for it in items) - sum(costs[g] for g in big)
            trials.append((makespan, extra, level, items))
        best = min(t[0] for t in trials)
        # Fewest replicated tokens among the levels within 1% of the best makespan.
        _, _, _, best_items = min(
            (t for t in trials if t[0] <= best * (1 + _MAKESPAN_SLACK)), key=lambda t: t[:3]
        )

    placed: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in groups]
    heap = [(0, w) for w in range(num_workers)]
    for item in heapq.merge(best_items, base, key=_lpt_key):
        load, worker = heapq.heappop(heap)
        placed[item.group].append((worker, item.members))
        heapq.heappush(heap, (load + item.cost, worker))
    return _placement_from(groups, placed, num_workers)


def round_robin_requests(groups: Sequence[PrefixGroup], num_workers: int) -> Placement:
    """Baseline: requests dealt round-robin in row order (sorted row_id), nothing re-planned.

    Request i (by row order) goes to worker i % W; a worker computes a group's prefix once if
    it holds at least one of the group's members, so only per-worker sharing survives.
    Changes nothing it is given.
    """
    _check_workers(num_workers)
    rows = sorted(
        (m.row_id, g, i) for g, group in enumerate(groups) for i, m in enumerate(group.members)
    )
    placed: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in groups]
    for rank, (_, g, i) in enumerate(rows):
        placed[g].append((rank % num_workers, (i,)))
    return _placement_from(groups, placed, num_workers)


def _check_workers(num_workers: int) -> None:
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")


def _part_count(group: PrefixGroup, cost: int, level: int, num_workers: int) -> int:
    """Fewest parts (at most one per member and per worker) so each part costs <= level."""
    if cost <= level:
        return 1
    cap = min(len(group.members), num_workers)
    room = level - group.prefix_len
    if room <= 0:
        return cap
    suffix = cost - group.prefix_len
    return max(1, min(cap, -(-suffix // room)))


def _lpt_key(item: _Item) -> tuple[int, int, int]:
    """LPT order: largest cost first, then plan position (deterministic ties)."""
    return (-item.cost, item.group, item.members[0])


def _lpt_makespan(items, num_workers: int) -> int:
    """Largest worker load when `items` (already in LPT order) go to the least loaded worker."""
    heap = [(0, w) for w in range(num_workers)]
    for item in items:
        load, worker = heap[0]
        heapq.heapreplace(heap, (load + item.cost, worker))
    return max(load for load, _ in heap)


def _candidate_levels(
    groups: Sequence[PrefixGroup], costs: list[int], big: list[int], num_workers: int
) -> list[int]:
    """Makespan levels worth trying: the water level and the nearest levels above it at which
    some big group's part count changes (P + ceil(S / k)), at most _MAX_LEVELS in all.

    Water level M: the smallest makespan such that the total cost with every big group cut
    at M (replicas included) fits in W * M. Below M the replicas alone push the mean above
    M, so no lower level can do better. Above it, part counts are whole numbers and parts
    must pack onto whole workers, so a slightly higher level can pack far better.
    """
    total = sum(costs)

    def fits(level: int) -> bool:
        extra = sum(
            (_part_count(groups[g], costs[g], level, num_workers) - 1) * groups[g].prefix_len
            for g in big
        )
        return total + extra <= num_workers * level

    lo, hi = -(-total // num_workers), max(costs[g] for g in big)  # hi fits: nothing is cut
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    breakpoints = set()
    for g in big:
        prefix_len, suffix = groups[g].prefix_len, costs[g] - groups[g].prefix_len
        for k in range(1, min(len(groups[g].members), num_workers) + 1):
            level = prefix_len + -(-suffix // k)
            if level <= lo:
                break
            breakpoints.add(level)
    return [lo] + sorted(breakpoints)[: _MAX_LEVELS - 1]


def _share_out(lens: list[int], parts: int) -> list[tuple[int, ...]]:
    """Member indices shared out into `parts` non-empty subsets of near-equal suffix tokens.

    LPT over the members (longest first, each to the lightest part; ties by index), so the
    heaviest part exceeds sum/parts by less than one member. Subsets come back ascending
    (plan order kept inside each part), ordered by their first member.
    """
    parts = max(1, min(parts, len(lens)))
    heap = [(0, 0, p) for p in range(parts)]  # (load, members, part): equal loads go to the emptier part
    chosen: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        load, count, p = heapq.heappop(heap)
        chosen[p].append(i)
        heapq.heappush(heap, (load + lens[i], count + 1, p))
    return sorted(tuple(sorted(c)) for c in chosen)


def _placement_from(
    groups: Sequence[PrefixGroup],
    placed: list[list[tuple[int, tuple[int, ...]]]],
    num_workers: int,
) -> Placement:
    """Build the workers' group lists (plan order) from where each group's members went.

    `placed[g]` lists (worker, member indices) pairs. A worker's members of one group form one
    PrefixGroup, members in plan order; a group wholly on one worker is passed through as the
    same object.
    """
    worker_groups: list[list[PrefixGroup]] = [[] for _ in range(num_workers)]
    extra = 0
    for g, group in enumerate(groups):
        holders: dict[int, list[int]] = {}
        for worker, members in placed[g]:
            holders.setdefault(worker, []).extend(members)
        extra += group.prefix_len * max(len(holders) - 1, 0)
        for worker in sorted(holders):
            indices = sorted(holders[worker])
            if len(indices) == len(group.members):
                worker_groups[worker].append(group)
            else:
                worker_groups[worker].append(
                    PrefixGroup(group.prefix, [group.members[i] for i in indices])
                )
    workers = [
        WorkerAssignment(w, gs, sum(x.processed_tokens for x in gs))
        for w, gs in enumerate(worker_groups)
    ]
    total = sum(w.cost for w in workers)
    mean = total / num_workers
    imbalance = max(w.cost for w in workers) / mean if total else 1.0
    return Placement(workers, imbalance, extra, total)
