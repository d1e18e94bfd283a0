"""The rows a job read: `PreparedInput` (requests, per-row errors, ids, kept columns) and the
small Arrow helpers that build it from input batches."""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchscore.errors import InputError
from batchscore.io.readers import InputBatch
from batchscore.plan.types import Request


@dataclass
class RowLocations:
    """Where each input row was read (`file:line`, a Parquet file's row number for line), kept
    per batch, not per row: messages made far from the reader (the engine's memory check) name
    the row as the reader's own messages do. Small and picklable (sent to Ray workers)."""

    starts: list[int] = field(default_factory=list)  # the first row id of each batch
    files: list[str] = field(default_factory=list)
    first_lines: list[int] = field(default_factory=list)
    gaps: dict[int, list[int]] = field(default_factory=dict)  # batch index -> each row's line (blank lines between rows)

    def add(self, first_row_id: int, batch: InputBatch) -> None:
        self.starts.append(first_row_id)
        self.files.append(str(batch.file))
        self.first_lines.append(batch.first_line)
        if batch.lines is not None:
            self.gaps[len(self.starts) - 1] = batch.lines

    def __call__(self, row_id: int) -> str:
        import bisect

        index = bisect.bisect_right(self.starts, row_id) - 1
        if index < 0:
            return f"row {row_id}"
        offset = row_id - self.starts[index]
        lines = self.gaps.get(index)
        line = lines[offset] if lines is not None and offset < len(lines) else self.first_lines[index] + offset
        return f"{self.files[index]}:{line}"


@dataclass
class PreparedInput:
    """Everything the runner needs from the input, independent of the engine."""

    num_rows: int
    ids: pa.Array  # [num_rows] the id column, or row numbers
    kept: pa.Table  # [num_rows] output.keep_columns
    requests: list[Request]  # rows that can be scored
    errors: dict[int, str] = field(default_factory=dict)  # row_id -> message
    choices: pa.Array | None = None  # [num_rows] input.choices_column as read (for the output)
    locations: RowLocations | None = None  # row id -> file:line (labels jobs read from files)
    task_input: object | None = None  # what the job's task keeps besides the rows (questions: the records)
    record_count: int | None = None  # input rows, when the rows are not them (questions: each record is read per question)
    record_of: object | None = None  # [num_rows] numpy: each row's record, when the rows are not the records (progress)

    @property
    def num_records(self) -> int:
        """The input rows (records): `num_rows` unless the task reads each several times."""
        return self.num_rows if self.record_count is None else self.record_count

    @property
    def logical_tokens(self) -> int:
        return sum(len(r) for r in self.requests)


def batch_ids(batch: InputBatch, id_column: str | None, first_row_id: int) -> pa.Array:
    if id_column is None or id_column not in batch.table.column_names:
        return pa.array(np.arange(first_row_id, first_row_id + batch.table.num_rows, dtype=np.int64))
    ids = batch.table.column(id_column).combine_chunks()
    # A null id cannot name its row's output (nor be told from another null): refused, before any
    # work. A line that could not be read has no id either; it stays a row error.
    missing = [i for i, (null, error) in enumerate(zip(ids.is_null().to_pylist(), batch.row_errors or
                                                      [None] * len(ids))) if null and error is None]
    if missing:
        more = f" (and {len(missing) - 1} more rows)" if len(missing) > 1 else ""
        raise InputError(f"{batch.where(missing[0])}: input.id_column {id_column!r} is null"
                         f"{more}; every row needs an id")
    return ids


def select_kept(table: pa.Table, keep_columns: list[str]) -> pa.Table:
    columns = {}
    for name in keep_columns:
        columns[name] = table.column(name) if name in table.column_names else pa.nulls(table.num_rows)
    return pa.table(columns) if columns else pa.table({})


def concat_arrays(arrays: list[pa.Array]) -> pa.Array:
    try:
        return pa.concat_arrays([a.cast(arrays[0].type) if a.type != arrays[0].type else a for a in arrays])
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        return pa.concat_arrays([a.cast(pa.string()) for a in arrays])


def concat_tables(tables: list[pa.Table]) -> pa.Table:
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        # Columns whose types differ across files: keep every value, as text.
        return pa.concat_tables([t.cast(pa.schema([(n, pa.string()) for n in t.column_names])) for t in tables])


def check_columns(batch: InputBatch, needed: list[str], uses: dict[str, str] | None = None) -> None:
    """Refuse a batch that lacks a column the job reads (a misspelt name), naming the file, each
    missing column and the job key that asks for it (`uses`: column -> key). A batch whose rows
    could not all be read is let through: its bad lines are row errors, and may be what hid it."""
    names = set(batch.table.column_names)
    missing = [c for c in needed if c not in names]
    if not missing or any(e is not None for e in batch.row_errors):
        return
    if uses:
        what = "; ".join(f"{c!r}: {uses.get(c, 'the job')}" for c in missing)
        raise InputError(f"{batch.file}: column(s) not found ({what}); the file has columns "
                         f"{sorted(batch.available or names)}")
    raise InputError(f"{batch.file}: column(s) {missing} not found (used by the template, id_column, "
                     f"token_ids_column or keep_columns); the file has columns {sorted(batch.available or names)}")


def check_unique_ids(ids: pa.Array, id_column: str) -> None:
    """Ids must be unique; a null id (a line that could not be read has none) is not a duplicate:
    its row keeps its place and its error names the file and line."""
    if pa.types.is_dictionary(ids.type):  # a dictionary-encoded column (count_distinct has no kernel for it)
        ids = pc.cast(ids, ids.type.value_type)
    if pa.types.is_null(ids.type):  # no id at all (every row unreadable): nothing can clash
        return
    if pa.types.is_integer(ids.type) and ids.null_count == 0 and len(ids) > 1:
        values = ids.to_numpy(zero_copy_only=False)
        if (values[1:] > values[:-1]).all():  # increasing: unique without a hash table of every id
            return
    if pc.count_distinct(ids, mode="only_valid").as_py() != len(ids) - ids.null_count:
        counts = pc.value_counts(ids)
        dupes = [c["values"] for c in counts.to_pylist() if c["counts"] > 1 and c["values"] is not None][:5]
        raise InputError(f"input.id_column {id_column!r} has duplicate values, e.g. {dupes}; ids must be unique")

