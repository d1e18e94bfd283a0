"""Input readers: Parquet, JSONL and OpenAI Batch files (one file, a folder or a glob) as Arrow
record batches."""

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
        elif fmt == "openai_batch":
            yield from _jsonl_batches(path, batch_rows, openai_request, OPENAI_BATCH_SCHEMA)
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


def _jsonl_batches(path: Path, batch_rows: int, convert=None, schema: pa.Schema | None = None) -> Iterator[InputBatch]:
    """Parse JSON Lines one line at a time so a bad line becomes a row error, not a lost file.
    `convert(value) -> (row, problem)` turns each parsed object into a row of `schema`."""
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
            if convert is not None:
                row, problem = convert(row) if error is None else ({}, None)
                error = error or (f"{path}:{number}: {problem}" if problem else None)
            rows.append(row)
            errors.append(error)
            if len(rows) >= batch_rows:
                yield InputBatch(path, first_line, _rows_to_table(rows, path, schema), errors)
                rows, errors = [], []
    if rows:
        yield InputBatch(path, first_line, _rows_to_table(rows, path, schema), errors)


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


def _rows_to_table(rows: list[dict], path: Path, schema: pa.Schema | None = None) -> pa.Table:
    """One column per key seen in ANY row (a row without the key gets null there), so neither a
    bad first line nor a key missing from the first row can drop data. A column whose values
    have mixed types (a number on one line, text on another) is read as text. With `schema`,
    exactly its columns."""
    if schema is not None:
        return pa.Table.from_pylist(rows, schema=schema)
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


# --- OpenAI Batch API request files -----------------------------------------------------------

# One request per line: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
# "body": {"model": ..., "messages": [...]}} or, for /v1/completions, "body": {"prompt": ...}.
OPENAI_BATCH_SCHEMA = pa.schema([
    ("custom_id", pa.string()), ("method", pa.string()), ("url", pa.string()), ("model", pa.string()),
    ("messages", pa.string()),  # JSON text: [{"role": ..., "content": "..."}], contents as plain text
    ("prompt", pa.string()),
])


def openai_request(value: dict) -> tuple[dict, str | None]:
    """One OpenAI Batch request line as a row of OPENAI_BATCH_SCHEMA, and the problem that keeps
    it from being scored (None if it can be). The row keeps its custom_id even when it fails,
    so its error is reported under that id."""
    custom_id = value.get("custom_id")
    row = {"custom_id": custom_id if isinstance(custom_id, str) else None,
           "method": _text_or_none(value.get("method")), "url": _text_or_none(value.get("url"))}
    if not isinstance(custom_id, str) or not custom_id:
        return row, "custom_id: missing or not a string"
    body = value.get("body")
    if not isinstance(body, dict):
        return row, "body: missing or not an object"
    row["model"] = _text_or_none(body.get("model"))
    if body.get("messages") is not None:
        messages, problem = _chat_messages(body["messages"])
        if problem:
            return row, f"body.messages: {problem}"
        row["messages"] = json.dumps(messages, ensure_ascii=False)
    elif body.get("prompt") is not None:
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return row, "body.prompt: must be one string (a request scores one prompt)"
        row["prompt"] = prompt
    else:
        return row, "body: has neither messages (chat completions) nor prompt (completions)"
    return row, None


def _chat_messages(messages) -> tuple[list[dict], str | None]:
    if not isinstance(messages, list) or not messages:
        return [], "must be a non-empty list of {role, content} objects"
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return [], f"message {i} has no role"
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                return [], f"message {i}: only text content parts can be scored"
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            return [], f"message {i} has no text content"
        result.append({"role": message["role"], "content": content})
    return result, None


def _text_or_none(value):
    return value if isinstance(value, str) else None
