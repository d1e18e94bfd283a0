"""A questions output's raw read scores, kept beside it so its post-processing re-derives.

A questions table's answers are made from each read's raw label totals, and those totals are not
columns of the table (a record's row shows its answers: calibrated, reviewed, with confidence).
So a finished questions output keeps its reads' raw results in `_<output>.reads` (Parquet: one row
per read, its option totals, the top log-probability at its read position and its error with the
error's kind; the job's identity digest in the schema metadata). When only the post-processing
changes (`score.calibrate`, `score.confidence`, the `calibrate` section, `output.review`), a rerun
reads the records again without tokenizing, takes the reads' results from this file and writes the
output with the job's new post-processing — nothing scored, no model loaded (run/rederive.py).
The file is written before the output's completion marker and removed with the output's other
siblings; a name starting with `_` keeps dataset readers (Arrow, DuckDB, Spark) from listing it.
"""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.io.atomic import atomic_write
from batchscore.io.storage import as_path
from batchscore.output.raw_scores import RowScores, combined
from batchscore.row_errors import kind_of, typed

log = logging.getLogger("batchscore")

IDENTITY_KEY = b"batchscore.identity"
_SCHEMA = pa.schema([("logp", pa.list_(pa.float64())), ("top_logp", pa.float64()),
                     ("error", pa.string()), ("error_kind", pa.string())])


def write_reads(path, identity: str, scores: RowScores, errors: dict[int, str]) -> None:
    """Every read's raw results and errors (`errors`: read -> its error) to `path`, atomically."""
    n = len(scores.logp)
    messages = [None] * n
    kinds = [None] * n
    for read, error in errors.items():
        if 0 <= read < n:
            messages[read], kinds[read] = str(error), kind_of(error)
    top = combined(scores.top_logp) if scores.top_logp is not None else pa.nulls(n, pa.float64())
    table = pa.table([combined(scores.logp).cast(pa.list_(pa.float64())), top.cast(pa.float64()),
                      pa.array(messages, pa.string()), pa.array(kinds, pa.string())],
                     schema=_SCHEMA.with_metadata({IDENTITY_KEY: identity.encode()}))
    atomic_write(as_path(path), lambda tmp: pq.write_table(table, tmp))


def read_reads(path, identity: str, num_reads: int) -> tuple[RowScores, dict[int, str]] | None:
    """(the reads' RowScores, read -> error) kept at `path` for a job of `identity` with `num_reads`
    reads; None (logged) when there is no such file or it holds another job's reads."""
    try:
        with as_path(path).open("rb") as handle:
            table = pq.read_table(handle)
    except (OSError, pa.ArrowException) as exc:
        log.info("no kept read scores at %s (%s)", path, exc)
        return None
    if (table.schema.metadata or {}).get(IDENTITY_KEY) != identity.encode() or table.num_rows != num_reads \
            or not set(_SCHEMA.names) <= set(table.column_names):
        log.info("the read scores kept at %s are not this job's reads", path)
        return None
    messages, kinds = table.column("error").to_pylist(), table.column("error_kind").to_pylist()
    errors = {read: typed(message, kind) for read, (message, kind) in enumerate(zip(messages, kinds))
              if message is not None}
    top = table.column("top_logp").combine_chunks()
    scores = RowScores(logp=table.column("logp").combine_chunks(), top_logp=None if top.null_count == len(top) else top)
    return scores, errors
