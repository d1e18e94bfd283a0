"""Tables as inputs: `input.format: delta` (a Delta Lake table's folder, read with `deltalake`) and
`input.format: iceberg` (a table of an Iceberg catalog, read with `pyiceberg`'s scan).

The rows of a table are its content at one version: the Delta version or the Iceberg snapshot the
job opens with (`input.version`, else the table's current one), pinned when the job is opened, so
the run identity (which records it) and every later read of the rows see the same content, even if
a writer commits meanwhile. A table is one "file" of the input: a `TablePath` (the table's folder,
carrying its `TableSource`), read as Arrow record batches of `input.batch_rows` rows with only the
columns the job uses. Row numbers in messages count the table's rows from 1, in scan order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa

from batchscore.errors import InputError
from batchscore.io.iceberg_catalog import load_iceberg_catalog, load_iceberg_table
from batchscore.io.readers import InputBatch
from batchscore.io.storage import is_url


@dataclass(frozen=True)
class TableSource:
    """One table at one version (`version`: a Delta version, an Iceberg snapshot id); `location`:
    where its files are. A subclass per table format reads it (`scan`)."""

    location: str
    version: int

    kind = ""  # the run identity's name of the table format
    name = ""  # the table in words, for messages

    def identity(self) -> dict[str, Any]:
        """What the run identity records of the input: which table at which version (a new commit
        is another version or snapshot, so another input)."""
        return {"table": self.kind, "location": self.location, "version": self.version}

    def scan(self, columns: list[str] | None):
        """(the record batches of `columns` it has, None: all; every column name it has)."""
        raise NotImplementedError

    def batches(self, path: Path, batch_rows: int, columns: list[str] | None) -> Iterator[InputBatch]:
        """The table's rows at its version, `batch_rows` at a time, with only `columns` (None: all)
        of those it has; every batch names all the table's columns (`available`)."""
        line = 1
        try:
            reader, names = self.scan(columns)
            for batch in _rebatched(reader, batch_rows):
                yield InputBatch(path, line, pa.Table.from_batches([batch]), [None] * batch.num_rows, names)
                line += batch.num_rows
        except InputError:
            raise
        except Exception as exc:  # noqa: BLE001 - the table library's own: a vacuumed file, a feature it cannot read
            raise InputError(f"input: cannot read {self.name} (version {self.version}) from row {line} on: "
                             f"{exc}") from None


@dataclass(frozen=True)
class DeltaSource(TableSource):
    """A Delta Lake table: its folder or URL (`location`), the store's options."""

    storage_options: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    kind = "delta"

    @property
    def name(self) -> str:
        return f"the Delta table {self.location}"

    def scan(self, columns: list[str] | None):
        from deltalake import DeltaTable

        table = DeltaTable(self.location, version=self.version, storage_options=_options(self.storage_options))
        dataset = table.to_pyarrow_dataset()
        names = dataset.schema.names
        return dataset.to_batches(columns=names if columns is None else [c for c in columns if c in names]), names


@dataclass(frozen=True)
class IcebergSource(TableSource):
    """A table of an Iceberg catalog: `identifier` in `catalog` (`location`: where the catalog says
    its files are)."""

    identifier: str = ""
    catalog: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # may hold credentials
    kind = "iceberg"

    @property
    def name(self) -> str:
        return f"the Iceberg table {self.identifier}"

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), "identifier": self.identifier}

    def scan(self, columns: list[str] | None):
        catalog = load_iceberg_catalog(self.catalog, "input.catalog", InputError)
        table = load_iceberg_table(catalog, self.identifier, "input.identifier", InputError)
        if table is None:
            raise InputError(f"input.identifier: the Iceberg table {self.identifier} is gone from its catalog")
        names = [f.name for f in table.scan(snapshot_id=self.version).projection().fields]
        wanted = names if columns is None else [c for c in columns if c in names]
        reader = table.scan(snapshot_id=self.version, selected_fields=tuple(wanted) or ("*",)).to_arrow_batch_reader()
        return (reader if wanted else (batch.select([]) for batch in reader)), names


class TablePath(type(Path())):  # noqa: the concrete Path class of this platform
    """A table as the input's one file: its folder (as a path), carrying the `TableSource` it is
    read through (`.table`); pickles with it."""

    table: TableSource

    def __reduce__(self):
        return _table_path, (str(self), self.table)


def _table_path(location: str, table: TableSource) -> TablePath:
    path = TablePath(location)
    path.table = table
    return path


def delta_input(inp) -> list[tuple[Path, str]]:
    """`input.format: delta`: the table at `input.path`, at `input.version` or its current one."""
    try:
        from deltalake import DeltaTable
        from deltalake.exceptions import TableNotFoundError
    except ImportError as exc:
        raise InputError(f"input.format delta: reading a Delta table needs the deltalake package "
                         f"(pip install 'batchscore[delta]'): {exc}") from None
    location = str(inp.path) if is_url(inp.path) else str(Path(inp.path).expanduser().resolve())
    try:
        table = DeltaTable(location, storage_options=_options(inp.storage_options))
    except TableNotFoundError:
        raise InputError(f"input.path: {location} is not a Delta table (no _delta_log folder with a commit)") from None
    except Exception as exc:  # noqa: BLE001 - a store that cannot be reached, a log that cannot be read
        raise InputError(f"input.path: cannot open the Delta table {location}: {exc}") from None
    current = table.version()
    version = current if inp.version is None else inp.version
    if not 0 <= version <= current:
        raise InputError(f"input.version: the Delta table {location} has no version {version} "
                         f"(its versions: 0 to {current})")
    source = DeltaSource(location, version, storage_options=dict(inp.storage_options))
    return [(_table_path(location, source), "delta")]


def iceberg_input(inp) -> list[tuple[Path, str]]:
    """`input.format: iceberg`: the table `input.identifier` of `input.catalog`, at the snapshot
    `input.version` or its current one."""
    catalog = load_iceberg_catalog(inp.catalog, "input.catalog", InputError)
    table = load_iceberg_table(catalog, inp.identifier, "input.identifier", InputError)
    if table is None:
        raise InputError(f"input.identifier: the Iceberg catalog {inp.catalog.get('name', 'default')!r} has no "
                         f"table {inp.identifier!r}")
    if inp.version is None:
        snapshot = table.current_snapshot()
        if snapshot is None:
            raise InputError(f"input.identifier: the Iceberg table {inp.identifier} has no snapshot yet (no rows)")
    else:
        snapshot = table.snapshot_by_id(inp.version)
        if snapshot is None:
            known = [s.snapshot_id for s in table.snapshots()][-5:]
            raise InputError(f"input.version: the Iceberg table {inp.identifier} has no snapshot {inp.version} "
                             f"(its latest: {known})")
    location = table.metadata.location
    source = IcebergSource(location, snapshot.snapshot_id, inp.identifier, dict(inp.catalog))
    return [(_table_path(location.removeprefix("file://"), source), "iceberg")]


def _rebatched(batches, rows: int) -> Iterator[pa.RecordBatch]:
    """The scan's record batches, none longer than `rows` (a longer one cut; empty ones left out)."""
    for batch in batches:
        for start in range(0, batch.num_rows, rows):
            yield batch.slice(start, rows)


def _options(options: dict) -> dict | None:
    return {k: str(v) for k, v in options.items()} or None
