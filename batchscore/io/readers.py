"""Input readers: the files of an input (one file, a folder or a glob) as Arrow record batches.
Which format a file is, and how a line-based format turns its lines into rows, is the wire
format's (formats/); this module holds the shared machinery.

Parquet goes through `pyarrow.dataset`: only the columns a job uses are read (projection), the
schemas of all files are unified (a column missing from a file is null there; types that cannot
be promoted are read as text), and hive partition folders (`date=2026-11-25/`) below the input
folder become text columns, which `input.filter` selects files by. JSONL is parsed line by line
so that a bad line is that row's error, never a lost file.
"""

from __future__ import annotations

import glob as globlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from batchscore.errors import DuplicateKeyError, InputError
from batchscore.io.storage import as_path, describe_store_error, is_remote, is_url, relative_folder, store_error_types

@dataclass
class InputBatch:
    """Rows read from one file: an Arrow table plus per-row read errors (None = row read fine)."""

    file: Path
    first_line: int  # 1-based line / row number of the batch's first row inside `file`
    table: pa.Table  # the requested columns the input has
    row_errors: list[str | None] = field(default_factory=list)
    available: list[str] | None = None  # every column the input has (None: the table's)
    lines: list[int] | None = None  # each row's line where blank lines sit between rows (None: first_line + offset)

    def line(self, offset: int) -> int:
        """The 1-based line (or row number) of the batch's row `offset` in its file."""
        return self.lines[offset] if self.lines is not None else self.first_line + offset

    def where(self, offset: int) -> str:
        """`file:line` of the batch's row `offset`, as row errors name it."""
        return f"{self.file}:{self.line(offset)}"


def discover_files(path: str, suffixes: Mapping[str, str], fmt: str = "auto",
                   filter: dict | None = None) -> list[tuple[Path, str]]:
    """Resolve `path` (file, folder or glob) to sorted (file, format) pairs, keeping only the
    files whose hive partitions match `filter` ({column: value or [values]}); raises InputError.
    `suffixes`: {file suffix: format} that `fmt: auto` and a folder read. An object-store URL
    (io/storage.py) gives UPaths, a local path Paths."""
    try:
        candidates = _discover_remote(path, suffixes) if is_url(path) else _discover_local(path, suffixes)
        base = input_base(path) if filter else None
    except (OSError, *store_error_types()) as exc:  # a store that cannot be reached, a folder that cannot be listed
        raise InputError(f"input.path: cannot list {path}: {describe_store_error(exc)}") from None
    files = []
    for candidate in candidates:
        detected = fmt if fmt != "auto" else suffixes.get(candidate.suffix.lower())
        if detected is None:
            raise InputError(f"{candidate}: unknown file type {candidate.suffix!r}; "
                             "use .parquet or .jsonl, or set input.format")
        files.append((candidate, detected))
    if filter:
        files = _filter_partitions(files, base, filter, path)
    return files


def _discover_remote(path: str, suffixes: Mapping[str, str]) -> list:
    root = as_path(path)
    root.fs.invalidate_cache()  # listings cached by an earlier job of this process may be stale
    try:
        if any(ch in path for ch in "*?["):
            found = root.fs.glob(root.path, detail=True)  # one listing, with each entry's type
            files = sorted(name for name, info in found.items() if info.get("type") == "file")
            if not files:
                raise InputError(f"input.path: no files match the glob {path!r}")
        elif root.fs.isdir(root.path):
            files = sorted(f for f in root.fs.find(root.path)
                           if Path(f).suffix.lower() in suffixes)
            if not files:
                raise InputError(f"input.path: folder {path} holds no .parquet or .jsonl files")
        elif root.fs.isfile(root.path):
            files = [root.path]
        else:
            raise InputError(f"input.path: file not found: {path}")
    except (OSError, ValueError, *store_error_types()) as exc:
        raise InputError(f"input.path: cannot list {path}: {describe_store_error(exc)}") from None
    from upath import UPath

    return [UPath(f, protocol=root.protocol, **root.storage_options) for f in files]  # the root's account and options


def _discover_local(path: str, suffixes: Mapping[str, str]) -> list[Path]:
    p = Path(path).expanduser()
    if any(ch in path for ch in "*?["):
        candidates = [Path(x) for x in sorted(globlib.glob(str(p), recursive=True))]
        if not candidates:
            raise InputError(f"input.path: no files match the glob {path!r}")
    elif p.is_dir():
        candidates = sorted(x for x in p.rglob("*") if x.suffix.lower() in suffixes and x.is_file())
        if not candidates:
            raise InputError(f"input.path: folder {path} holds no .parquet or .jsonl files")
    elif p.exists():
        candidates = [p]
    else:
        raise InputError(f"input.path: file not found: {path}")
    return [c for c in candidates if not c.is_dir()]


def input_base(path: str) -> Path | None:
    """The folder hive partitions are found below: the input folder, or a glob's leading folders
    without wildcards; None for a single file, or an input named by no path (an Iceberg table)."""
    if path is None:
        return None
    if is_url(path):
        root = as_path(path)
        if any(ch in path for ch in "*?["):
            return as_path(path[: max(path.rfind("/", 0, min(path.find(ch) for ch in "*?[" if ch in path)), 0)])
        return root if root.fs.isdir(root.path) else None
    p = Path(path).expanduser()
    if any(ch in path for ch in "*?["):
        fixed = []
        for part in p.parts:
            if any(ch in part for ch in "*?["):
                break
            fixed.append(part)
        return Path(*fixed) if fixed else Path(".")
    return p if p.is_dir() else None


def partition_values(files: list[Path], base: Path | None) -> list[dict[str, str | None]]:
    """Each file's hive partitions (`key=value` folders below `base`) as text, parsed by
    pyarrow.dataset.HivePartitioning (URL-decoded; `__HIVE_DEFAULT_PARTITION__` is null)."""
    if base is None:
        return [{} for _ in files]
    folders = [relative_folder(f, base) for f in files]
    names = list(dict.fromkeys(seg.split("=", 1)[0] for folder in folders for seg in folder.split("/") if "=" in seg))
    if not names:
        return [{} for _ in files]
    hive = ds.HivePartitioning(pa.schema([(name, pa.string()) for name in names]))
    return [ds.get_partition_keys(hive.parse(f"/{folder}/")) for folder in folders]


def _filter_partitions(files: list[tuple[Path, str]], base: Path | None, filter: dict, path: str) -> list[tuple[Path, str]]:
    values = partition_values([f for f, _ in files], base)
    names = {name for v in values for name in v}
    unknown = [key for key in filter if key not in names]
    if unknown:
        raise InputError(f"input.filter: {unknown} are not partition columns of {path} (its key=value folders: "
                         f"{sorted(names) or 'none'})")
    allowed = {key: {str(v) for v in (want if isinstance(want, list) else [want])} for key, want in filter.items()}
    kept = [f for f, v in zip(files, values) if all(str(v.get(k)) in ok for k, ok in allowed.items())]
    if not kept:
        raise InputError(f"input.filter {filter}: no file of {path} is in those partitions")
    return kept


def iter_batches(files: list[tuple[Path, str]], read_file: Callable[[str], Callable | None], batch_rows: int,
                 columns: list[str] | None = None, base: Path | None = None,
                 json_columns: tuple[str, ...] = (), only: set | dict | None = None) -> Iterator[InputBatch]:
    """Yield record batches of every file in order, with only `columns` (None: all) and the hive
    partition columns of folders below `base`; raises InputError for unreadable files (an object
    store that cannot be reached included). `json_columns`: JSONL columns read per line as JSON
    text (an object or array written back with `json.dumps`), never unified across lines into one
    struct that would give each row the other rows' keys. `read_file(format)`: how one file of
    that format is read, `(file, batch_rows, columns, json_columns) -> batches`; None for a format
    read as one Arrow dataset with the input's other such files (Parquet). `only`: the files whose
    rows are yielded (None: all), or a dict file -> None (all its rows) or a Parquet file's
    (first, end) row groups; the schema and partition columns are still the whole input's, so a
    part of the input reads exactly as it does within the whole (store/segments.py)."""
    batches = _batches(files, read_file, batch_rows, columns, base, tuple(json_columns), only)
    while True:
        try:
            batch = next(batches, None)
        except (OSError, pa.ArrowException, *store_error_types()) as exc:
            raise InputError(f"input: cannot read {_where(files)}: {describe_store_error(exc)}") from None
        if batch is None:
            return
        yield batch


def _where(files: list[tuple[Path, str]]) -> str:
    return str(files[0][0]) if len(files) == 1 else f"{len(files)} files from {files[0][0]} on"


def _batches(files: list[tuple[Path, str]], read_file: Callable[[str], Callable | None], batch_rows: int,
             columns: list[str] | None, base: Path | None, json_columns: tuple[str, ...] = (),
             only: set | dict | None = None) -> Iterator[InputBatch]:
    partitions = partition_values([f for f, _ in files], base)
    readers = {fmt: read_file(fmt) for fmt in {fmt for _, fmt in files}}
    parquet = [(f, p) for (f, fmt), p in zip(files, partitions) if readers[fmt] is None]
    scan = _ParquetScan(parquet, base, columns) if parquet else None
    for (path, fmt), values in zip(files, partitions):
        if only is not None and path not in only:
            continue
        if readers[fmt] is None:
            yield from scan.batches(path, batch_rows, only.get(path) if isinstance(only, dict) else None)
            continue
        for batch in readers[fmt](path, batch_rows, columns, json_columns):
            yield _with_partitions(batch, values, columns)


def _with_partitions(batch: InputBatch, values: dict, columns: list[str] | None) -> InputBatch:
    """A line-read batch with its file's partition columns (a key of the rows wins), only `columns`."""
    table = batch.table
    for name, value in values.items():
        if name not in table.column_names:
            table = table.append_column(name, pa.array([value] * table.num_rows, type=pa.string()))
    available = table.column_names
    if columns is not None:
        table = table.select([c for c in columns if c in available])
    if batch.available is not None:  # a reader that read only `columns` (a table) names all it has
        available = [*batch.available, *(name for name in values if name not in batch.available)]
    return InputBatch(batch.file, batch.first_line, table, batch.row_errors, available, batch.lines)


_ARROW_READ_ERRORS = (pa.ArrowException, OSError, ValueError)  # with store_error_types() where read


class _ParquetScan:
    """The Parquet files of an input as one pyarrow dataset: one unified schema (plus the hive
    partition columns), read file by file (fragment by fragment) so that errors name the file
    and row, with only the requested columns."""

    def __init__(self, files: list[tuple[Path, dict]], base: Path | None, columns: list[str] | None):
        schemas = []
        for path, _ in files:
            try:
                filesystem, inside = _arrow_location(path)
                schemas.append(pq.read_schema(inside, filesystem=filesystem))
            except (*_ARROW_READ_ERRORS, *store_error_types()) as exc:
                raise InputError(f"{path}: not a readable Parquet file ({describe_store_error(exc)})") from None
        schema = _unify(schemas)
        names = list(dict.fromkeys(name for _, values in files for name in values))
        extra = [pa.field(name, pa.string()) for name in names if name not in schema.names]  # a data column wins
        self.schema = pa.schema(list(schema) + extra)
        hive = ds.HivePartitioning(pa.schema(extra)) if extra else None
        filesystem = _arrow_location(files[0][0])[0]
        inside = {p: _arrow_location(p)[1] for p, _ in files}
        dataset = ds.dataset(list(inside.values()), format="parquet", schema=self.schema,
                             filesystem=filesystem, partitioning=hive,
                             partition_base_dir=_arrow_location(base)[1] if hive else None)
        by_path = {fragment.path: fragment for fragment in dataset.get_fragments()}
        self.fragments = {p: by_path[inside[p]] for p, _ in files}
        self.columns = self.schema.names if columns is None else [c for c in columns if c in self.schema.names]

    def batches(self, path: Path, batch_rows: int, row_groups: tuple[int, int] | None = None) -> Iterator[InputBatch]:
        """The file's batches (`row_groups`: those of row groups first..end-1 alone, numbered as
        in the whole file; a batch never spans two row groups, so they are the whole file's)."""
        line = 1
        fragment = self.fragments[path]
        if row_groups is not None:
            first, end = row_groups
            line += sum(fragment.metadata.row_group(i).num_rows for i in range(first))
            fragment = fragment.subset(row_group_ids=list(range(first, end)))
        # pre_buffer off for local files: with it a fragment caches what it has read until it is done,
        # so a 10M-row file held ~1.2 GB; without it the reader holds a row group or two. Object
        # stores keep it (coalesced ranged reads are what makes them fast).
        options = None if is_remote(path) else ds.ParquetFragmentScanOptions(pre_buffer=False)
        batches = fragment.to_batches(schema=self.schema, columns=self.columns, batch_size=batch_rows,
                                                  fragment_scan_options=options)
        while True:
            try:  # a file damaged after its footer fails here, in the middle of reading
                batch = next(batches, None)
            except (*_ARROW_READ_ERRORS, *store_error_types()) as exc:
                raise InputError(f"{path}: not a readable Parquet file: rows from {line} on cannot be read "
                                 f"({describe_store_error(exc)})") from None
            if batch is None:
                return
            if batch.num_rows == 0:
                continue
            table, errors = _valid_text(pa.Table.from_batches([batch]), path, line)
            yield InputBatch(path, line, table, errors, self.schema.names)
            line += table.num_rows


def _valid_text(table: pa.Table, path, first_line: int) -> tuple[pa.Table, list[str | None]]:
    """`table` with its text checked: a Parquet writer may store bytes that are not UTF-8 in a
    string column. Such a value is that row's error naming file, row and field, and is kept as
    text with `\\xNN` escapes (nested: as null), so that one row cannot stop the file. Only the
    columns the job reads are here (the scan's projection). Returns (table, row errors)."""
    errors: list[str | None] = [None] * table.num_rows
    for index, name in enumerate(table.column_names):
        column = table.column(index)
        if not _holds_text(column.type):
            continue
        try:
            column.validate(full=True)
            continue
        except pa.ArrowInvalid:
            pass
        column = column.combine_chunks()
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        bad = []
        for row in range(len(column)):
            try:
                column.take([row]).validate(full=True)  # a copy of the row alone (a slice keeps all child values)
            except pa.ArrowInvalid:
                bad.append(row)
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            raw = column.cast(pa.large_binary()).to_pylist()
            fixed = pa.array([None if v is None else v.decode("utf-8", "backslashreplace") for v in raw], column.type)
        else:
            import pyarrow.compute as pc

            wrong = pa.array([row in set(bad) for row in range(len(column))])
            fixed = pc.if_else(wrong, pa.nulls(len(column), column.type), column)
        table = table.set_column(index, name, fixed)
        for row in bad:
            errors[row] = errors[row] or f"{path}:{first_line + row}: invalid UTF-8 in field {name!r}"
    return table, errors


def _holds_text(kind: pa.DataType) -> bool:
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return True
    if pa.types.is_dictionary(kind):
        return _holds_text(kind.value_type)
    return any(_holds_text(kind.field(i).type) for i in range(kind.num_fields))


class _ExactRanges(pafs.FSSpecHandler):
    """An object-store filesystem for pyarrow whose files read exactly the byte ranges pyarrow asks
    for: fsspec's default read-ahead fetches whole blocks (s3fs: 50 MiB), so a projection of 4 of
    200 columns would download the whole file."""

    def open_input_file(self, path):
        return pa.PythonFile(self.fs.open(path, mode="rb", cache_type="none"), mode="r")


def _arrow_location(path) -> tuple[pafs.FileSystem | None, str]:
    """(pyarrow filesystem, path inside it): None and the resolved local path, or the store's
    fsspec filesystem wrapped for pyarrow and the bucket-relative path."""
    if not is_remote(path):
        return None, str(Path(path).resolve())
    upath = as_path(path)
    return pafs.PyFileSystem(_ExactRanges(upath.fs)), upath.path


def _unify(schemas: list[pa.Schema]) -> pa.Schema:
    """One schema for all files: each column's types promoted (int32 + int64 → int64, a null
    column → the other type), or read as text when they cannot be."""
    try:
        return pa.unify_schemas(schemas, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        pass
    fields: dict[str, list[pa.Field]] = {}
    for schema in schemas:
        for f in schema:
            fields.setdefault(f.name, []).append(f)
    unified = []
    for name, group in fields.items():
        try:
            unified.append(pa.unify_schemas([pa.schema([f]) for f in group], promote_options="permissive").field(0))
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            unified.append(pa.field(name, pa.string()))
    return pa.schema(unified)


def jsonl_batches(path: Path, batch_rows: int, convert=None, schema: pa.Schema | None = None,
                  columns: list[str] | None = None, json_columns: tuple[str, ...] = (),
                  field_names: Mapping[str, str] | None = None, unique_keys: bool = False) -> Iterator[InputBatch]:
    """Parse JSON Lines one line at a time so a bad line becomes a row error, not a lost file.
    `convert(value) -> (row, problem)` turns each parsed object into a row of `schema`.
    `columns`: the columns the job reads (None: all); a value that is not text (a lone UTF-16
    surrogate) is that row's error in those, and written as its `\\uXXXX` escape elsewhere.
    `json_columns`: kept as each line's own JSON text (see iter_batches). `field_names`: how
    error messages call a row's column (its place in the line, e.g. `body.messages`). `unique_keys`:
    a key written twice in one object of a line is that line's error (JSON readers keep the last
    silently; where a line's objects are read as a whole — a request body, questions — that would
    merge two definitions into one)."""
    rows: list[dict] = []
    errors: list[str | None] = []
    numbers: list[int] = []  # each row's line: blank lines are skipped, so rows need not be consecutive
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot open ({exc})") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            raw = without_bom(raw, number)
            if not raw.strip():
                continue  # blank lines are not rows
            row, error, bad_bytes = _parse_json_line(raw, path, number, unique_keys)
            if convert is not None:
                row, problem = convert(row) if error is None or row else ({}, None)  # row: its id stays
                error = error or (f"{path}:{number}: {problem}" if problem else None)
            if bad_bytes or _MAY_HOLD_SURROGATE.search(raw):
                row, error = _without_surrogates(row, error, path, number, columns,
                                                 field_names or {}, bad_bytes)
            for name in json_columns:
                if isinstance(row.get(name), (dict, list)):
                    row[name] = json.dumps(row[name], ensure_ascii=False)
            rows.append(row)
            errors.append(error)
            numbers.append(number)
            if len(rows) >= batch_rows:
                yield _line_batch(path, numbers, _rows_to_table(rows, path, schema), errors)
                rows, errors, numbers = [], [], []
    if rows:
        yield _line_batch(path, numbers, _rows_to_table(rows, path, schema), errors)


def _line_batch(path: Path, numbers: list[int], table: pa.Table, errors: list[str | None]) -> InputBatch:
    """A batch of lines `numbers`; their list is kept only where blank lines made gaps."""
    contiguous = numbers[-1] - numbers[0] == len(numbers) - 1
    return InputBatch(path, numbers[0], table, errors, lines=None if contiguous else list(numbers))


_UTF8_BOM = b"\xef\xbb\xbf"


def without_bom(raw: bytes, number: int) -> bytes:
    """A JSON Lines file's line `number` (1-based) without the UTF-8 byte order mark some Windows
    tools write at the start of a file: one rule for every reader of request lines (`run`'s
    readers and `serve`'s own checks), so a file one accepts the other reads the same."""
    return raw[len(_UTF8_BOM):] if number == 1 and raw.startswith(_UTF8_BOM) else raw

# JSON can write a lone UTF-16 surrogate (`"\\ud83d"`): valid JSON, but not text that UTF-8 (Arrow,
# Parquet, the tokenizer) can hold. Only a line with such an escape is searched for one.
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(row: dict, error: str | None, path: Path, number: int, columns: list[str] | None,
                        names: dict[str, str], bad_bytes: bool = False) -> tuple[dict, str | None]:
    """`row` with every lone surrogate written as its `\\uXXXX` escape (keys too), and the row's
    error: its own, else one naming the first column the job reads that held one (`names`: how
    messages call a column; `bad_bytes`: the line's surrogates stand for bytes that are not
    UTF-8). A column the job does not read never makes an error."""
    clean, dirty = {}, []
    for key, value in row.items():
        new_key, _ = _escaped(key)
        try:
            clean[new_key], changed = _escaped(value)
        except RecursionError:  # nested nearly as deep as JSON allows: the value cannot be kept
            clean[new_key], changed = None, True
        if changed or new_key != key:
            dirty.append(new_key)
    read = [key for key in dirty if columns is None or key in columns]
    if error is None and read:
        field = names.get(read[0], read[0])
        error = (f"{path}:{number}: invalid UTF-8 in field {field!r}" if bad_bytes else
                 f"{path}:{number}: field {field!r} holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape "
                 "without its pair), which is not text")
    return clean, error


def lone_surrogate_field(value) -> str | None:
    """Where a value parsed from JSON holds a lone UTF-16 surrogate, which is not text: the path of
    the first such string (`questions.team.criteria`, `input[0].content`; a key: its object's path
    and "(a key)"), or None. Iterative, so JSON nested as deep as the parser allows is fine."""
    stack = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "the value"
        elif isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and _SURROGATE.search(key):
                    return f"{path or 'the object'} (a key)"
            stack.extend((f"{path}.{key}" if path else str(key), v) for key, v in reversed(list(item.items())))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def _escaped(value):
    """(value with lone surrogates as `\\uXXXX` text, whether it had any); recursive."""
    if isinstance(value, str):
        if _SURROGATE.search(value) is None:
            return value, False
        return value.encode("utf-8", "backslashreplace").decode("utf-8"), True
    if isinstance(value, list):
        items = [_escaped(v) for v in value]
        return [v for v, _ in items], any(c for _, c in items)
    if isinstance(value, dict):
        items = [(_escaped(k), _escaped(v)) for k, v in value.items()]
        return {k: v for (k, _), (v, _) in items}, any(ck or cv for (_, ck), (_, cv) in items)
    return value, False


def unique_object(pairs: list) -> dict:
    """A `json.loads` object_pairs_hook: the object, unless a key appears in it twice."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen = set()
        raise DuplicateKeyError(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return value


def _parse_json_line(raw: bytes, path: Path, number: int, unique_keys: bool = False) -> tuple[dict, str | None, bool]:
    """(the line's object, its error, whether it held bytes that are not UTF-8). Such bytes inside
    a string become lone surrogates (surrogateescape): only a field the job reads fails for them.
    `unique_keys`: a key twice in one object is the line's error, naming the key."""
    bad_bytes, unreadable = False, None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        text, bad_bytes = raw.decode("utf-8", "surrogateescape"), True
        unreadable = f"{path}:{number}: invalid UTF-8 ({exc.reason} at byte {exc.start})"
    try:
        value = json.loads(text, object_pairs_hook=unique_object) if unique_keys else json.loads(text)
    except DuplicateKeyError as exc:  # the line read as JSON readers do (its id kept), with its error
        key, value = _escaped(exc.args[0])[0], json.loads(text)
        return value if isinstance(value, dict) else {}, (
            f"{path}:{number}: key {key!r} appears twice in one JSON object; a JSON reader keeps only the "
            "last, so the line is refused"), bad_bytes
    except json.JSONDecodeError as exc:
        return {}, unreadable or f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})", False
    except RecursionError:
        return {}, f"{path}:{number}: JSON nested too deeply to read", False
    if not isinstance(value, dict):
        return {}, unreadable or f"{path}:{number}: expected a JSON object, got {type(value).__name__}", False
    return value, None, bad_bytes


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
        except (pa.ArrowException, OverflowError, ValueError, TypeError):
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
