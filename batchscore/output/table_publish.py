"""`output.table`: the night's finished output published to a Delta Lake table (the `deltalake`
package), exactly once; `format: iceberg` publishes to an Iceberg table instead, the same way
(output/iceberg_table.py).

The run writes its output as always (a Parquet file, resumable, with its completion marker); once
it is complete, before the marker, its rows are committed to the table: merged by the id column
(rows of the same id updated, new ids inserted), appended, or overwriting the table. The commit
carries the run's identity (`batchscore.run`) and lineage (model, batchscore version, output,
rows) as commit metadata; a run that finds its identity among the table's recent commits commits
nothing (it was published: a run killed after its commit and resumed, or rerun). Delta's commit is
atomic, so a run killed before or during its commit leaves the table at its last version and the
resumed run commits once. Every version stays readable (Delta's time travel), and the table's
data files are Parquet that Spark, DuckDB and Trino read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from batchscore.errors import OutputError
from batchscore.faults import fault_point
from batchscore.output import iceberg_table

log = logging.getLogger("batchscore")

MODES = ("merge", "append", "overwrite")
RUN_KEY = "batchscore.run"
RECENT_COMMITS = 50  # a run resumed the same night finds its commit among these


def table_problems(table_config) -> list[str]:
    """What the job file's `output.table` lacks or mixes up (each table format's own rules; an
    unknown format is refused by the job file's allowed values)."""
    found = _FORMATS.get(table_config.format)
    return found.problems(table_config) if found is not None else []


def table_place(table_config, version: int) -> str:
    """Where the table holds a published output, in words: `version 3 of the Delta table`."""
    return _FORMATS[table_config.format].place(table_config, version)


def publish(table_config, output, id_name: str, run: str, lineage: dict[str, str],
            storage_options: dict | None = None, read_output=None) -> int:
    """Commit the finished `output` (read back by its format's `read_output`) to the table
    `table_config` names; returns the Delta table version (the Iceberg snapshot id) that holds it
    (the existing one when this run was published already)."""
    return _FORMATS[table_config.format].publish(table_config, output, id_name, run, lineage, storage_options,
                                                 read_output)


def _delta_problems(table_config) -> list[str]:
    problems = [] if table_config.path else ["output.table.path: the Delta table to publish the output to (a folder "
                                             "or a URL)"]
    if table_config.catalog or table_config.identifier:
        problems.append("output.table.catalog / identifier: name an Iceberg table; set output.table.format: "
                        "iceberg (a Delta table is output.table.path)")
    return problems


def _delta_place(table_config, version: int) -> str:
    return f"version {version} of the Delta table"


def _publish_delta(table_config, output, id_name: str, run: str, lineage: dict[str, str],
                   storage_options: dict | None = None, read_output=None) -> int:
    try:
        from deltalake import CommitProperties, DeltaTable, write_deltalake
        from deltalake.exceptions import TableNotFoundError
    except ImportError as exc:
        raise OutputError(f"output.table: publishing to Delta Lake needs the deltalake package "
                          f"(pip install 'batchscore[delta]'): {exc}") from None
    path, options = str(table_config.path), dict(storage_options or {}) or None
    try:
        existing = DeltaTable(path, storage_options=options)
    except TableNotFoundError:
        existing = None
    if existing is not None:
        for commit in existing.history(RECENT_COMMITS):
            if commit.get(RUN_KEY) == run:
                log.info("output.table: %s already holds this run (version %s): nothing committed", path,
                         commit.get("version"))
                return int(commit["version"])
    if read_output is None:
        raise OutputError(f"output.table: {output} is in a format that is not read back into a table; write "
                          "the output as Parquet")
    rows = read_output(output)
    rows = rows.replace_schema_metadata(None)  # the Parquet file's lineage goes to the commit instead
    missing = [c for c in table_config.partition_by if c not in rows.column_names]
    if missing:
        raise OutputError(f"output.table.partition_by: {missing} are not columns of the output "
                          f"(it has {rows.column_names}); keep them with output.keep_columns")
    commit = CommitProperties(custom_metadata={RUN_KEY: run, **lineage})
    fault_point("table")
    try:
        if existing is None or table_config.mode == "overwrite":
            write_deltalake(path, rows, mode="overwrite", partition_by=table_config.partition_by or None,
                            commit_properties=commit, storage_options=options,
                            schema_mode="overwrite" if existing is not None else None)
        elif table_config.mode == "append":
            write_deltalake(path, rows, mode="append", commit_properties=commit, storage_options=options)
        else:
            (existing.merge(rows, predicate=f't."{id_name}" = s."{id_name}"', source_alias="s", target_alias="t",
                            commit_properties=commit)
             .when_matched_update_all().when_not_matched_insert_all().execute())
    except Exception as exc:  # the table's own refusal (a schema that does not fit, a store error)
        raise OutputError(f"output.table: committing {output} to the Delta table {path} failed: {exc}") from exc
    version = DeltaTable(path, storage_options=options).version()
    fault_point("published")
    log.info("output.table: %s %s into %s as version %d", table_config.mode if existing is not None else "wrote",
             output, path, version)
    return version


@dataclass(frozen=True)
class TableFormat:
    """One `output.table.format`: its job-file rules, its publishing, how it names what holds an output."""

    problems: Callable[..., list[str]]
    publish: Callable[..., int]
    place: Callable[..., str]


_FORMATS = {"delta": TableFormat(_delta_problems, _publish_delta, _delta_place),
            "iceberg": TableFormat(iceberg_table.table_problems, iceberg_table.publish_iceberg,
                                   iceberg_table.table_place)}
TABLE_FORMATS = tuple(_FORMATS)  # the values output.table.format takes
