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
from batchscore.prepare.options import score_column_names
from batchscore.prepare.prompts import label_column


def output_columns(labels: list[str], choices: bool = False, logprobs: bool = False) -> list[str]:
    """The columns `scores_table` writes besides the id and the kept input columns (fixed
    `labels`, or each row's `choices`; `logprobs`: the raw log-probability columns too)."""
    return score_column_names(labels, choices, logprobs) + ["status", "error"]


def ok_rows(num_rows: int, errors: dict[int, str]) -> np.ndarray:
    """[num_rows] True for rows without an error."""
    ok = np.ones(num_rows, dtype=bool)
    if errors:
        ok[np.fromiter(errors.keys(), dtype=np.int64, count=len(errors))] = False
    return ok


def results_table(ids: pa.Array, id_name: str, kept: pa.Table, labels: list[str],
                  probs: np.ndarray, label_mass: np.ndarray, errors: dict[int, str],
                  approx_keep: float | None = None) -> pa.Table:
    """The output table of fixed labels from their probabilities.

    probs: [N, L] probabilities normalized over the labels (NaN for error rows);
    label_mass: [N]; errors and approx_keep: as in `scores_table`.
    """
    ok = ok_rows(len(ids), errors)
    columns: dict[str, pa.Array] = {}
    for i, label in enumerate(labels):
        columns[label_column(label)] = pa.array(probs[:, i], mask=~ok, type=pa.float64())
    best = np.argmax(np.nan_to_num(probs, nan=-1.0), axis=1)
    columns["label"] = pa.array([labels[b] if good else None for b, good in zip(best, ok)], type=pa.string())
    columns["label_mass"] = pa.array(label_mass, mask=~ok, type=pa.float64())
    return scores_table(ids, id_name, kept, columns, errors, approx_keep)


def scores_table(ids: pa.Array, id_name: str, kept: pa.Table, scores: dict[str, pa.Array],
                 errors: dict[int, str], approx_keep: float | None = None) -> pa.Table:
    """Assemble the output table: id, kept columns, the score columns (`labels.score_columns`),
    then status and error.

    errors: row_id -> message for rows that were not scored; approx_keep: the keep rate of
    speculative prefill (adds an `approx_keep` column: the scores are approximate), None for
    exact scores (no column).
    """
    n = len(ids)
    ok = ok_rows(n, errors)
    columns: dict[str, pa.Array] = {id_name: ids}
    for name in kept.column_names:
        if name != id_name:
            columns[name] = kept.column(name)
    columns.update(scores)
    if approx_keep is not None:
        columns["approx_keep"] = pa.array(np.full(n, approx_keep), mask=~ok, type=pa.float64())
    columns["status"] = pa.array(np.where(ok, "ok", "error"), type=pa.string())
    columns["error"] = pa.array([errors.get(i) for i in range(n)], type=pa.string())
    return pa.table(columns)


def write_parquet_atomic(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write `table` to `path` atomically (see `io/atomic.py`); returns the path."""
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))
