"""Input readers: Parquet and JSONL files (one file, a folder or a glob) as Arrow record batches."""

from __future__ import annotations

import glob as globlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.errors import InputError

SUFFIX_FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}


@dataclass
class InputBatch:
    """Rows read from one file: an Arrow table plus per-row read errors (None = row read fine)."""

    file: Path
    first_line: int  # 1-based line / row number of the batch's first row inside `file`
    table: pa.Table
    row_errors: list[str | None] = field(default_factory=list)


def discover_files(path: str, fmt: str = "auto") -> list[tuple[Path, str]]:
    """Resolve `path` (file, folder or glob) to sorted (file, format) pairs; raises InputError."""
    p = Path(path).expanduser()
    if any(ch in path for ch in "*?["):
        candidates = [Path(x) for x in sorted(globlib.glob(str(p), recursive=True))]
        if not candidates:
            raise InputError(f"input.path: no files match the glob {path!r}")
    elif p.is_dir():
        candidates = sorted(x for x in p.rglob("*") if x.suffix.lower() in SUFFIX_FORMATS and x.is_file())
        if not candidates:
            raise InputError(f"input.path: folder {path} holds no .parquet or .jsonl files")
    elif p.exists():
        candidates = [p]
    else:
        raise InputError(f"input.path: file not found: {path}")
    files = []
    for candidate in candidates:
        if candidate.is_dir():
            continue
        detected = fmt if fmt != "auto" else SUFFIX_FORMATS.get(candidate.suffix.lower())
        if detected is None:
            raise InputError(f"{candidate}: unknown file type {candidate.suffix!r}; "
                             "use .parquet or .jsonl, or set input.format")
        files.append((candidate, detected))
    return files


def iter_batches(files: list[tuple[Path, str]], batch_rows: int) -> Iterator[InputBatch]:
    """Yield record batches of every file in order; raises InputError for unreadable files."""
    for path, fmt in files:
        if fmt == "parquet":
            yield from _parquet_batches(path, batch_rows)
        else:
            yield from _jsonl_batches(path, batch_rows)


_ARROW_READ_ERRORS = (pa.ArrowException, OSError, ValueError)


def _parquet_batches(path: Path, batch_rows: int) -> Iterator[InputBatch]:
    try:
        parquet = pq.ParquetFile(path)
    except _ARROW_READ_ERRORS as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    line = 1
    batches = parquet.iter_batches(batch_size=batch_rows)
    while True:
        try:  # a file damaged after its footer fails here, in the middle of reading
            batch = next(batches, None)
        except _ARROW_READ_ERRORS as exc:
            raise InputError(f"{path}: not a readable Parquet file: rows from {line} on cannot be read ({exc})") from None
        if batch is None:
            return
        table = pa.Table.from_batches([batch])
        yield InputBatch(path, line, table, [None] * table.num_rows)
        line += table.num_rows


def _jsonl_batches(path: Path, batch_rows: int) -> Iterator[InputBatch]:
    """Parse JSON Lines one line at a time so a bad line becomes a row error, not a lost file."""
    rows: list[dict] = []
    errors: list[str | None] = []
    first_line = 1
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot open ({exc})") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(_UTF8_BOM):
                raw = raw[len(_UTF8_BOM):]  # written by some Windows tools; not part of the row
            if not raw.strip():
                continue  # blank lines are not rows
            if not rows:
                first_line = number
            row, error = _parse_json_line(raw, path, number)
            rows.append(row)
            errors.append(error)
            if len(rows) >= batch_rows:
                yield InputBatch(path, first_line, _rows_to_table(rows, path), errors)
                rows, errors = [], []
    if rows:
        yield InputBatch(path, first_line, _rows_to_table(rows, path), errors)


_UTF8_BOM = b"\xef\xbb\xbf"


def _parse_json_line(raw: bytes, path: Path, number: int) -> tuple[dict, str | None]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return {}, f"{path}:{number}: invalid UTF-8 ({exc.reason} at byte {exc.start})"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return {}, f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return {}, f"{path}:{number}: JSON nested too deeply to read"
    if not isinstance(value, dict):
        return {}, f"{path}:{number}: expected a JSON object, got {type(value).__name__}"
    return value, None


def _rows_to_table(rows: list[dict], path: Path) -> pa.Table:
    """One column per key seen in ANY row (a row without the key gets null there), so neither a
    bad first line nor a key missing from the first row can drop data. A column whose values
    have mixed types (a number on one line, text on another) is read as text."""
    names = list(dict.fromkeys(key for row in rows for key in row))
    columns = {}
    for name in names:
        values = [row.get(name) for row in rows]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
            columns[name] = pa.array([_to_text(v) for v in values], type=pa.string())
    if not columns:
        return pa.table({"__row__": pa.nulls(len(rows))}).drop_columns(["__row__"])
    return pa.table(columns)


def _to_text(value):
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)
