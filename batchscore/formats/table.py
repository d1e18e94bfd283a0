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
from batchscore.output.table import write_parquet_atomic


def write_parquet(table, path, **_) -> None:
    write_parquet_atomic(table, path)


def read_parquet(path) -> pa.Table:
    """A finished Parquet output read back whole (local or in an object store)."""
    from batchscore.io.storage import as_path

    with as_path(path).open("rb") as handle:
        return pq.read_table(handle)


def read_jsonl(path, batch_rows: int, columns, json_columns):
    # a column kept as its line's own JSON (questions, token ids) is read strictly: no key twice
    return jsonl_batches(path, batch_rows, columns=columns, json_columns=json_columns, unique_keys=bool(json_columns))


def write_jsonl(table, path, **_) -> None:
    """One JSON object per row; a NaN or infinite number is written as null (JSON has neither)."""
    write_lines(path, (_line(row) for row in table.to_pylist()))


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
        for row in table.to_pylist():
            self._file.write(_line(row))
            self._file.write("\n")

    def close(self) -> None:
        self._file.close()


PARQUET = register(WireFormat("parquet", suffixes=(".parquet", ".pq"), dataset=True, write=write_parquet,
                              keeps_raw_columns=True, read_output=read_parquet, window_writer=pq.ParquetWriter))
JSONL = register(WireFormat("jsonl", suffixes=(".jsonl", ".ndjson", ".json"), read=read_jsonl, write=write_jsonl,
                            output_suffixes=(".jsonl", ".ndjson"), window_writer=JsonlWindowWriter))
