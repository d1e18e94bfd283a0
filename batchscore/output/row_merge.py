"""The parts merged into row order window by window, so assembling an output never holds every
row's results at once.

Parts hold rows in plan order (any row ids, output/parts.py). `row_windows` reads every part
once. When the job fits one window (`WINDOW_ROWS`), that is all: the window is every row, as
`PartStore.read_results` gives it. Otherwise each part's rows are distributed by row id into one
spill file per window (Parquet, in a temporary folder: `TMPDIR`), and the windows are read back
one at a time, in row order: memory is one window's results, whatever the job's size; the disk
holds the results once more (a few tens of bytes a row). Every window keeps the parts' guarantee:
a row with two results (overlapping parts, or a part that scored a row refused before scoring)
raises — exactly once, or not at all.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.output.parts import Manifest, PartStore
from batchscore.output.raw_scores import RowScores

WINDOW_ROWS = 1_000_000  # rows per window: ~100 MB of results and output columns at a time

_COLUMNS = pa.schema([("row_id", pa.int64()), ("logp", pa.list_(pa.float64())), ("option_tokens", pa.list_(pa.int32())),
                      ("error", pa.string()), ("top_logp", pa.float64()), ("top_token", pa.int64()),
                      ("greedy", pa.list_(pa.bool_()))])


@dataclass
class Window:
    """Rows [start, end) of the job: their raw scores (null where no part holds the row; index i
    is row start + i) and the rows not scored among them (row id -> reason)."""

    start: int
    end: int
    scores: RowScores
    errors: dict[int, str]

    @property
    def rows(self) -> int:
        return self.end - self.start


def row_windows(store: PartStore, manifests: list[Manifest], num_rows: int,
                window_rows: int = WINDOW_ROWS) -> Iterator[Window]:
    """Every row's results, in row order, `window_rows` rows at a time (see the module docstring).
    Raises RuntimeError when a part's row count is not its manifest's, or a row has two results."""
    window_rows = max(1, window_rows)
    count = max(1, -(-num_rows // window_rows))
    if count == 1:
        yield _window(pa.concat_tables([_COLUMNS.empty_table(), *_result_tables(store, manifests)]), 0, num_rows,
                      store.folder)
        return
    with tempfile.TemporaryDirectory(prefix="batchscore-merge-") as tmp:
        paths = [Path(tmp) / f"window-{i:05d}.parquet" for i in range(count)]
        writers = [pq.ParquetWriter(p, _COLUMNS) for p in paths]
        try:
            for table in _result_tables(store, manifests):
                which = table.column("row_id").to_numpy() // window_rows
                order = np.argsort(which, kind="stable")
                bounds = np.searchsorted(which[order], np.arange(count + 1))
                for i in np.flatnonzero(np.diff(bounds)):
                    writers[i].write_table(table.take(order[bounds[i]:bounds[i + 1]]))
        finally:
            for writer in writers:
                writer.close()
        for i, path in enumerate(paths):
            start = i * window_rows
            window = _window(pq.read_table(path), start, min(start + window_rows, num_rows), store.folder)
            path.unlink()
            yield window


def _result_tables(store: PartStore, manifests: list[Manifest]) -> Iterator[pa.Table]:
    """The rows refused before scoring (no scores), then every part, as tables of `_COLUMNS`."""
    for name in {m.input_errors_file for m in manifests if m.input_errors_file}:
        refused = _read(store.folder / name)
        n = refused.num_rows
        yield pa.table([refused.column("row_id"), pa.nulls(n, _COLUMNS.field("logp").type),
                        pa.nulls(n, _COLUMNS.field("option_tokens").type), refused.column("error"),
                        pa.nulls(n, pa.float64()), pa.nulls(n, pa.int64()), pa.nulls(n, _COLUMNS.field("greedy").type)],
                       schema=_COLUMNS)
    carried = [(m.carried_file, None) for m in manifests if m.carried_file]
    for file, expected in carried + [(p.file, p.rows) for m in manifests for p in m.parts]:
        table = _read(store.folder / file)
        if expected is not None and table.num_rows != expected:
            raise RuntimeError(f"{file} holds {table.num_rows} rows, its manifest says {expected}")
        if "top_token" not in table.column_names:  # parts from before the column
            table = table.append_column("top_token", pa.array(np.full(table.num_rows, -1), type=pa.int64()))
        if "greedy" not in table.column_names:
            table = table.append_column("greedy", pa.nulls(table.num_rows, _COLUMNS.field("greedy").type))
        yield table.select(_COLUMNS.names).cast(_COLUMNS)


def _read(path) -> pa.Table:
    with path.open("rb") as handle:  # a local file or an object in a store (io/storage.py)
        return pq.read_table(handle)


def _window(table: pa.Table, start: int, end: int, folder) -> Window:
    """The window's results in row order, after checking no row has two."""
    rows = table.column("row_id").to_numpy() - start
    seen = np.bincount(rows, minlength=end - start)
    twice = np.flatnonzero(seen > 1)
    if twice.size:
        raise RuntimeError(f"rows {(twice[:5] + start).tolist()} have more than one result in {folder}; "
                           "refusing to write an output that could mix them (rerun with --fresh)")
    error = table.column("error")
    has_error = np.flatnonzero(error.is_valid().to_numpy(zero_copy_only=False))
    errors = dict(zip((rows[has_error] + start).tolist(), error.take(has_error).to_pylist()))
    scored = np.flatnonzero(table.column("logp").is_valid().to_numpy(zero_copy_only=False))  # not refused rows
    position = np.full(end - start, -1, dtype=np.int64)
    position[rows[scored]] = scored
    take = pa.array(position, mask=position < 0)

    def column(name):
        return table.column(name).combine_chunks().take(take)

    return Window(start, end, RowScores(column("logp"), column("option_tokens"), column("top_logp"),
                                        column("top_token"), column("greedy")), errors)
