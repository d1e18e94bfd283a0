"""PrefillOnly's shortest-remaining-job-first with continuous JCT calibration.

A job's cost is the tokens it would compute now, given what is cached, minus lambda times how
long it has waited: cost = uncached_tokens - lambda * (now - arrival). Calibration recomputes
the uncached tokens after every scheduled job against a simulated prefix cache, so a job that
shares a prefix with what just ran becomes cheap right away and runs before it is evicted.
Plain SRJF (calibrate=False) ranks jobs once, against an empty cache.

`now` is the same for every waiting job, so it drops out of the comparison; ranking by
uncached_tokens + lambda * arrival is the same order. In an offline batch every job arrives
at 0 and only the cache term matters; arrivals matter when input comes in over time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Sequence

from batchscore.plan.cache_sim import PrefixCache


@dataclass
class SrjfJob:
    """One schedulable job (a prefix group, or one request).

    lookup_keys: block keys of the tokens whose cache state decides the cost (the shared
        prefix of a group, the whole prompt of a single request).
    cost_tokens: tokens the job computes when nothing is cached.
    max_cached: most tokens the cache can save (the prefix length; prompt length - 1).
    admit_keys: block keys of each prompt the job runs, in order (cached after it runs).
    """

    lookup_keys: list[int]
    cost_tokens: int
    max_cached: int
    admit_keys: list[list[int]] = field(default_factory=list)
    arrival_s: float = 0.0


def srjf_schedule(
    jobs: Sequence[SrjfJob], cache: PrefixCache, lam: float = 500.0, calibrate: bool = True
) -> list[int]:
    """Job indices in SRJF order; fills `cache` with what the jobs run, in that order.

    Ties go to the lower job index. Only jobs whose lookup blocks were added or evicted are
    re-costed (a lazy heap with a version per job), not every job after every step.
    """
    def priority(j: int) -> float:
        job = jobs[j]
        cached = min(cache.cached_tokens(job.lookup_keys), job.max_cached) if calibrate else 0
        return job.cost_tokens - cached + lam * job.arrival_s

    jobs_with_key: dict[int, list[int]] = {}
    if calibrate:
        for j, job in enumerate(jobs):
            for key in job.lookup_keys:
                jobs_with_key.setdefault(key, []).append(j)

    version = [0] * len(jobs)
    heap = [(priority(j), j, 0) for j in range(len(jobs))]
    heapq.heapify(heap)
    done = [False] * len(jobs)
    order: list[int] = []
    while heap:
        _, j, ver = heapq.heappop(heap)
        if done[j] or ver != version[j]:
            continue  # a stale entry: the job ran, or was re-costed since
        done[j] = True
        order.append(j)
        changed: set[int] = set()
        for keys in jobs[j].admit_keys:
            change = cache.admit(keys)
            for key in change.added + change.evicted:
                changed.update(jobs_with_key.get(key, ()))
        for k in sorted(changed):
            if not done[k]:
                version[k] += 1
                heapq.heappush(heap, (priority(k), k, version[k]))
    return order
