"""Workers that read their own rows: the metadata plan (plan/metadata.py) shared out over W
workers, each share a lazy sequence of `PrefixGroup`s materialized from the token store (store/)
just before they run.

`place_shares` spreads the plan's groups over W workers exactly as plan/placement.place_groups
spreads materialized groups (LPT on processed tokens; a document's questions stay together unless
their group alone exceeds the fair share), on the plan's arrays: each worker's share is a small
plan of its own over the same store positions. Keeping that placement keeps each worker's
forward passes, so a Ray run's scores are the ones it gave before the store (a row's low bits
depend on the rows it shares a pass with). `cut_ranges` cuts the plan into W contiguous ranges of
about equal processed tokens (`bench scale --plan-only` reports them). `StoreGroups` is one
worker's groups: group indices into a plan, their sizes and row ids as arrays, and a
`PrefixGroup` built only when indexed or iterated — what the parts sink and the engine read, so
the run holds the plan's few integers per row, never a Python object per row. A worker on another
machine needs only the store's folder (a shared file system) and its share.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from batchscore.plan.metadata import MetaPlan
from batchscore.plan.types import PrefixGroup
from batchscore.store.tokens import TokenStore


def cut_ranges(meta: MetaPlan, workers: int) -> list[tuple[int, int]]:
    """[(first group, end group)] for each of `workers` workers: contiguous, whole groups, cut where
    the cumulative processed tokens cross each k/W of the total (empty ranges when there are fewer
    groups than workers)."""
    cost = np.cumsum(np.asarray(meta.group_tokens, dtype=np.int64))
    total = int(cost[-1]) if len(cost) else 0
    cuts = np.searchsorted(cost, total * np.arange(1, workers) / workers, side="right") if total else \
        np.full(workers - 1, len(cost))
    bounds = np.concatenate(([0], np.minimum(cuts, len(cost)), [len(cost)])).astype(np.int64)
    bounds = np.maximum.accumulate(bounds)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


class StoreGroups(Sequence[PrefixGroup]):
    """Groups `indices` of `meta` (in run order), materialized from `store` when read; the first
    one may start `skip` members in (a resume inside a group)."""

    def __init__(self, meta: MetaPlan, store: TokenStore, indices: np.ndarray, skip: int = 0,
                 last: dict | None = None):
        self.meta, self.store = meta, store
        self._last = last if last is not None else {}  # the group built last, shared by slices: read twice, built once
        self.indices = np.asarray(indices, dtype=np.int64)
        self.skip = skip
        self.sizes = meta.starts[self.indices + 1] - meta.starts[self.indices]  # [G] members per group
        if skip and len(self.sizes):
            self.sizes = self.sizes.copy()
            self.sizes[0] -= skip

    @classmethod
    def range(cls, meta: MetaPlan, store: TokenStore, first: int, end: int) -> "StoreGroups":
        return cls(meta, store, np.arange(first, end, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, _, _ = index.indices(len(self))
            return StoreGroups(self.meta, self.store, self.indices[index], self.skip if start == 0 else 0, self._last)
        index = range(len(self))[index]
        key = (int(self.indices[index]), self.skip if index == 0 else 0)
        if key not in self._last:
            group = self.meta.materialize(key[0], self.store)
            self._last.clear()
            self._last[key] = PrefixGroup(group.prefix, group.members[key[1]:]) if key[1] else group
        return self._last[key]

    def __iter__(self) -> Iterator[PrefixGroup]:
        return (self[i] for i in range(len(self)))

    def row_id(self, group: int, offset: int) -> int:
        """The input row of member `offset` of group `group` (without building the group)."""
        start = int(self.meta.starts[self.indices[group]]) + offset + (self.skip if group == 0 else 0)
        return int(self.store.row_ids[self.meta.rows[start]])

    def from_member(self, group: int, skip: int) -> "StoreGroups":
        """Groups `group`.. with the first one's first `skip` members left out."""
        rest = self[group:]
        return StoreGroups(self.meta, self.store, rest.indices, rest.skip + skip, self._last)

    def work_tokens(self) -> int:
        """The tokens these groups compute, from the plan's per-group counts (a resume inside the
        first group counts it whole: an upper bound by at most one group)."""
        return int(np.asarray(self.meta.group_tokens, dtype=np.int64)[self.indices].sum())

    def largest_pass(self, skip: frozenset[int] = frozenset()) -> PrefixGroup | None:
        """plan/order.largest_pass over the plan's arrays: the longest prompt as a group of one
        (ties: the earlier; rows in `skip` passed over); only its group is built."""
        if not len(self):
            return None
        positions = self._positions()
        lengths = np.asarray(self.store.flat.lengths)[positions]
        if skip:
            lengths = np.where(np.isin(np.asarray(self.store.row_ids)[positions], list(skip)), -1, lengths)
        best = int(np.argmax(lengths))
        if lengths[best] < 0:
            return None
        group = int(np.searchsorted(np.cumsum(self.sizes), best, side="right"))
        offset = best - (int(np.sum(self.sizes[:group])))
        built = self[group]
        return PrefixGroup(built.prefix, [built.members[offset]])

    def _positions(self) -> np.ndarray:
        """Every store position of these groups, in run order (a few bytes a row)."""
        starts = self.meta.starts[self.indices] + np.r_[self.skip, np.zeros(len(self) - 1, dtype=np.int64)]
        before = np.concatenate(([0], np.cumsum(self.sizes)[:-1]))  # members of the earlier groups
        index = np.repeat(starts - before, self.sizes) + np.arange(self.sizes.sum())
        return self.meta.rows[index]


def member_work(meta: MetaPlan, source, group_of: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([N] each plan slot's `GroupMember.work_tokens`: its tokens past its group's prefix plus its
    option rows, [N] the tokens past the prefix alone), int32, from the plan's and store's arrays."""
    if group_of is None:
        group_of = _group_of(meta)
    lengths = np.asarray(source.flat.lengths)  # a [N] diff of the offsets, dropped on return
    suffix = (lengths[meta.rows] - np.asarray(meta.prefix_lens)[group_of]).astype(np.int32)
    del lengths
    extra = getattr(source, "option_extra_rows", None)
    if extra is not None:
        return suffix + extra()[meta.rows].astype(np.int32), suffix
    extras = (0 if o is None else o.extra_rows for o in map(source.options_at, meta.rows.tolist()))
    return suffix + np.fromiter(extras, dtype=np.int32, count=len(meta.rows)), suffix


def _group_of(meta: MetaPlan) -> np.ndarray:
    """[N] each plan slot's group (int32 while the groups fit: 4 bytes a row)."""
    dtype = np.int32 if len(meta) < 2**31 else np.int64
    return np.repeat(np.arange(len(meta), dtype=dtype), np.diff(meta.starts))


def place_shares(meta: MetaPlan, source, workers: int) -> tuple[list[MetaPlan], int]:
    """The plan's groups spread over `workers` exactly as plan/placement.place_groups spreads the
    materialized groups (LPT on processed tokens; a group is cut only when it alone exceeds the
    fair share), computed on the plan's arrays: ([each worker's share as a plan over the same
    store positions], prefix tokens computed more than once). A worker's forward passes — and so
    its rows' bits — are the ones `place_groups` gives it. Holds ~20 bytes a row while it runs."""
    group_of = _group_of(meta)
    work, suffix = member_work(meta, source, group_of)
    slot_worker = _place_slots(meta, work, workers, group_of)
    del work
    shares = [_share(meta, suffix, group_of, slot_worker, w) for w in range(workers)]
    return shares, _replicated(meta, slot_worker)


def _place_slots(meta: MetaPlan, work: np.ndarray, workers: int, group_of: np.ndarray) -> np.ndarray:
    """[N] the worker of each plan slot. Whole groups and plain rows are dealt on arrays (one
    heap step per item); a group larger than the fair share goes through place_groups itself
    (over stand-ins holding no tokens), which picks how to cut it."""
    n, count = len(meta.rows), len(meta)
    if workers < 1:
        raise ValueError(f"num_workers must be an int >= 1, got {workers!r}")
    if workers == 1 or n == 0:
        return np.zeros(n, dtype=np.int32)
    costs = np.asarray(meta.prefix_lens, dtype=np.int64) + np.bincount(group_of, weights=work, minlength=count).astype(np.int64)
    fair = -(-int(costs.sum()) // workers)
    plain = np.asarray(meta.prefix_lens) == 0
    if ((~plain) & (costs > fair)).any():
        return _place_slots_by_groups(meta, work, workers)
    # items: every row of a plain group alone, every prefixed group whole (placement.py's `base`)
    plain_slots = np.flatnonzero(plain[group_of]) if plain.any() else np.zeros(0, np.int64)
    whole = np.flatnonzero(~plain)
    item_cost = np.concatenate((work[plain_slots].astype(np.int64), costs[whole]))
    item_group = np.concatenate((group_of[plain_slots], whole))
    item_member = np.concatenate((plain_slots - meta.starts[group_of[plain_slots]], np.zeros(len(whole), np.int64)))
    lpt = np.lexsort((item_member, item_group, -item_cost))  # largest first; ties by plan position
    del item_group, item_member
    item_worker = np.empty(len(lpt), dtype=np.int32)
    item_worker[lpt] = _lpt(item_cost[lpt], workers)
    del lpt, item_cost
    group_worker = np.zeros(count, dtype=np.int32)
    group_worker[whole] = item_worker[len(plain_slots):]
    slot_worker = group_worker[group_of]
    slot_worker[plain_slots] = item_worker[: len(plain_slots)]
    return slot_worker


def _lpt(costs: np.ndarray, workers: int, chunk: int = 1 << 16) -> np.ndarray:
    """Each item (in LPT order) to the least loaded worker, ties to the lower index."""
    import heapq

    heap = [(0, w) for w in range(workers)]
    out = np.empty(len(costs), dtype=np.int32)
    for lo in range(0, len(costs), chunk):
        picked = []
        for cost in costs[lo : lo + chunk].tolist():
            load, worker = heap[0]
            heapq.heapreplace(heap, (load + cost, worker))
            picked.append(worker)
        out[lo : lo + len(picked)] = picked
    return out


class _Member:
    """A group member as placement.py reads it: its cost, and the plan slot it stands for."""

    __slots__ = ("slot", "work_tokens")

    def __init__(self, slot: int, work_tokens: int):
        self.slot, self.work_tokens = slot, work_tokens


class _Shape:
    """A plan group as placement.py reads it (its prefix length and members' costs), no tokens."""

    def __init__(self, prefix_len: int, members: list[_Member]):
        self.prefix_len, self.members = prefix_len, members

    @property
    def prefix(self) -> np.ndarray:  # a cut group's parts are PrefixGroups: only the length is read
        return np.zeros(self.prefix_len, dtype=np.int32)

    @property
    def processed_tokens(self) -> int:
        return self.prefix_len + sum(m.work_tokens for m in self.members)


def _place_slots_by_groups(meta: MetaPlan, work: np.ndarray, workers: int) -> np.ndarray:
    """_place_slots through place_groups itself (a Python object per row: the rare plan with a
    group above the fair share, where placement.py's choice of cuts must be reproduced)."""
    from batchscore.plan.placement import place_groups

    work_list = work.tolist()
    shapes = [_Shape(int(meta.prefix_lens[g]), [_Member(s, work_list[s]) for s in range(a, b)])
              for g, (a, b) in enumerate(zip(meta.starts[:-1].tolist(), meta.starts[1:].tolist()))]
    slot_worker = np.empty(len(meta.rows), dtype=np.int32)
    for assignment in place_groups(shapes, workers).workers:
        for group in assignment.groups:
            slot_worker[[m.slot for m in group.members]] = assignment.worker
    return slot_worker


def _share(meta: MetaPlan, suffix: np.ndarray, group_of: np.ndarray, slot_worker: np.ndarray, worker: int) -> MetaPlan:
    """Worker `worker`'s slots as a plan of their own: its groups in plan order, a cut group's
    members in plan order (positions into the same store); `suffix`: each slot's tokens past its
    group's prefix (a share's group_tokens count them as the plan's do)."""
    slots = np.flatnonzero(slot_worker == worker)
    mine = group_of[slots]
    opens = np.flatnonzero(np.r_[True, mine[1:] != mine[:-1]]) if len(slots) else np.zeros(0, np.int64)
    prefix_lens = np.asarray(meta.prefix_lens, dtype=np.int64)[mine[opens]]
    starts = np.r_[opens, len(slots)].astype(np.int64)
    suffix_tokens = np.add.reduceat(suffix[slots].astype(np.int64), opens) if len(slots) else np.zeros(0, np.int64)
    return MetaPlan(np.asarray(meta.rows)[slots], starts, prefix_lens, prefix_lens + suffix_tokens, meta.stats)


def _replicated(meta: MetaPlan, slot_worker: np.ndarray) -> int:
    """Prefix tokens computed more than once: a group's prefix once more for each extra worker
    holding part of it (only a cut group's slots are looked at)."""
    if len(slot_worker) == 0:
        return 0
    first = meta.starts[:-1]
    cut = np.flatnonzero(np.minimum.reduceat(slot_worker, first) != np.maximum.reduceat(slot_worker, first))
    return sum(int(meta.prefix_lens[g]) * (len(np.unique(slot_worker[meta.starts[g]:meta.starts[g + 1]])) - 1)
               for g in cut.tolist())


def audit_sample(job, store: TokenStore, plan: MetaPlan, rows: int = 4096):
    """(`job` with `rows` positions' requests read back from the store (seeded by
    `output.audit_seed`), {row id: its group in `plan`}): what the exactness audit picks its rows
    from (the run keeps no request list), spread over the plan's groups."""
    from dataclasses import replace

    count = min(rows, store.num_rows)
    rng = np.random.default_rng(job.config.output.audit_seed)
    positions = np.sort(rng.choice(store.num_rows, size=count, replace=False)) if count else np.zeros(0, np.int64)
    slots = np.flatnonzero(np.isin(plan.rows, positions))  # the plan holds every store position once
    groups = np.searchsorted(plan.starts, slots, side="right") - 1
    group_of = dict(zip(np.asarray(store.row_ids)[plan.rows[slots]].tolist(), groups.tolist()))
    requests = store.requests(int(p) for p in positions)
    return replace(job, input=replace(job.input, requests=requests)), group_of
