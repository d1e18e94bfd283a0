"""Wire formats: how an input's records are read and validated, and how the results table is
written. One module per format, each registering a `WireFormat` (registry.py): `table.py`
(Parquet, JSON Lines), `openai_batch.py` (the OpenAI Batch API's chat/completions requests and
output files). This face reads and writes through the registry and names no format.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pyarrow as pa

from batchscore.formats.registry import (WireFormat, formats, get_format, input_names, output_names, register,
                                         suffix_formats, unregister)
from batchscore.io import readers
from batchscore.io.readers import InputBatch


def discover_files(path: str, fmt: str = "auto", filter: dict | None = None) -> list[tuple[Path, str]]:
    """The input's files as sorted (file, format) pairs (io/readers.py), formats by suffix for `auto`."""
    return readers.discover_files(path, suffix_formats(), fmt, filter)


def input_files(inp) -> list[tuple[Path, str]]:
    """The input's files (`inp`: the job's InputConfig): a table format's one table, else the files
    found below input.path (`discover_files`)."""
    wire = get_format(inp.format) if inp.format != "auto" else None
    if wire is not None and wire.open_input is not None:
        return wire.open_input(inp)
    return discover_files(inp.path, inp.format, inp.filter)


def _file_reader(fmt: str):
    wire = get_format(fmt)
    return None if wire.dataset else wire.read


def iter_batches(files: list[tuple[Path, str]], batch_rows: int, columns: list[str] | None = None,
                 base: Path | None = None, json_columns: tuple[str, ...] = (), only: set | dict | None = None
                 ) -> Iterator[InputBatch]:
    """Every file's rows batch by batch (`only`: those files' rows), each read by its format
    (io/readers.iter_batches)."""
    return readers.iter_batches(files, _file_reader, batch_rows, columns, base, json_columns, only)


def write_output(table: pa.Table, path: str | os.PathLike, fmt: str, *, id_name: str, labels: list[str],
                 model: str = "", error_path: str | os.PathLike | None = None,
                 usage: dict | None = None, row_errors: dict | None = None) -> None:
    """Write the results table (output/table.py) as `fmt` (`error_path`: its failed rows' file,
    `OutputFiles.errors`, for a format that writes one; `usage`: row -> (prompt tokens, cached
    tokens), output/token_usage.py, for a format whose answers report their token usage; `row_errors`: row -> its RowError
    (row_errors.py), for a format whose failed rows say what kind of failure they are)."""
    wire = get_format(fmt)
    if wire.write is None:
        raise ValueError(f"format {fmt!r} is read only, not written")
    wire.write(table, path, id_name=id_name, labels=labels, model=model, error_path=error_path, usage=usage,
               row_errors=row_errors)


__all__ = ["InputBatch", "WireFormat", "discover_files", "formats", "get_format", "input_files", "input_names",
           "iter_batches",
           "output_names", "register", "suffix_formats", "unregister", "write_output"]
