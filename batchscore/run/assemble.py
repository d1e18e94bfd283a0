"""A labels job's output assembled window by window (output/row_merge.py): the parts merged into
row order, each window normalized and written as it comes, so the output of a 10M-row job never
sits in memory whole.

Taken by jobs whose output needs nothing beyond each row's own results: fixed labels or per-row
choices, an output format that writes windows (Parquet, JSON Lines: `WireFormat.window_writer`),
no calibration, review or confidence columns (they are fitted over every row). `output.top_token`
reads each row's options' first tokens from the run's token store. Other jobs assemble the whole
table at once (their task's `assemble`). Both write the same rows, columns and values.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from batchscore.faults import fault_point
from batchscore.formats.registry import output_format_of
from batchscore.io.atomic import atomic_write
from batchscore.output.layout import DEFAULT_ID
from batchscore.output.parts import Manifest, PartStore
from batchscore.output import row_merge
from batchscore.output.table import ok_rows, provenance, scores_table, with_metadata
from batchscore.scores import quality
from batchscore.scores.quality import QualityResult
from batchscore.store import TokenStore
from batchscore.store.build import store_folder
from batchscore.tasks.labels import first_tokens, row_columns

NOT_SCORED = "not scored: no result from the engine"


def assembles_in_windows(job) -> bool:
    """Whether `job`'s output can be written window by window (see the module docstring)."""
    return job.task.name == "labels" and windowed_output(job.config) and job.content_free is None


def windowed_output(config) -> bool:
    """A labels job's output that needs only each row's own results (see the module docstring)."""
    wire = output_format_of(config)  # a format that writes its output window by window
    return ((bool(config.labels) or config.input.choices_column is not None) and wire is not None
            and wire.window_writer is not None and not quality.wanted(config))


def assemble_in_windows(job, store: PartStore, manifests: list[Manifest], approx_keep: float | None,
                        window_rows: int | None = None) -> tuple[dict[int, str], QualityResult]:
    """Write the output from every part, `window_rows` rows at a time (default
    `row_merge.WINDOW_ROWS`), atomically; returns the row errors (a row without a result gets
    NOT_SCORED: never silently lost)."""
    config, prepared = job.config, job.input
    id_name = config.input.id_column or DEFAULT_ID
    errors: dict[int, str] = {}
    written = 0
    first_tokens = first_tokens_reader(job, store.folder) if config.output.top_token else None

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
                columns = row_columns(job, window.scores, ok, window.start,
                                      first_tokens(window.start, window.end) if first_tokens else None)
                table = scores_table(prepared.ids.slice(window.start, window.rows), id_name,
                                     prepared.kept.slice(window.start, window.rows), columns, local,
                                     approx_keep=approx_keep)
                if writer is None:
                    fault_point("assemble")
                    writer = output_format_of(config).window_writer(  # the run, in the schema
                        tmp, with_metadata(table, provenance(job)).schema)
                writer.write_table(table.cast(writer.schema))
                written += table.num_rows
                errors.update({row + window.start: message for row, message in local.items()})
        finally:
            if writer is not None:
                writer.close()
        if written != prepared.num_rows:  # the invariant: every input row exactly once
            raise RuntimeError(f"the output would hold {written} rows for {prepared.num_rows} input rows")

    atomic_write(store.files.output, write)
    fault_point("output")
    return errors, QualityResult()



def first_tokens_reader(job, parts_folder) -> Callable[[int, int], list[set[int] | None]]:
    """rows [start, end) -> each row's options' first token ids (None: a row not tokenized), read
    from the run's token store: `output.top_token`'s `argmax_is_label` without a request per row."""
    shared = set(job.label_ids) if job.label_ids is not None else None
    num_rows = job.input.num_rows
    if not (store_folder(parts_folder) / "manifest.json").exists():  # a run from the request list (an object-store output)
        every = first_tokens(job)
        return lambda start, end: every[start:end]
    tokens = TokenStore.open(store_folder(parts_folder))
    row_ids = np.asarray(tokens.row_ids)
    inside = row_ids < num_rows  # not the content-free row
    position = np.full(num_rows, -1, dtype=np.int64)
    position[row_ids[inside]] = np.flatnonzero(inside)
    sets = np.asarray(tokens.option_set) if shared is None else None
    firsts = [] if shared is not None else [{int(o.option(i)[0]) for i in range(o.count)} for o in tokens.option_sets()]

    def read(start: int, end: int) -> list[set[int] | None]:
        at = position[start:end]
        if sets is None:
            return [shared if p >= 0 else None for p in at.tolist()]
        return [None if p < 0 else shared if sets[p] < 0 else firsts[sets[p]] for p in at.tolist()]

    return read
