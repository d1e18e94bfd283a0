"""Where results go while a job is scored: durable parts, and the progress bar.

A `PartSink` takes one worker's results in that worker's group order and flushes whole groups
into parts (by row count, by time, at the end, and when asked to stop). Both executors hand every
result to `record`.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from batchscore.engines.base import RawScores
from batchscore.faults import fault_point
from batchscore.output.parts import Manifest, PartStore
from batchscore.plan.types import PrefixGroup


class PartSink:
    """Buffers one worker's results and writes them as parts.

    `groups` is the worker's whole list; its members, in order, are the worker's positions, and
    scoring resumes at position `first_row` (earlier ones are already in parts), which may lie
    inside a group. A part covers whatever is buffered — whole groups or rows inside one — so a
    stop or a timed flush never waits for a group to end. Side effects: `flush` writes a part
    and updates the manifest.
    """

    def __init__(self, store: PartStore, manifest: Manifest, worker: int, groups: Sequence[PrefixGroup],
                 first_row: int, part_rows: int, part_seconds: float):
        self.store, self.manifest, self.worker = store, manifest, worker
        self.groups = groups
        self.part_rows, self.part_seconds = part_rows, part_seconds
        sizes = getattr(groups, "sizes", None)  # a lazy sequence (run/ranges.StoreGroups) knows them without building
        self.group_ends = np.cumsum(sizes if sizes is not None else [len(g.members) for g in groups], dtype=np.int64)
        self.total = int(self.group_ends[-1]) if len(groups) else 0
        if not 0 <= first_row <= self.total:
            raise ValueError(f"worker {worker}: resume position {first_row} outside its {self.total} rows")
        self.part_start = first_row  # first position of the part being buffered
        self.position = first_row  # next position to arrive
        self.last_flush = time.monotonic()
        self.on_part = None  # called after each part is written (run/live_figures.py refreshes the metrics)
        self._reset()

    def _reset(self) -> None:
        self.row_ids: list[int] = []
        self.logp: list[np.ndarray] = []  # each row's raw total log-probability per option
        self.option_tokens: list[np.ndarray | None] = []  # tokens per option (None: one each)
        self.top_logp: list[float] = []  # the vocabulary's top log-probability at each read position
        self.top_token: list[int] = []  # ...and that token's id (-1: not read)
        self.greedy: list[np.ndarray | None] = []  # per option: the greedy continuation (None: not read)
        self.errors: dict[int, str] = {}

    @property
    def done(self) -> bool:
        return self.position >= self.total

    @property
    def next_group(self) -> int:
        """Index of the group the next result belongs to (len(groups) when done)."""
        return int(np.searchsorted(self.group_ends, self.position, side="right"))

    def remaining_groups(self) -> list[PrefixGroup]:
        """The groups still to score, the first one cut to its members not yet scored."""
        first = self.next_group
        if first >= len(self.groups):
            return []
        group = self.groups[first]
        done_in_group = self.position - (int(self.group_ends[first - 1]) if first else 0)
        if hasattr(self.groups, "from_member"):  # groups built from the token store as they run
            return self.groups.from_member(first, done_in_group)
        head = PrefixGroup(group.prefix, group.members[done_in_group:]) if done_in_group else group
        return [head, *self.groups[first + 1:]]

    def add(self, result: RawScores) -> bool:
        """Buffer one result; returns True when it completed a group."""
        group = self.next_group
        expected = self._expected_row(group)
        if result.row_id != expected:
            raise RuntimeError(f"worker {self.worker}: the engine returned row {result.row_id} where row "
                               f"{expected} was due; refusing to mix rows")
        self.row_ids.append(result.row_id)
        self.logp.append(np.asarray(result.logp, dtype=np.float64))  # stored raw: normalized at assembly
        self.option_tokens.append(result.option_tokens)
        self.top_logp.append(float(result.top_logp))
        self.top_token.append(int(getattr(result, "top_token", -1)))
        self.greedy.append(getattr(result, "greedy", None))
        if result.error:
            self.errors[result.row_id] = result.error
        self.position += 1
        fault_point("result")
        return self.position == int(self.group_ends[group])

    def _expected_row(self, group: int) -> int:
        if group >= len(self.groups):
            raise RuntimeError(f"worker {self.worker}: the engine returned more rows than it was given")
        offset = self.position - (int(self.group_ends[group - 1]) if group else 0)
        if hasattr(self.groups, "row_id"):
            return self.groups.row_id(group, offset)
        return self.groups[group].members[offset].row_id

    def maybe_flush(self) -> None:
        """Flush when the part is big or old enough."""
        if len(self.row_ids) >= self.part_rows or time.monotonic() - self.last_flush >= self.part_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the results buffered so far as one part (nothing if none)."""
        if self.position <= self.part_start:
            return
        self.store.write_part(self.manifest, np.asarray(self.row_ids, dtype=np.int64), self.logp, self.option_tokens,
                              self.errors, start=self.part_start, end=self.position, worker=self.worker,
                              top_logp=self.top_logp, top_token=self.top_token, greedy=self.greedy)
        self.part_start, self.last_flush = self.position, time.monotonic()
        self._reset()
        if self.on_part is not None:
            self.on_part()


class RowProgress:
    """A tqdm bar over the rows this run scores with logical tokens/s (counted per completed
    group); no-op when off. `records`: each of those rows' record, for a task that reads a record
    several times (questions: once per question): the bar then counts records, as the run summary
    does, each when its last row is done.

    The bar shows at once ("loading the engine"); its clock starts with `start()`, when scoring
    begins, so the engine's load never counts as scoring time; the ETA is the remaining count at the
    mean rate since then (smoothing 0: an engine's passes finish rows in bursts, so the last burst's
    rate would swing it)."""

    def __init__(self, total_rows: int, enabled: bool, records: dict[int, int] | None = None):
        self.bar = None
        self.records = records  # row id -> its record, for the rows this run scores (None: rows are records)
        self.left: dict[int, int] = {}  # record -> its rows still to come
        for record in (records or {}).values():
            self.left[record] = self.left.get(record, 0) + 1
        total, unit = (len(self.left), "record") if records is not None else (total_rows, "row")
        if enabled and total:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit=unit, desc="loading the engine", dynamic_ncols=True, smoothing=0,
                            mininterval=0.5)
        self.tokens = 0
        self.started = time.perf_counter()
        self.live = None  # run/live_figures.LiveFigures: the run's figures, counted with or without a bar

    @classmethod
    def for_sinks(cls, sinks: Sequence[PartSink], enabled: bool, record_of: np.ndarray | None = None) -> "RowProgress":
        """The bar of the rows `sinks` still score; `record_of` ([rows] each row's record, or None
        when the rows are the records) makes it count records."""
        total = sum(s.total - s.position for s in sinks)
        if record_of is None or not enabled:
            return cls(total, enabled)
        rows = [m.row_id for s in sinks for g in s.remaining_groups() for m in g.members]
        return cls(total, enabled, {row: int(record_of[row]) for row in rows if row < len(record_of)})

    def start(self) -> None:
        """Scoring begins now: the time before (reading, planning, loading the engine) is not its."""
        self.started = time.perf_counter()
        if self.bar is not None:
            self.bar.set_description_str("scoring", refresh=False)
            self.bar.reset(total=self.bar.total)  # n 0 and the clock from now: the rate and ETA are scoring's

    def row_done(self, row_id: int | None = None) -> None:
        if self.live is not None:
            self.live.row_done(row_id)
        if self.bar is None:
            return
        if self.records is None:
            self.bar.update(1)
            return
        record = self.records.get(row_id)
        if record is not None:
            self.left[record] -= 1
            if self.left[record] == 0:
                self.bar.update(1)

    def group_done(self, group: PrefixGroup) -> None:
        if self.live is not None:
            self.live.group_done(group)
        if self.bar is not None:
            self.tokens += group.logical_tokens
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} logical tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def record(result: RawScores, sink: PartSink, progress: RowProgress) -> bool:
    """Hand one result to its sink and count it; True when it completed a group."""
    progress.row_done(result.row_id)
    if not sink.add(result):
        return False
    progress.group_done(sink.groups[sink.next_group - 1])
    return True
