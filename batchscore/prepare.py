"""Input rows → Requests: read batches, render prompts, tokenize, and record per-row errors.

Every input row gets a `row_id` (its position across all input files, in reading order); rows
that cannot be scored keep their row id and an error message, so nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pyarrow as pa

from batchscore.config import JobConfig
from batchscore.io.readers import InputBatch, InputError, discover_files, iter_batches
from batchscore.plan.types import Request
from batchscore.prompts import RowRenderError


@dataclass
class PreparedInput:
    """Everything the runner needs from the input, independent of the engine."""

    num_rows: int
    ids: pa.Array  # [num_rows] the id column, or row numbers
    kept: pa.Table  # [num_rows] output.keep_columns
    requests: list[Request]  # rows that can be scored
    errors: dict[int, str] = field(default_factory=dict)  # row_id -> message

    @property
    def logical_tokens(self) -> int:
        return sum(len(r) for r in self.requests)


def prepare_input(config: JobConfig, renderer=None, max_length: int | None = None,
                  vocab_size: int | None = None, progress: Callable[[int], None] | None = None) -> PreparedInput:
    """Read every input row and turn it into a Request or a per-row error.

    `renderer` (a PromptRenderer) is needed unless the input carries token ids. Raises
    InputError for problems that concern a whole file (missing, empty, a template field that is
    not a column); everything row-level becomes an entry in `errors`.
    """
    if config.input.synthetic is not None:
        return _prepare_synthetic(config)
    files = discover_files(config.input.path, config.input.format)
    id_column = config.input.id_column
    keep_columns = list(config.output.keep_columns)
    token_column = config.input.token_ids_column
    needed = list(dict.fromkeys(
        ([id_column] if id_column else []) + keep_columns
        + ([token_column] if token_column else renderer.template.columns if renderer else [])
    ))

    ids, kept_tables, requests, errors = [], [], [], {}
    row_id = 0
    saw_rows = False
    for batch in iter_batches(files, config.input.batch_rows):
        n = batch.table.num_rows
        if n == 0:
            continue
        saw_rows = True
        _check_columns(batch, needed)
        ids.append(_batch_ids(batch, id_column, row_id))
        kept_tables.append(_select_kept(batch.table, keep_columns))
        if token_column:
            rows_tokens = _token_rows(batch, token_column, errors, row_id)
        else:
            rows_tokens = _rendered_rows(batch, renderer, errors, row_id)
        for offset, tokens in enumerate(rows_tokens):
            rid = row_id + offset
            if tokens is None:
                continue
            problem = _length_problem(tokens, max_length, vocab_size)
            if problem:
                errors[rid] = problem
            else:
                requests.append(Request(rid, tokens))
        row_id += n
        if progress:
            progress(n)
    if not saw_rows:
        raise InputError(f"input.path: {config.input.path} holds no rows")
    id_array = _concat(ids)
    if id_column:
        _check_unique_ids(id_array, id_column)
    kept = _concat_tables(kept_tables) if keep_columns else pa.table({})
    return PreparedInput(row_id, id_array, kept, requests, errors)


def _prepare_synthetic(config: JobConfig) -> PreparedInput:
    from batchscore.bench.workloads import WORKLOADS

    sequences = WORKLOADS[config.input.synthetic.workload](**config.input.synthetic.params)
    requests = [Request(i, np.asarray(s, dtype=np.int32)) for i, s in enumerate(sequences)]
    n = len(requests)
    return PreparedInput(n, pa.array(np.arange(n, dtype=np.int64)), pa.table({}), requests, {})


def _check_columns(batch: InputBatch, needed: list[str]) -> None:
    names = set(batch.table.column_names)
    missing = [c for c in needed if c not in names]
    if missing and all(e is None for e in batch.row_errors):
        raise InputError(
            f"{batch.file}: column(s) {missing} not found (used by the template, id_column, "
            f"token_ids_column or keep_columns); the file has columns {sorted(names)}"
        )


def _batch_ids(batch: InputBatch, id_column: str | None, first_row_id: int) -> pa.Array:
    if id_column is None or id_column not in batch.table.column_names:
        return pa.array(np.arange(first_row_id, first_row_id + batch.table.num_rows, dtype=np.int64))
    return batch.table.column(id_column).combine_chunks()


def _select_kept(table: pa.Table, keep_columns: list[str]) -> pa.Table:
    columns = {}
    for name in keep_columns:
        columns[name] = table.column(name) if name in table.column_names else pa.nulls(table.num_rows)
    return pa.table(columns) if columns else pa.table({})


def _rendered_rows(batch: InputBatch, renderer, errors: dict[int, str], first_row_id: int) -> list:
    columns = [c for c in renderer.template.columns if c in batch.table.column_names]
    rows = batch.table.select(columns).to_pylist()
    texts, positions = [], []
    for offset, (row, read_error) in enumerate(zip(rows, batch.row_errors)):
        rid = first_row_id + offset
        if read_error:
            errors[rid] = read_error
            continue
        try:
            texts.append(renderer.text(row))
            positions.append(offset)
        except KeyError as exc:
            errors[rid] = f"{batch.file}:{batch.first_line + offset}: field {exc.args[0]!r} is null or missing"
        except RowRenderError as exc:  # prompt.engine jinja: any other failure of this row's template
            errors[rid] = f"{batch.file}:{batch.first_line + offset}: {exc}"
    result: list = [None] * len(rows)
    for offset, tokens in zip(positions, renderer.encode(texts)):
        result[offset] = tokens
    return result


def _token_rows(batch: InputBatch, column: str, errors: dict[int, str], first_row_id: int) -> list:
    values = batch.table.column(column).to_pylist() if column in batch.table.column_names else [None] * batch.table.num_rows
    result: list = []
    for offset, (value, read_error) in enumerate(zip(values, batch.row_errors)):
        rid = first_row_id + offset
        where = f"{batch.file}:{batch.first_line + offset}: field {column!r}"
        if read_error:
            errors[rid], value = read_error, None
        elif value is None:
            errors[rid] = f"{where} is null"
        elif not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            errors[rid], value = f"{where} must be a list of integer token ids", None
        elif any(t < 0 for t in value):
            errors[rid], value = f"{where} holds a negative token id", None
        result.append(value if rid not in errors else None)
    return result


def _length_problem(tokens, max_length: int | None, vocab_size: int | None) -> str | None:
    if len(tokens) == 0:
        return "empty prompt: no tokens to score"
    if max_length is not None and len(tokens) > max_length:
        return f"prompt is {len(tokens)} tokens, longer than the maximum {max_length} (the model's context)"
    if vocab_size is not None and max(tokens) >= vocab_size:
        return f"token id {max(tokens)} is outside the model's vocabulary (size {vocab_size})"
    return None


def _concat(arrays: list[pa.Array]) -> pa.Array:
    try:
        return pa.concat_arrays([a.cast(arrays[0].type) if a.type != arrays[0].type else a for a in arrays])
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pa.concat_arrays([a.cast(pa.string()) for a in arrays])


def _concat_tables(tables: list[pa.Table]) -> pa.Table:
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        # Columns whose types differ across files: keep every value, as text.
        return pa.concat_tables([t.cast(pa.schema([(n, pa.string()) for n in t.column_names])) for t in tables])


def _check_unique_ids(ids: pa.Array, id_column: str) -> None:
    import pyarrow.compute as pc

    if pc.count_distinct(ids).as_py() != len(ids):
        counts = pc.value_counts(ids)
        dupes = [c["values"] for c in counts.to_pylist() if c["counts"] > 1][:5]
        raise InputError(f"input.id_column {id_column!r} has duplicate values, e.g. {dupes}; ids must be unique")
