"""A Parquet output written hive-style (`output.partition_by`): `<output>/<column>=<value>/part-….parquet`,
by pyarrow's dataset writer, exactly once.

The dataset is written under a temporary folder beside the output whose name starts with `_`
(`_<output>.writing-…`), which pyarrow.dataset, Spark and Hive skip, its files named
`….parquet.unfinished` while they are written (DuckDB's `**` glob descends into `_` folders: a
`<parent>/**/*.parquet` reader sees them only in the milliseconds between their renames and the
folder's), then renamed into place in one step (an earlier output at that path is swapped out atomically where Linux can,
`renameat2`'s RENAME_EXCHANGE): a reader of the output folder sees no row while a run writes it,
and every row once it is there. A run killed while writing leaves only its temporary folder, which
the next write removes (it holds the output's lock, so no other writer is alive).

Each file's schema records the whole output schema (SCHEMA_KEY: the partition columns' types and
the column order, which the folder names alone lose) and the partition columns (PARTITION_KEY), so
`read_dataset` gives back the table that was written — in partition order, not row order
(`in_row_order` restores it by the id column).
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from batchscore.faults import fault_point
from batchscore.io.atomic import UMASK, fsync_folder
from batchscore.output.table import PARTITION_KEY  # JSON list of the partition columns

SCHEMA_KEY = "batchscore.schema"  # base64 of the whole output's Arrow schema (without its metadata)
_WRITING = ".writing-"  # `_<output>.writing-XXXX`: a write under way (or one a killed run left)
_UNFINISHED = ".unfinished"  # a data file's suffix until its folder is complete: no `*.parquet` glob matches it


# ---------------------------------------------------------------------------- writing

def is_partitioned(path) -> bool:
    """`path` is a local folder: a partitioned output (an object-store output is one file)."""
    from batchscore.io.storage import is_remote

    return not is_remote(path) and Path(os.fspath(path)).is_dir()


def write_table(table: pa.Table, path, partition_by: list[str]) -> Path:
    """Write `table` as the hive-partitioned dataset `path`, exactly once (see the module)."""
    return write_folder(path, lambda folder: DatasetWindowWriter(folder, table.schema, partition_by).write_table(table))


class DatasetWindowWriter:
    """The partitioned dataset written window by window (run/assemble.py): each window's rows go to
    their partitions' folders as files of their own (`part-<window>-<n>.parquet`), rows in order."""

    def __init__(self, folder, schema: pa.Schema, partition_by: list[str]) -> None:
        nested = [name for name in partition_by if pa.types.is_nested(schema.field(name).type)]
        if nested:
            from batchscore.errors import OutputError

            raise OutputError(f"output.partition_by: the column {nested[0]!r} holds "
                              f"{schema.field(nested[0]).type} values; a folder name holds one plain value")
        self.folder = os.fspath(folder)
        self.schema = _recorded(schema, partition_by)
        self.partitioning = ds.partitioning(pa.schema([schema.field(name) for name in partition_by]), flavor="hive")
        self.windows = 0

    def write_table(self, table: pa.Table) -> None:
        table = table.replace_schema_metadata(self.schema.metadata)
        ds.write_dataset(table, self.folder, format="parquet", partitioning=self.partitioning,
                         basename_template=f"part-{self.windows:05d}-{{i}}.parquet{_UNFINISHED}", preserve_order=True,
                         existing_data_behavior="overwrite_or_ignore", max_partitions=max(1024, table.num_rows))
        self.windows += 1

    def close(self) -> None:
        """Nothing stays open between windows."""


def _recorded(schema: pa.Schema, partition_by: list[str]) -> pa.Schema:
    """`schema` with SCHEMA_KEY and PARTITION_KEY added to its metadata."""
    whole = base64.b64encode(schema.remove_metadata().serialize().to_pybytes()).decode()
    return schema.with_metadata({**(schema.metadata or {}), PARTITION_KEY.encode(): json.dumps(partition_by).encode(),
                                 SCHEMA_KEY.encode(): whole.encode()})


def write_folder(path, write: Callable[[str], object]) -> Path:
    """Call `write(folder)` on a new temporary folder beside `path`, make its files durable and
    rename it to `path` (an earlier file or folder there is replaced, then removed)."""
    path = Path(os.fspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"_{path.name}{_WRITING}*"):  # a killed run's: the caller holds the lock
        _remove(stale)
    tmp = Path(tempfile.mkdtemp(prefix=f"_{path.name}{_WRITING}", dir=path.parent))
    try:
        write(str(tmp))
        os.chmod(tmp, 0o777 & ~UMASK)  # mkdtemp makes 0700; an output folder follows the umask
        _fsync_tree(tmp)
        fault_point("dataset")
        _finish_names(tmp)
        if not path.exists() and not path.is_symlink():
            os.rename(tmp, path)
        elif _exchange(tmp, path):  # the new output in place, the old one (or a link planted there) at tmp
            _remove(tmp)
        else:  # no atomic swap here: the output is absent for a moment, never mixed
            old = path.with_name(f"_{path.name}{_WRITING}old")
            os.rename(path, old)
            os.rename(tmp, path)
            _remove(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_folder(path.parent)
    return path


def _finish_names(folder: Path) -> None:
    """`….parquet.unfinished` -> `….parquet` below `folder`: every file written and durable."""
    for root, _, names in os.walk(folder):
        for name in names:
            if name.endswith(_UNFINISHED):
                os.rename(os.path.join(root, name), os.path.join(root, name[:-len(_UNFINISHED)]))
        fsync_folder(Path(root))  # the new names as durable as the data


def _remove(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a folder and everything below it."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where that is not there."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_tree(folder: Path) -> None:
    for root, _, names in os.walk(folder):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_folder(Path(root))




# ---------------------------------------------------------------------------- reading

def data_files(path) -> list[Path]:
    """The dataset's Parquet files, sorted; names starting with `_` or `.` are not data (as the
    dataset readers skip them)."""
    root = Path(os.fspath(path))
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(("_", ".")))
        found += [Path(folder) / n for n in names if n.endswith(".parquet") and not n.startswith(("_", "."))]
    return sorted(found)


def read_dataset(path) -> pa.Table:
    """The partitioned output at `path` read back whole, with the columns, types and schema
    metadata it was written with (rows in partition order). Raises ValueError for a folder that
    is not a batchscore partitioned output."""
    files = data_files(path)
    if not files:
        raise ValueError(f"{path} is a folder without Parquet files")
    metadata = pq.read_schema(files[0]).metadata or {}
    if SCHEMA_KEY.encode() not in metadata:
        raise ValueError(f"{path} is a folder of Parquet files that no partitioned batchscore output wrote "
                         f"(no {SCHEMA_KEY} in {files[0].name})")
    whole = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(metadata[SCHEMA_KEY.encode()])))
    partition_by = json.loads(metadata[PARTITION_KEY.encode()])
    partitioning = ds.partitioning(pa.schema([whole.field(name) for name in partition_by]), flavor="hive")
    dataset = ds.dataset([str(f) for f in files], schema=whole, format="parquet", partitioning=partitioning,
                         partition_base_dir=str(path))
    return dataset.to_table().replace_schema_metadata(metadata)


def in_row_order(table: pa.Table, id_name: str, ids: pa.Array) -> pa.Table | None:
    """`table`'s rows in the order of `ids` (unique), matched by the id column; None when the
    table does not hold exactly those ids."""
    import pyarrow.compute as pc

    if table.num_rows != len(ids) or id_name not in table.column_names:
        return None
    at = pc.index_in(ids, value_set=table.column(id_name).combine_chunks())
    if at.null_count:
        return None
    return table.take(at)


def output_size(path) -> int:
    """The bytes of the dataset's files."""
    return sum(f.stat().st_size for f in data_files(path))


def output_digest(path) -> str:
    """sha256 over the dataset's files: each one's path below `path` and its content's sha256."""
    root, whole = Path(os.fspath(path)), hashlib.sha256()
    for file in data_files(root):
        own = hashlib.sha256()
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                own.update(block)
        whole.update(f"{file.relative_to(root).as_posix()}\0{own.hexdigest()}\n".encode())
    return whole.hexdigest()


def foreign_entry(path) -> str | None:
    """Something in the folder `path` that a partitioned output does not hold (a file beside the
    partition folders, a folder not named `<column>=<value>`), which replacing it would destroy;
    None for an empty folder or a partitioned output."""
    root = Path(os.fspath(path))
    for folder, dirs, names in os.walk(root):
        for d in dirs:
            if "=" not in d:
                return str(Path(folder, d).relative_to(root))
        for n in names:
            if folder == str(root) or not n.endswith(".parquet"):
                return str(Path(folder, n).relative_to(root))
    return None


# ---------------------------------------------------------------------------- the job file

def partition_problems(config, wire) -> list[str]:
    """What `output.partition_by` refuses of a job (`wire`: its output's WireFormat): a column the
    output does not write as one plain value a row (only the id, a kept column, `label`, `choice`
    and `status` are), a column named twice, an output that is not a local Parquet one, a job of
    neither fixed labels nor per-row choices (questions jobs: not built)."""
    from batchscore.io.storage import is_remote
    from batchscore.output.layout import CHOICE, DEFAULT_ID, LABEL, STATUS

    by = config.output.partition_by
    if not by:
        return []
    if not (config.labels or config.input.choices_column) or config.questions is not None:
        return ["output.partition_by: partitions the output of a labels or choices job (questions jobs: not built)"]
    problems = []
    if not getattr(wire, "dataset", False):  # a format read as one Arrow dataset: Parquet
        problems.append(f"output.partition_by: a partitioned output is Parquet; output.format is {config.output_format}")
    if config.output.path and is_remote(config.output.path):
        problems.append(f"output.partition_by: a partitioned output is a local folder, renamed into place when "
                        f"complete; {config.output.path} is in an object store (not built)")
    allowed = [config.input.id_column or DEFAULT_ID, *config.output.keep_columns,
               CHOICE if config.input.choices_column else LABEL, STATUS]
    for name in dict.fromkeys(by):
        if by.count(name) > 1:
            problems.append(f"output.partition_by: {name!r} is named {by.count(name)} times")
        if name not in allowed:
            problems.append(f"output.partition_by: {name!r} is not an output column to partition by; give the id "
                            f"column, a kept column (output.keep_columns) or a label column: {', '.join(allowed)}")
    return problems
