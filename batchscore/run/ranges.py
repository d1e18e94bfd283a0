"""Workers that read their own rows: the metadata plan (plan/metadata.py) cut into W ranges of
whole groups, each a lazy sequence of `PrefixGroup`s materialized from the token store (store/)
just before they run.

`cut_ranges` cuts the groups, in plan order, into W contiguous ranges of about equal processed
tokens (a group is never cut: a document's questions stay together, and no prefix is computed
twice). `StoreGroups` is one worker's share: group indices into the plan, their sizes and row ids
as arrays, and a `PrefixGroup` built only when indexed or iterated — what the parts sink and the
engine read, so the run holds the plan's few integers per row, never a Python object per row.
A worker on another machine needs only the store's folder (a shared file system) and its range.
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


def reads_from_store(source, shard, files) -> bool:
    """Whether the run scores from a token store and a metadata plan (workers read their rows)
    rather than a list of requests: a labels job written window by window (run/assemble.py), run
    in this process, planned by a policy the metadata plan has, into a local output folder."""
    from batchscore.io.storage import is_url
    from batchscore.plan.metadata import METADATA_POLICIES
    from batchscore.run.assemble import windowed_output

    config = source.config
    return (shard is None and config.executor.kind != "ray" and config.input.synthetic is None
            and config.plan.order in METADATA_POLICIES and not is_url(str(files.output))
            and source.task.name == "labels" and windowed_output(config))


def audit_sample(job, store: TokenStore, rows: int = 4096):
    """`job` with `rows` positions' requests read back from the store (seeded by
    `output.audit_seed`): what the exactness audit picks its rows from (the store path keeps no
    request list)."""
    from dataclasses import replace

    count = min(rows, store.num_rows)
    rng = np.random.default_rng(job.config.output.audit_seed)
    positions = np.sort(rng.choice(store.num_rows, size=count, replace=False)) if count else []
    return replace(job, input=replace(job.input, requests=store.requests(int(p) for p in positions)))
