"""The results table as a table: Parquet (read as one Arrow dataset, io/readers.py) and JSON Lines
(one row per line, parsed line by line so that a bad line is that row's error)."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.formats.lines import write_lines
from batchscore.formats.registry import WireFormat, register
from batchscore.io.readers import jsonl_batches
from batchscore.output import column_names, partitioned
from batchscore.output.table import partition_columns, write_parquet_atomic


def write_parquet(table, path, **_) -> None:
    """One Parquet file, or the hive-partitioned folder its schema names (output.partition_by);
    its label columns named as the schema records (output.column_names)."""
    table = column_names.as_written(table)
    by = partition_columns(table.schema)
    partitioned.write_table(table, path, by) if by else write_parquet_atomic(table, path)


def parquet_window_writer(path, schema: pa.Schema):
    """The window writer of `write_parquet`'s output: `path` is a file, or the temporary folder of
    a partitioned output (run/assemble.py writes it with `partitioned.write_folder`)."""
    by = partition_columns(schema)
    schema = column_names.written_schema(schema)
    return _Renaming(partitioned.DatasetWindowWriter(path, schema, by) if by else pq.ParquetWriter(path, schema))


class _Renaming:
    """A window writer whose windows' label columns are renamed as written (output.column_names)."""

    def __init__(self, writer) -> None:
        self.writer = writer

    def write_table(self, table: pa.Table) -> None:
        self.writer.write_table(column_names.as_written(table))

    def close(self) -> None:
        self.writer.close()


def read_parquet(path) -> pa.Table:
    """A finished Parquet output read back whole (local or in an object store; a partitioned
    output's folder with the types and columns it was written with, rows in partition order)."""
    from batchscore.io.storage import as_path

    if partitioned.is_partitioned(path):
        return partitioned.read_dataset(path)
    with as_path(path).open("rb") as handle:
        return pq.read_table(handle)


def read_jsonl(path, batch_rows: int, columns, json_columns):
    # a column kept as its line's own JSON (questions, token ids) is read strictly: no key twice
    return jsonl_batches(path, batch_rows, columns=columns, json_columns=json_columns, unique_keys=bool(json_columns))


def write_jsonl(table, path, **_) -> None:
    """One JSON object per row; a NaN or infinite number is written as null (JSON has neither)."""
    write_lines(path, (_line(row) for row in column_names.as_written(table).to_pylist()))


def _line(row: dict) -> str:
    finite = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(finite, ensure_ascii=False, default=str)


class JsonlWindowWriter:
    """JSON Lines written window by window: the same lines `write_jsonl` writes for the whole table
    (JSON has no schema: the run's metadata stays in the completion marker)."""

    def __init__(self, path, schema: pa.Schema) -> None:
        self.schema = schema
        self._file = open(path, "w", encoding="utf-8")

    def write_table(self, table: pa.Table) -> None:
        for row in column_names.as_written(table).to_pylist():
            self._file.write(_line(row))
            self._file.write("\n")

    def close(self) -> None:
        self._file.close()


PARQUET = register(WireFormat("parquet", suffixes=(".parquet", ".pq"), dataset=True, write=write_parquet,
                              keeps_raw_columns=True, read_output=read_parquet, window_writer=parquet_window_writer))
JSONL = register(WireFormat("jsonl", suffixes=(".jsonl", ".ndjson", ".json"), read=read_jsonl, write=write_jsonl,
                            output_suffixes=(".jsonl", ".ndjson"), window_writer=JsonlWindowWriter))
