"""What a run's output depends on, cheaply fingerprinted, so a resume never mixes two of them.

A resume (and the completion marker) compares four parts: the job's scoring configuration, the
input files' content, the model folder's files, and the software versions. Content, not names
and times: a model folder swapped in place, or an input edited in place with its size and mtime
kept, is still noticed.

Cost: files up to FULL_HASH_BYTES are hashed whole; a larger Parquet file by its footer (row
groups, row counts, column statistics and offsets) and size; any other large input (JSONL, CSV,
an OpenAI Batch file) is hashed whole, streaming (its rows are read anyway, and an edit in its
middle must count); a large weight file by its size and three 1 MiB
samples (start, middle, end). An object in a store (io/storage.py) other than JSONL: by what the
store says of it (ETag, MD5 or CRC), its size and, for Parquet, its footer — never downloaded whole.

A local Parquet file or a JSON Lines file of a table job is fingerprinted column by column
instead (`input_identities`): the columns the scores are made from (prompt fields, options, token
ids, row ids) give the scoring identity, and the columns only assembly reads (truth and kept
columns) an assembly identity of their own. Editing a truth or kept value then leaves every scored
part valid: the run only assembles again. Each column's digest is over its decoded values
(output/column_digest.py): a Parquet file's read column by column, a JSON Lines file's as its
format's reader decodes them, batch by batch, with the lines it cannot read (their positions and
messages) in the scoring identity, since they decide which rows are scored. It costs reading
those columns once more, so a JSON Lines file is read so only when the job has a truth or kept
column no prompt reads (else its bytes, far cheaper, say as much). An OpenAI Batch file's lines are
its requests: fingerprinted whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.errors import InputError
from batchscore.io.storage import as_path, file_size, is_remote
from batchscore.output.column_digest import ColumnDigest

# The run identity's version: bumped when what it records changes, so that no output or parts
# folder written under another version is taken as this job's (docs/operations.md). 2: every
# scoring key recorded by its rule (config.py `key`), defaults included; kept columns are assembly.
IDENTITY_VERSION = 2
FULL_HASH_BYTES = 64 * 2**20
_UNREAD = ("unread",)  # the key of a line file's unreadable lines beside its columns' digests (no column name)
SAMPLE_BYTES = 2**20


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(4 * 2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sampled_digest(path: Path, size: int) -> str:
    """Size plus three samples of a large file."""
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as handle:
        for offset in (0, max(size // 2 - SAMPLE_BYTES // 2, 0), max(size - SAMPLE_BYTES, 0)):
            handle.seek(offset)
            digest.update(handle.read(SAMPLE_BYTES))
    return "sampled:" + digest.hexdigest()


def _parquet_footer_digest(path: Path, size: int) -> str:
    """Size plus the Parquet footer (metadata: row groups, row counts, statistics, offsets)."""
    with path.open("rb") as handle:
        handle.seek(size - 8)
        tail = handle.read(8)
        if tail[4:] != b"PAR1":
            return _sampled_digest(path, size)  # not a Parquet file: reading it will say so
        footer_len = int.from_bytes(tail[:4], "little")
        handle.seek(max(size - 8 - footer_len, 0))
        footer = handle.read(footer_len)
    return "footer:" + hashlib.sha256(str(size).encode() + footer).hexdigest()


def _store_digest(path, fmt: str | None) -> str:
    """An object's fingerprint from what the store says of it (its ETag / MD5 / CRC: content
    hashes on S3 and GCS, a version tag on Azure) and size, plus a Parquet file's footer: no
    download of the object."""
    info = path.fs.info(path.path)
    size = int(info["size"])
    tag = next((str(info[k]) for k in ("ETag", "etag", "md5Hash", "crc32c", "content_md5") if info.get(k)), "")
    footer = _parquet_footer_digest(path, size) if fmt == "parquet" else ""
    return "store:" + hashlib.sha256(f"{size}|{tag}|{footer}".encode()).hexdigest()


def file_digest(path: str | os.PathLike, fmt: str | None = None) -> str:
    """A content fingerprint of one file (see the module docstring for what is read)."""
    path = as_path(path)
    if is_remote(path) and fmt != "jsonl":
        return _store_digest(path, fmt)
    size = file_size(path)
    if fmt == "parquet" and size > FULL_HASH_BYTES:
        return _parquet_footer_digest(path, size)
    if size <= FULL_HASH_BYTES or fmt is not None:
        return _sha256_file(path)  # an input of lines (JSONL, CSV, a Batch file): an edit anywhere counts
    return _sampled_digest(path, size)  # a large weight file


def input_identity(files: list[tuple[Path, str]]) -> list[dict]:
    """One entry per input file: its resolved path, size and content fingerprint; a table
    (io/table_inputs.TablePath) by its location and version instead."""
    return [_table_entry(f) if hasattr(f, "table") else
            {"file": str(f) if is_remote(f) else str(Path(f).resolve()), "size": file_size(f),
             "digest": file_digest(f, fmt)}
            for f, fmt in files]


def _table_entry(path) -> dict:
    """A table input: the Delta version or Iceberg snapshot it is read at names its content (a
    commit makes another), so its rows are not read for the identity."""
    return {"file": str(path), **path.table.identity()}


def input_identities(files: list[tuple[Path, str]], scoring: list[str] | None, assembly: list[str],
                     read_lines: Callable[[Path, str, list[str]], Iterable | None] | None = None
                     ) -> tuple[list[dict], list[dict]]:
    """(the scoring identity of the input, its assembly identity).

    `scoring`: the columns the scores are made from (None: every file whole, as `input_identity`);
    `assembly`: the columns only assembly reads. A local Parquet file, and where `assembly` names
    any a file `read_lines(path, format, columns)` reads (its batches, io/readers.InputBatch; None:
    it does not), get one entry per file with its row count and each named column's digest (None for a column the file lacks:
    a hive partition's, or one the reader will refuse); any other file is fingerprinted whole in
    the scoring identity, so an edit anywhere in it is a different job."""
    if scoring is None:
        return input_identity(files), []
    score_part, assembly_part = [], []
    named = list(dict.fromkeys(scoring + assembly))
    for path, fmt in files:
        if hasattr(path, "table"):
            score_part.append(_table_entry(path))
            continue
        if fmt == "parquet" and not is_remote(path):
            digests = _parquet_columns(path, named)
        else:
            # a line file without assembly columns: its bytes say as much, far cheaper than parsing it
            batches = read_lines(path, fmt, named) if read_lines is not None and assembly else None
            digests = _line_columns(batches, named) if batches is not None else None
        if digests is None:
            score_part.extend(input_identity([(path, fmt)]))
            continue
        name, rows = str(path) if is_remote(path) else str(Path(path).resolve()), digests.pop(None)
        unread = digests.pop(_UNREAD, None)
        entry = {"file": name, "rows": rows, "columns": {c: digests[c] for c in scoring}}
        score_part.append({**entry, "unread": unread} if unread else entry)
        if assembly:
            assembly_part.append({"file": name, "columns": {c: digests[c] for c in assembly}})
    return score_part, assembly_part


def _parquet_columns(path: Path, columns: list[str]) -> dict | None:
    """Each of `columns`' digest (None: not in the file) and, under the key None, the row count;
    None when the file cannot be read as Parquet (reading it will say why, naming it)."""
    try:
        # pre_buffer off: with it the file caches every row group it has read until it is closed
        # (~100 bytes a row of a token-id input: 1 GB held at 10M rows); without it the reader
        # holds a row group at a time (io/readers.py reads rows the same way)
        parquet = pq.ParquetFile(str(path), pre_buffer=False)
        present = [c for c in dict.fromkeys(columns) if c in parquet.schema_arrow.names]
        digests = {c: ColumnDigest() for c in present}
        for batch in parquet.iter_batches(batch_size=65536, columns=present, use_threads=False):
            for name in present:
                digests[name].update(batch.column(name))
        rows = parquet.metadata.num_rows
    except (pa.ArrowException, OSError, ValueError, KeyError):  # duplicate names too: read whole
        return None
    found = {c: digests[c].hexdigest() if c in digests else None for c in columns}
    return {**found, None: rows}


def _line_columns(batches: Iterable, columns: list[str]) -> dict | None:
    """As `_parquet_columns`, over a line file's batches as its reader decodes them; under
    `_UNREAD` a digest of the lines read with an error (position and message: such a row is not
    scored), None when every line reads. A batch without a column (no line of it has the key) counts
    as nulls there. None when the file cannot be read (reading it will say why)."""
    digests = {c: ColumnDigest() for c in columns}
    seen: set[str] = set()
    unread, failed, rows = hashlib.sha256(), False, 0
    try:
        for batch in batches:
            table = batch.table
            for name in columns:
                present = name in table.column_names
                seen |= {name} if present else set()
                digests[name].update(table.column(name) if present else pa.nulls(table.num_rows))
            for offset, error in enumerate(batch.row_errors):
                if error:
                    unread.update(f"{rows + offset}\t{error}\n".encode())
                    failed = True
            rows += table.num_rows
    except (InputError, OSError):
        return None
    found = {c: digests[c].hexdigest() if c in seen else None for c in columns}
    return {**found, None: rows, _UNREAD: unread.hexdigest() if failed else None}


def model_identity(model_dir: str | os.PathLike | None) -> dict[str, str]:
    """Every file of the model folder (weights, config, tokenizer): relative name -> fingerprint."""
    if model_dir is None:
        return {}
    root = Path(model_dir)
    return {str(p.relative_to(root)): file_digest(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def software_versions(engine_kind: str) -> dict[str, str]:
    """Versions of the packages that compute the scores."""
    from batchscore.engines.registry import get_kind

    names = ["batchscore", "torch", "transformers", *get_kind(engine_kind).distributions]
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def identity_hash(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _input_change(name: str, before: dict, now: dict) -> str:
    """One input file's change in words: the columns that changed where both name columns."""
    if "table" in before and "table" in now:
        return f"input table {name} changed (version {before.get('version')} → {now.get('version')})"
    if "columns" not in before or "columns" not in now:
        return f"input file {name} changed"
    if before.get("rows") != now.get("rows"):
        return f"input file {name} changed ({before.get('rows')} rows → {now.get('rows')})"
    if before.get("unread") != now.get("unread"):
        return f"input file {name} changed (which lines can be read)"
    columns = [c for c in sorted(set(before["columns"]) | set(now["columns"]))
               if before["columns"].get(c) != now["columns"].get(c)]
    named = f"column{'s' if len(columns) > 1 else ''} {', '.join(repr(c) for c in columns)}"
    return f"input file {name} changed ({named})" if columns else f"input file {name} changed"


def _changed_keys(before, now, prefix: str = "") -> list[str]:
    """Each job key whose value differs between two recorded configurations, as `key: old → new`
    (dotted, e.g. `engine.threads: 2 → 1`), so a refused resume names what changed."""
    if isinstance(before, dict) and isinstance(now, dict):
        found = []
        for key in sorted(set(before) | set(now), key=str):
            found += _changed_keys(before.get(key), now.get(key), f"{prefix}{key}.")
        return found
    if before == now:
        return []
    text = lambda value: repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "…"  # noqa: E731
    return [f"{prefix.rstrip('.')}: {text(before)} → {text(now)}"]


def describe_changes(before: dict, now: dict) -> list[str]:
    """What differs between two identities, in words (for a refused resume)."""
    changes = []
    if before.get("version") != now.get("version"):
        changes.append(f"the run identity's version ({before.get('version', 1)} → {now.get('version', 1)}: "
                       "this batchscore records a job's identity differently)")
    if before.get("config") != now.get("config"):
        keys = _changed_keys(before.get("config"), now.get("config"))
        shown = "; ".join(keys[:3]) + (f"; … ({len(keys)} keys)" if len(keys) > 3 else "")
        changes.append(f"the job configuration ({shown})" if keys else "the job configuration")
    old_inputs = {e["file"]: e for e in before.get("input", [])}
    new_inputs = {e["file"]: e for e in now.get("input", [])}
    for name in sorted(set(old_inputs) | set(new_inputs)):
        if name not in new_inputs:
            changes.append(f"input file {name} is gone")
        elif name not in old_inputs:
            changes.append(f"input file {name} is new")
        elif old_inputs[name] != new_inputs[name]:
            changes.append(_input_change(name, old_inputs[name], new_inputs[name]))
    old_model, new_model = before.get("model", {}), now.get("model", {})
    if before.get("model_path") != now.get("model_path"):
        changes.append(f"the model ({before.get('model_path')} → {now.get('model_path')})")
    for name in sorted(set(old_model) | set(new_model)):
        if old_model.get(name) != new_model.get(name):
            changes.append(f"model file {name} changed")
    for name in sorted(set(before.get("software", {})) | set(now.get("software", {}))):
        old, new = before.get("software", {}).get(name), now.get("software", {}).get(name)
        if old != new:
            changes.append(f"{name} {old} → {new}")
    old_engine, new_engine = before.get("engine"), now.get("engine")
    if isinstance(old_engine, dict) and isinstance(new_engine, dict):
        for key in sorted(set(old_engine) | set(new_engine)):
            if old_engine.get(key) != new_engine.get(key):
                changes.append(f"the resolved engine.{key} ({old_engine.get(key)} → {new_engine.get(key)})")
    elif old_engine != new_engine:
        changes.append(f"the engine ({old_engine} → {new_engine})")
    return changes or ["the number of workers or shards, or how rows are placed on them (parts of an older batchscore)"]
