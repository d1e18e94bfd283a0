"""build_plan: requests in, ordered prefix groups and saving statistics out.

Pipeline: validate → compact prefix tree → first-level enlargement DP → groups worth sharing
(block-aligned, small ones flattened) → ordering policy → PrefixGroups. Flattened requests
that end up next to each other are merged into one empty-prefix group so an engine can batch
them.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from typing import Sequence

from batchscore.plan.enlarge import enlarge, plain_first_level
from batchscore.plan.groups import (
    SharingRule,
    Unit,
    flat_group,
    make_units,
    saved_tokens,
    to_prefix_group,
)
from batchscore.plan.options import option_token_counts
from batchscore.plan.order import POLICIES, order_units
from batchscore.plan.tree import TokenTable, build_tree
from batchscore.plan.types import PrefixGroup, Request
from batchscore.plan.validate import checked_table


@dataclass
class PlanOptions:
    """How to plan. See the module docstrings of enlarge.py, groups.py and order.py."""

    min_prefix_tokens: int = 16  # a shared prefix shorter than this is not worth a group
    block_size: int = 1  # align each shared prefix down to a multiple of this (vLLM: 16)
    order: str = "r_group"  # "r_group" | "input" | "srjf"
    enlarge: bool = True  # run BatchLLM's first-level enlargement DP
    srjf_lambda: float = 500.0
    cache_tokens: int | None = None  # simulated KV cache capacity for srjf (None = unbounded)

    def __post_init__(self) -> None:
        if self.order not in POLICIES:
            raise ValueError(f"order must be one of {POLICIES}, got {self.order!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.min_prefix_tokens < 0:
            raise ValueError(f"min_prefix_tokens must be >= 0, got {self.min_prefix_tokens}")
        if self.cache_tokens is not None and self.cache_tokens < 0:
            raise ValueError(f"cache_tokens must be >= 0 or None, got {self.cache_tokens}")


@dataclass
class PlanStats:
    """Token counts and saving ratios (BatchLLM Eq. 1) of a plan.

    With options scored per row (multi-token labels, choices), logical tokens count every
    multi-token option as its own prompt and processed tokens add each option's tokens once
    (`option_tokens` of them: n - 1 per option of n tokens), so the ratios cover all three levels.

    saving_ratio: the plan as emitted (enlarged if enabled, block-aligned, flattened).
    first_level_saving_ratio: plain first-level groups, no enlargement, same rules.
    unaligned_saving_ratio: the plan's groups if prefixes were not aligned to blocks.
    multilevel_saving_ratio: upper bound, every shared tree node computed once.
    plan_seconds: wall time of tree + DP + grouping + ordering (validation excluded).
    plan_cpu_seconds: the same span in CPU time of this process (steadier on a busy machine).
    """

    num_requests: int
    num_groups: int
    logical_tokens: int
    processed_tokens: int
    saving_ratio: float
    first_level_saving_ratio: float
    unaligned_saving_ratio: float
    multilevel_saving_ratio: float
    plan_seconds: float
    plan_cpu_seconds: float = 0.0
    option_tokens: int = 0  # option positions computed (included in processed_tokens)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    """Prefix groups in execution order (members of a group are contiguous) and their stats."""

    groups: list[PrefixGroup]
    stats: PlanStats


def build_plan(requests: Sequence[Request], options: PlanOptions = PlanOptions()) -> Plan:
    """Plan `requests` (each exactly once); changes nothing it is given.

    Raises PlanInputError naming the row for an empty prompt, a negative token id or a
    repeated row id. The plan is deterministic for a given input and options. Pauses the
    cyclic garbage collector while planning (restored before returning).
    """
    table = checked_table(requests)
    row_ids = [r.row_id for r in requests]
    row_options = [r.options for r in requests]
    if all(o is None for o in row_options):
        row_options = None

    if not requests:
        return Plan([], _stats(0, 0, 0, 0, 0, 0, 0, 0.0))
    # Why: planning allocates ~10 objects per request and frees none until it returns; the
    # cyclic GC would rescan every live object again and again (superlinear on big batches).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan(table, row_ids, options, row_options)
    finally:
        if gc_was_enabled:
            gc.enable()


def _plan(table: TokenTable, row_ids: list[int], options: PlanOptions, row_options: list | None = None) -> Plan:
    """build_plan after validation; `row_options` are the requests' options (None: none has any)."""
    logical = int(table.lengths.sum())
    started = time.perf_counter()
    cpu_started = time.process_time()
    tree = build_tree(table)
    plain = plain_first_level(tree)
    shape = enlarge(tree, options.block_size) if options.enlarge else plain
    rule = SharingRule(options.min_prefix_tokens, options.block_size)
    keep_input_order = options.order == "input"
    units = make_units(tree, shape, rule, shortest_first=not keep_input_order)
    order = order_units(
        units, options.order, table, options.srjf_lambda, options.cache_tokens, options.block_size
    )
    groups = _materialize(units, order, table, row_ids, keep_input_order, row_options)
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started

    unaligned = SharingRule(options.min_prefix_tokens, block_size=1)
    stats = _stats(
        len(row_ids),
        len(groups),
        logical,
        saved=saved_tokens(tree, shape, rule),
        saved_plain=saved_tokens(tree, plain, rule),
        saved_unaligned=saved_tokens(tree, shape, unaligned),
        saved_multilevel=logical - tree.stored_tokens(),
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        options=option_token_counts(row_options, table.lengths.tolist()) if row_options else (0, 0),
    )
    return Plan(groups, stats)


def _materialize(
    units: list[Unit],
    order: list[int],
    table: TokenTable,
    row_ids: list[int],
    keep_input_order: bool,
    row_options: list | None = None,
) -> list[PrefixGroup]:
    """PrefixGroups in `order`; consecutive flattened requests merge into one group.

    A merged run of plain requests runs shortest first (then by input position) so engine
    batches are even, except under the `input` policy, which keeps input positions as the
    baseline it models. Shared units keep the member order make_units gave them.
    """
    lengths = table.lengths.tolist()

    def flush(run: list[int]) -> None:
        rows = sorted(run) if keep_input_order else sorted(run, key=lambda r: (lengths[r], r))
        groups.append(flat_group(rows, table, row_ids, row_options))

    groups: list[PrefixGroup] = []
    flat_run: list[int] = []
    for u in order:
        unit = units[u]
        if not unit.shared:
            flat_run.append(unit.rows[0])
            continue
        if flat_run:
            flush(flat_run)
            flat_run = []
        groups.append(to_prefix_group(unit, table, row_ids, row_options))
    if flat_run:
        flush(flat_run)
    return groups


def _stats(
    num_requests: int,
    num_groups: int,
    logical: int,
    saved: int,
    saved_plain: int,
    saved_unaligned: int,
    saved_multilevel: int,
    seconds: float,
    cpu_seconds: float = 0.0,
    options: tuple[int, int] = (0, 0),
) -> PlanStats:
    """`options`: (tokens plain forwards add for the rows' options, option rows computed)."""
    option_plain, option_rows = options
    option_saved = option_plain - option_rows
    logical += option_plain

    def ratio(tokens_saved: int) -> float:
        return (tokens_saved + option_saved) / logical if logical else 0.0

    return PlanStats(
        num_requests=num_requests,
        num_groups=num_groups,
        logical_tokens=logical,
        processed_tokens=logical - saved - option_saved,
        saving_ratio=ratio(saved),
        first_level_saving_ratio=ratio(saved_plain),
        unaligned_saving_ratio=ratio(saved_unaligned),
        multilevel_saving_ratio=ratio(saved_multilevel),
        plan_seconds=seconds,
        plan_cpu_seconds=cpu_seconds,
        option_tokens=option_rows,
    )
