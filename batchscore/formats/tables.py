"""Tables as inputs (io/table_inputs.py): `delta`, a Delta Lake table's folder; `iceberg`, a table
of an Iceberg catalog. Each is read as the input's one "file", its rows at one version; neither is
an output format (`output.table` publishes to them)."""

from __future__ import annotations

from batchscore.formats.registry import WireFormat, register
from batchscore.io.iceberg_catalog import table_name_problems
from batchscore.io.table_inputs import delta_input, iceberg_input


def read_table_rows(path, batch_rows: int, columns, json_columns):
    # a list column is read as Arrow lists, as from Parquet: `json_columns` concerns lines of JSON only
    return path.table.batches(path, batch_rows, columns)


def _delta_problems(config) -> list[str]:
    inp = config.input
    if inp.format != "delta":
        return []
    problems = []
    if inp.catalog or inp.identifier:
        problems.append("input.catalog / input.identifier: name an Iceberg table (input.format: iceberg); "
                        "a Delta table is input.path, its folder")
    if inp.filter:
        problems.append("input.filter: selects hive partition folders of files; not with input.format delta")
    return problems


def _iceberg_problems(config) -> list[str]:
    inp = config.input
    if inp.format != "iceberg":
        return []
    problems = table_name_problems("input", inp.catalog, inp.identifier, inp.path)
    if inp.filter:
        problems.append("input.filter: selects hive partition folders of files; not with input.format iceberg")
    return problems


DELTA = register(WireFormat("delta", read=read_table_rows, open_input=delta_input, job_problems=_delta_problems))
ICEBERG = register(WireFormat("iceberg", read=read_table_rows, open_input=iceberg_input,
                              job_problems=_iceberg_problems))
