"""The Parquet result writer: one row per input row, written atomically.

The file appears at its final path only when complete (written under a temporary name in the
same folder, then renamed), so a reader never sees a partial output.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.io.atomic import atomic_write
from batchscore.prompts import label_column


def output_columns(labels: list[str]) -> list[str]:
    """The columns `results_table` writes besides the id and the kept input columns."""
    return [label_column(label) for label in labels] + ["label", "label_mass", "status", "error"]


def results_table(ids: pa.Array, id_name: str, kept: pa.Table, labels: list[str],
                  probs: np.ndarray, label_mass: np.ndarray, errors: dict[int, str],
                  approx_keep: float | None = None) -> pa.Table:
    """Assemble the output table.

    probs: [N, L] probabilities normalized over the labels (NaN for error rows);
    label_mass: [N]; errors: row_id -> message for rows that were not scored;
    approx_keep: the keep rate of speculative prefill (adds an `approx_keep` column: the scores
    are approximate), None for exact scores (no column).
    """
    n = len(ids)
    ok = np.ones(n, dtype=bool)
    if errors:
        ok[np.fromiter(errors.keys(), dtype=np.int64, count=len(errors))] = False
    columns: dict[str, pa.Array] = {id_name: ids}
    for name in kept.column_names:
        if name != id_name:
            columns[name] = kept.column(name)
    for i, label in enumerate(labels):
        columns[label_column(label)] = pa.array(probs[:, i], mask=~ok, type=pa.float64())
    best = np.argmax(np.nan_to_num(probs, nan=-1.0), axis=1)
    columns["label"] = pa.array([labels[b] if good else None for b, good in zip(best, ok)], type=pa.string())
    columns["label_mass"] = pa.array(label_mass, mask=~ok, type=pa.float64())
    if approx_keep is not None:
        columns["approx_keep"] = pa.array(np.full(n, approx_keep), mask=~ok, type=pa.float64())
    columns["status"] = pa.array(np.where(ok, "ok", "error"), type=pa.string())
    columns["error"] = pa.array([errors.get(i) for i in range(n)], type=pa.string())
    return pa.table(columns)


def write_parquet_atomic(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write `table` to `path` atomically (see `io/atomic.py`); returns the path."""
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))
