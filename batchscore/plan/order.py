"""Ordering policies: the execution order of units (shared groups and flattened requests).

- `r_group` (BatchLLM Eq. 3): R_group = 1 / (L_prefix + sum L_distinct), larger first, i.e.
  fewest processed tokens first; ties go to the unit whose first input row comes first.
- `input`: as given, each unit at its first member's input position (a baseline).
- `srjf` (PrefillOnly): shortest remaining job first, re-costed against a simulated prefix
  cache after every scheduled unit (see srjf.py).
A group's members always stay together; only whole units move.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from batchscore.plan.cache_sim import PrefixCache, block_keys
from batchscore.plan.groups import Unit
from batchscore.plan.srjf import SrjfJob, srjf_schedule
from batchscore.plan.tree import TokenTable
from batchscore.plan.types import PrefixGroup

POLICIES = ("r_group", "input", "srjf")


def r_group_order(units: Sequence[Unit]) -> list[int]:
    """Unit indices by R_group, larger first (deterministic tie-break: first input row)."""
    cost = np.fromiter((u.processed_tokens for u in units), dtype=np.int64, count=len(units))
    return np.lexsort((_first_rows(units), cost)).tolist()


def input_order(units: Sequence[Unit]) -> list[int]:
    """Unit indices by their first member's input position."""
    return np.argsort(_first_rows(units), kind="stable").tolist()


def _first_rows(units: Sequence[Unit]) -> np.ndarray:
    return np.fromiter((u.first_row for u in units), dtype=np.int64, count=len(units))


def srjf_order(
    units: Sequence[Unit],
    table: TokenTable,
    lam: float,
    cache_tokens: int | None,
    block_size: int,
) -> list[int]:
    """Unit indices in calibrated SRJF order against a fresh simulated cache.

    Planning cost grows with the KV blocks of every prompt: use a block size like vLLM's 16.
    """
    jobs = []
    for unit in units:
        prompts = [block_keys(table.sequence(r), block_size) for r in unit.rows]
        if unit.shared:
            lookup = prompts[0][: unit.prefix_len // block_size]
            max_cached = unit.prefix_len
        else:
            lookup = prompts[0]
            max_cached = int(table.lengths[unit.rows[0]]) - 1
        jobs.append(SrjfJob(lookup, unit.processed_tokens, max_cached, prompts))
    return srjf_schedule(jobs, PrefixCache(cache_tokens, block_size), lam)


def order_units(
    units: Sequence[Unit],
    policy: str,
    table: TokenTable,
    lam: float = 500.0,
    cache_tokens: int | None = None,
    block_size: int = 1,
) -> list[int]:
    """Unit indices in execution order under `policy`; changes nothing it is given."""
    if policy == "r_group":
        return r_group_order(units)
    if policy == "input":
        return input_order(units)
    if policy == "srjf":
        return srjf_order(units, table, lam, cache_tokens, block_size)
    raise ValueError(f"unknown order policy {policy!r}; expected one of {POLICIES}")


def largest_pass(groups: Sequence[PrefixGroup], skip: frozenset[int] = frozenset()) -> PrefixGroup | None:
    """The pass needing the most memory, to run first and alone so a job that cannot fit fails in
    its first minute, not its last hour (lm-evaluation-harness runs its longest requests first for
    the same reason): the longest prompt (a group's prefix and its member with the most work) as a
    group of one. Rows in `skip` (refused already) are passed over; ties: the earlier. None: no row."""
    best, best_len = None, -1
    for group in groups:
        for member in group.members:
            length = group.prefix_len + member.work_tokens
            if length > best_len and member.row_id not in skip:
                best, best_len = (group, member), length
    return None if best is None else PrefixGroup(best[0].prefix, [best[1]])
