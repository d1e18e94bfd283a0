"""The Parquet result writer: one row per input row, written atomically.

The file appears at its final path only when complete (written under a temporary name in the
same folder, then renamed), so a reader never sees a partial output.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.io.atomic import atomic_write
from batchscore.output import layout


def ok_rows(num_rows: int, errors: dict[int, str]) -> np.ndarray:
    """[num_rows] True for rows without an error."""
    ok = np.ones(num_rows, dtype=bool)
    if errors:
        ok[np.fromiter(errors.keys(), dtype=np.int64, count=len(errors))] = False
    return ok


def scores_table(ids: pa.Array, id_name: str, kept: pa.Table, scores: dict[str, pa.Array],
                 errors: dict[int, str], approx_keep: float | None = None) -> pa.Table:
    """Assemble the output table: id, kept columns, the score columns (`scores/normalize.score_columns`),
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
        columns[layout.APPROX_KEEP] = pa.array(np.full(n, approx_keep), mask=~ok, type=pa.float64())
    columns[layout.STATUS] = pa.array(np.where(ok, layout.STATUS_OK, layout.STATUS_ERROR), type=pa.string())
    columns[layout.ERROR] = pa.array([errors.get(i) for i in range(n)], type=pa.string())
    return pa.table(columns)


def provenance(job) -> dict[str, str]:
    """What an output's Parquet schema records about the run of `job` (a PreparedJob) that wrote it,
    so a warehouse load keeps it beside the data: the model, the job's identity hash (the
    completion marker's `output_hash`), the batchscore version and the UTC time of writing; and how
    the writer lays it out: its partition columns (output.partition_by, PARTITION_KEY) and its
    label columns' slugs (output.column_names, output/column_names.py)."""
    from batchscore.version import __version__
    from batchscore.output import column_names
    from batchscore.output.identity import identity_hash

    layout_keys = {PARTITION_KEY: json.dumps(job.config.output.partition_by)} if job.config.output.partition_by else {}
    return {"batchscore.model": str(job.config.model), "batchscore.job_hash": identity_hash(job.source.identity),
            "batchscore.version": __version__,
            "batchscore.run_time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **layout_keys, **column_names.metadata(job.config)}


PARTITION_KEY = "batchscore.partition_by"  # the output's partition columns (JSON list): output/partitioned.py


def partition_columns(schema: pa.Schema) -> list[str]:
    """The partition columns an output's schema names (PARTITION_KEY; [] for one file)."""
    raw = (schema.metadata or {}).get(PARTITION_KEY.encode())
    return json.loads(raw) if raw else []


def with_metadata(table: pa.Table, metadata: dict[str, str]) -> pa.Table:
    """`table` with `metadata` added to its schema's (the data columns untouched)."""
    return table.replace_schema_metadata({**(table.schema.metadata or {}),
                                          **{k.encode(): v.encode() for k, v in metadata.items()}})


def write_parquet_atomic(table: pa.Table, path: str | os.PathLike) -> Path:
    """Write `table` to `path` atomically (see `io/atomic.py`); returns the path."""
    return atomic_write(path, lambda tmp: pq.write_table(table, tmp))
