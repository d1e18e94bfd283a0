"""A job's output assembled window by window (output/row_merge.py): the parts merged into
row order, each window normalized and written as it comes, so the output of a 10M-row job never
sits in memory whole.

Taken by jobs whose output needs nothing beyond each row's own results: a task that names its
columns per window (`Task.window_columns`: the labels task's fixed labels or per-row choices), an
output format that writes windows (Parquet, JSON Lines: `WireFormat.window_writer`), no
calibration, review or confidence columns (they are fitted over every row). Other jobs assemble
the whole table at once (their task's `assemble`). Both write the same rows, columns and values.
"""

from __future__ import annotations

import numpy as np

from batchscore.faults import fault_point
from batchscore.formats.registry import output_format_of
from batchscore.io.atomic import atomic_write
from batchscore.output.layout import DEFAULT_ID
from batchscore.output.parts import Manifest, PartStore
from batchscore.output import partitioned, row_merge
from batchscore.output.table import ok_rows, provenance, scores_table, with_metadata
from batchscore.scores import quality
from batchscore.scores.quality import QualityResult

NOT_SCORED = "not scored: no result from the engine"


def assembles_in_windows(job) -> bool:
    """Whether `job`'s output can be written window by window (see the module docstring)."""
    return job.task.window_columns is not None and windowed_output(job.config) and job.content_free is None


def windowed_format(config) -> bool:
    """A labels or choices job whose output format writes window by window (Parquet, JSON Lines)."""
    wire = output_format_of(config)
    return ((bool(config.labels) or config.input.choices_column is not None) and wire is not None
            and wire.window_writer is not None)


def windowed_output(config) -> bool:
    """A labels job's output that needs only each row's own results (see the module docstring):
    calibration, review and confidence columns are fitted over every row's scores."""
    return windowed_format(config) and not quality.wanted(config)


def assemble_in_windows(job, store: PartStore, manifests: list[Manifest], approx_keep: float | None,
                        window_rows: int | None = None) -> tuple[dict[int, str], QualityResult]:
    """Write the output from every part, `window_rows` rows at a time (default
    `row_merge.WINDOW_ROWS`), atomically; returns the row errors (a row without a result gets
    NOT_SCORED: never silently lost)."""
    config, prepared = job.config, job.input
    id_name = config.input.id_column or DEFAULT_ID
    errors: dict[int, str] = {}
    written = 0
    task_columns = job.task.window_columns(job)

    def write(tmp: str) -> None:
        nonlocal written
        writer = None
        try:
            for window in row_merge.row_windows(store, manifests, prepared.num_rows,
                                                 window_rows or row_merge.WINDOW_ROWS):
                local = {row - window.start: message for row, message in window.errors.items()}
                unscored = window.scores.unscored()
                for row in unscored[~np.isin(unscored, np.fromiter(local, dtype=np.int64, count=len(local)))]:
                    local[int(row)] = NOT_SCORED
                ok = ok_rows(window.rows, local)
                columns = task_columns(window.scores, ok, window.start, window.end)
                table = scores_table(prepared.ids.slice(window.start, window.rows), id_name,
                                     prepared.kept.slice(window.start, window.rows), columns, local,
                                     approx_keep=approx_keep)
                if writer is None:
                    fault_point("assemble")
                    schema = with_metadata(table, provenance(job)).schema  # the run, in the schema
                    writer = output_format_of(config).window_writer(tmp, schema)
                writer.write_table(table.cast(schema))  # a window's all-null column typed as the first's
                written += table.num_rows
                errors.update({row + window.start: message for row, message in local.items()})
        finally:
            if writer is not None:
                writer.close()
        if written != prepared.num_rows:  # the invariant: every input row exactly once
            raise RuntimeError(f"the output would hold {written} rows for {prepared.num_rows} input rows")

    # one file, or a hive-partitioned folder written under a temporary name (output/partitioned.py)
    (partitioned.write_folder if config.output.partition_by else atomic_write)(store.files.output, write)
    fault_point("output")
    return errors, QualityResult()
