"""Post-processing without re-scoring: a finished output's calibration, confidence, review and
out-of-scope columns derived again from the raw score columns it already holds.

A run's scoring identity (`run/open.scoring_config`) covers only what changes a raw score; the
keys that act after scoring (`score.calibrate` except contextual's content-free input,
`score.confidence`, the `calibrate` section, `output.review`, `output.out_of_scope`) have their own
hash, `assembly_hash`, recorded in the run summary. When a rerun finds its output complete for the
same scoring identity but another assembly hash, `run_job` comes here: the id and kept columns are
read again from the input (no tokenizing), the raw columns (`p_<label>` or `p_choices`,
`label_mass`, `logp_*`, `status`, `error`) are copied from the finished output as they are, the
chosen label is taken again from the raw probabilities, and `scores/quality.py` adds the rest.
Nothing is scored and no model is loaded.

A questions output re-derives the same way from the read scores it keeps beside it (the task's
`rederive`: tasks/questions/kept_reads.py). `rederive_problem` names what this cannot do (the run
then scores again): an output that is not Parquet, contextual calibration (its content-free input
is scored beside the rows), an output whose rows are not the input's.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa

from batchscore.output import column_names, layout, partitioned
from batchscore.formats import write_output
from batchscore.scores.quality import QualityResult, add_quality_columns, content_free_rows
from batchscore.prepare.options import choices_for_output
from batchscore.output.table import ok_rows, provenance, scores_table, with_metadata
from batchscore.prepare.source import PreparedJob

log = logging.getLogger("batchscore")


def rederive_problem(config, source) -> str | None:
    """Why the job's output cannot be re-derived from its raw columns (None: it can)."""
    problem = source.task.rederive_problem  # the job's task may keep no raw columns
    if problem is not None:
        return problem
    wire = source.output_format
    if wire is None or wire.response_lines:
        return f"a {config.output_format} output answers each request in a line of its own"
    if source.task.rederive is None and (not wire.keeps_raw_columns or wire.read_output is None):
        return f"a {config.output_format} output is not read back with its raw columns to re-derive from"
    if content_free_rows(config):
        return "contextual calibration scores a content-free input beside the rows"
    return None


def rederive_output(job: PreparedJob, files) -> tuple[dict[int, str], QualityResult] | None:
    """Write `job`'s output again from the raw columns of the finished output at `files`, with the
    job's post-processing; returns (the row errors, what calibration and review did), or None
    (with the reason logged) when the finished output does not hold this job's rows."""
    if job.task.rederive is not None:  # a task that keeps its raw results its own way
        return job.task.rederive(job, files)
    config, prepared = job.config, job.input
    id_name = config.input.id_column or layout.DEFAULT_ID
    finished = column_names.as_read(job.source.output_format.read_output(files.output))  # p_<label> again
    if partitioned.is_partitioned(files.output):  # read in partition order: back into the input's
        ordered = partitioned.in_row_order(finished, id_name, prepared.ids)
        finished = finished if ordered is None else ordered
    labels = list(config.labels) if config.labels else None
    raw = layout.score_column_names(labels or [], labels is None, config.output.logprobs)
    raw = [name for name in raw if name not in (layout.LABEL, layout.CHOICE, layout.CHOICE_INDEX)]
    top = list(layout.TOP_COLUMNS) if config.output.top_token else []
    raw += top
    missing = [name for name in raw + [id_name, layout.STATUS, layout.ERROR] if name not in finished.column_names]
    if finished.num_rows != prepared.num_rows or missing or not finished.column(id_name).equals(
            pa.chunked_array([prepared.ids])):
        log.info("the finished output does not hold this job's rows and raw columns%s: scoring again",
                 f" (no {missing})" if missing else "")
        return None
    status = finished.column(layout.STATUS).to_pylist()
    messages = finished.column(layout.ERROR).to_pylist()
    errors = {row: messages[row] or "not scored" for row, value in enumerate(status) if value != layout.STATUS_OK}
    ok = ok_rows(prepared.num_rows, errors)
    columns = {name: finished.column(name).combine_chunks() for name in raw}
    choices = choices_for_output(prepared.choices, ok)
    columns = _with_raw_choice(columns, labels, choices, ok)
    columns = {name: columns[name] for name in layout.score_column_names(labels or [], labels is None,
                                                                          config.output.logprobs) + top}
    columns, quality = add_quality_columns(config, columns, ok, prepared.kept, prepared.ids, choices, None)
    approx = config.engine.speculative.keep if config.engine.speculative is not None else None
    table = with_metadata(scores_table(prepared.ids, id_name, prepared.kept, columns, errors, approx_keep=approx),
                          provenance(job))
    write_output(table, files.output, config.output_format, id_name=id_name, labels=config.labels,
                 model=str(config.model), error_path=files.errors)
    return errors, quality


def _with_raw_choice(columns: dict[str, pa.Array], labels: list[str] | None, choices: list | None,
                     ok: np.ndarray) -> dict[str, pa.Array]:
    """`label` (or `choice`, `choice_index`) from the raw probabilities, the first of equal ones, as
    `scores.score_columns` chooses (the finished output's may follow a calibration)."""
    columns = dict(columns)
    mask = ~ok
    if labels is not None:
        p = np.column_stack([np.asarray(columns[layout.label_column(label)].to_numpy(zero_copy_only=False),
                                        dtype=np.float64) for label in labels])
        best = np.argmax(np.nan_to_num(p, nan=-np.inf), axis=1)
        columns[layout.LABEL] = pa.array([labels[b] if good else None for b, good in zip(best, ok)], type=pa.string())
        return columns
    lists = columns[layout.P_CHOICES].to_pylist()
    best = np.array([int(np.argmax(values)) if good and values else 0 for values, good in zip(lists, ok)],
                    dtype=np.int64)
    columns[layout.CHOICE] = pa.array([choices[i][b] if good else None for i, (b, good) in enumerate(zip(best, ok))],
                                      type=pa.string())
    columns[layout.CHOICE_INDEX] = pa.array(best, mask=mask, type=pa.int64())
    return columns
