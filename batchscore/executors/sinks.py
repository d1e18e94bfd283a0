"""Where results go while a job is scored: durable parts, and the progress bar.

A `PartSink` takes one worker's results in that worker's group order and flushes whole groups
into parts (by row count, by time, at the end, and when asked to stop). Both executors hand every
result to `record`.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from batchscore.engines.base import LabelScores
from batchscore.io.parts import Manifest, PartStore
from batchscore.plan.types import PrefixGroup


class PartSink:
    """Buffers one worker's results and writes them as parts of whole groups.

    `groups` is the worker's whole list; scoring starts at `first_group` (earlier ones are
    already in parts). Side effects: `flush` writes a part and updates the manifest.
    """

    def __init__(self, store: PartStore, manifest: Manifest, worker: int, groups: Sequence[PrefixGroup],
                 first_group: int, num_labels: int, part_rows: int, part_seconds: float):
        self.store, self.manifest, self.worker = store, manifest, worker
        self.groups = groups
        self.num_labels = num_labels
        self.part_rows, self.part_seconds = part_rows, part_seconds
        self.part_start = first_group  # first group of the part being buffered
        self.next_group = first_group  # the group whose members are arriving
        self.members_left = len(groups[first_group].members) if first_group < len(groups) else 0
        self.last_flush = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self.row_ids: list[int] = []
        self.log_probs: list[np.ndarray] = []
        self.mass: list[float] = []
        self.errors: dict[int, str] = {}

    @property
    def done(self) -> bool:
        return self.next_group >= len(self.groups)

    def add(self, result: LabelScores) -> bool:
        """Buffer one result; returns True when it completed a group (a part may end there)."""
        self.row_ids.append(result.row_id)
        self.log_probs.append(np.asarray(result.log_probs, dtype=np.float64))
        self.mass.append(float(result.label_mass))
        if result.error:
            self.errors[result.row_id] = result.error
        self.members_left -= 1
        completed = False
        while self.members_left <= 0 and not self.done:
            self.next_group += 1
            completed = True
            self.members_left = len(self.groups[self.next_group].members) if not self.done else 0
        return completed

    def maybe_flush(self) -> None:
        """Flush at a group boundary when the part is big or old enough."""
        if len(self.row_ids) >= self.part_rows or time.monotonic() - self.last_flush >= self.part_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the complete groups buffered so far as one part (nothing if none)."""
        if self.next_group <= self.part_start:
            return
        log_probs = np.stack(self.log_probs) if self.log_probs else np.zeros((0, self.num_labels))
        self.store.write_part(self.manifest, np.asarray(self.row_ids, dtype=np.int64), log_probs,
                              np.asarray(self.mass), self.errors, group_start=self.part_start,
                              group_end=self.next_group, worker=self.worker)
        self.part_start, self.last_flush = self.next_group, time.monotonic()
        self._reset()


class RowProgress:
    """A tqdm bar over rows with logical tokens/s (counted per completed group); no-op when off."""

    def __init__(self, total_rows: int, enabled: bool):
        self.bar = None
        if enabled and total_rows:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_rows, unit="row", desc="scoring", dynamic_ncols=True)
        self.tokens = 0
        self.started = time.perf_counter()

    def row_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def group_done(self, group: PrefixGroup) -> None:
        if self.bar is not None:
            self.tokens += group.logical_tokens
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def record(result: LabelScores, sink: PartSink, progress: RowProgress) -> bool:
    """Hand one result to its sink and count it; True when it completed a group."""
    progress.row_done()
    if not sink.add(result):
        return False
    progress.group_done(sink.groups[sink.next_group - 1])
    return True
