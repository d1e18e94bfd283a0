"""The run's figures while it scores: rows done and tokens computed so far.

The scoring loop tells `LiveFigures` of every result and every finished group (through
run/sinks.RowProgress) and of every durable part (PartSink); it rewrites the Prometheus file
(`--metrics-prom`, atomically) at most every REFRESH_SECONDS and at each part, so a dashboard
follows a long night (`batchscore_run_in_progress 1`). The same counts end in the run's summary
(`Progress`), an interrupted run's included.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np

from batchscore.output.summary import Progress

log = logging.getLogger("batchscore")

REFRESH_SECONDS = 5.0  # the textfile collector reads the file on each scrape (typically every 15-60 s)


class LiveFigures:
    """Rows done (records: a questions job's record is done when its last read is) and the
    tokens this attempt computed. `write(data)`: where the in-progress figures go (None: nowhere,
    only counted); `base`: what every write says besides them (engine, model, shard, totals)."""

    def __init__(self, rows: int, rows_left: int, *, write: Callable[[dict], None] | None = None,
                 base: dict | None = None, reads_left: np.ndarray | None = None, record_of: np.ndarray | None = None,
                 started: float | None = None, refresh_seconds: float = REFRESH_SECONDS):
        self.rows, self.rows_left = rows, rows_left
        self.write, self.base = write, dict(base or {})
        self.reads_left, self.record_of = reads_left, record_of  # per record, its reads still to score
        self.logical_tokens = self.processed_tokens = 0
        self.started = time.perf_counter() if started is None else started
        self.refresh_seconds = refresh_seconds
        self.last_write = float("-inf")

    @property
    def progress(self) -> Progress:
        return Progress(rows_done=max(self.rows - self.rows_left, 0), logical_tokens_done=self.logical_tokens,
                        processed_tokens_done=self.processed_tokens)

    def row_done(self, row_id: int | None) -> None:
        if self.reads_left is None:
            self.rows_left -= 1
        elif row_id is not None and row_id < len(self.record_of):
            record = self.record_of[row_id]
            self.reads_left[record] -= 1
            if self.reads_left[record] == 0:
                self.rows_left -= 1
        self._refresh()

    def group_done(self, group) -> None:
        self.logical_tokens += group.logical_tokens
        self.processed_tokens += group.processed_tokens

    def part_written(self) -> None:
        self._refresh(now=True)

    def start(self) -> None:
        """Scoring begins: the first in-progress figures go out at once."""
        self._refresh(now=True)

    def _refresh(self, now: bool = False) -> None:
        if self.write is None:
            return
        clock = time.perf_counter()
        if not now and clock - self.last_write < self.refresh_seconds:
            return
        self.last_write = clock
        progress = self.progress
        try:
            self.write({**self.base, "status": "running", "rows": self.rows, "rows_done": progress.rows_done,
                        "logical_tokens_done": progress.logical_tokens_done,
                        "processed_tokens_done": progress.processed_tokens_done, "seconds": clock - self.started})
        except OSError as exc:  # a full or vanished metrics folder must not stop the scoring; the end says so again
            log.warning("in-progress metrics not written (%s); no more refreshes this run", exc)
            self.write = None


def records_left(row_ids: np.ndarray, record_of: np.ndarray, num_records: int) -> np.ndarray:
    """[records] each record's reads among `row_ids` (the reads still to score)."""
    return np.bincount(np.asarray(record_of)[row_ids], minlength=num_records).astype(np.int64)
