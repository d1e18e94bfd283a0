"""`input.format: delta` and `input.format: iceberg`: a Delta Lake table's folder and a table of an
Iceberg catalog (a local SQL catalog here) read as the job's rows, at one version pinned when the
job opens; the run identity follows the table's version; bad tables and columns are named."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore import run_job
from batchscore.errors import InputError, JobConfigError
from batchscore.jobfile import config_from_dict, load_job
from batchscore.output.identity import describe_changes
from batchscore.run.open import open_job, prepare_job
from tests.conftest import write_job

deltalake = pytest.importorskip("deltalake")
pyiceberg_catalog = pytest.importorskip("pyiceberg.catalog")
IDENTIFIER = "raw.pairs"
COLUMNS = ["pair_id", "product_id", "title", "description", "query"]


def _catalog(tmp_path) -> dict:
    (tmp_path / "warehouse").mkdir(exist_ok=True)
    return {"name": "local", "type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db",
            "warehouse": f"file://{tmp_path}/warehouse"}


def _tables(tmp_path, rows: pa.Table):
    """The rows as a Delta table and as an Iceberg table; returns (Delta folder, Iceberg table)."""
    deltalake.write_deltalake(str(tmp_path / "delta"), rows)
    catalog = dict(_catalog(tmp_path))
    catalog = pyiceberg_catalog.load_catalog(catalog.pop("name"), **catalog)
    catalog.create_namespace("raw")
    iceberg = catalog.create_table(IDENTIFIER, schema=rows.schema)
    iceberg.append(rows)
    return tmp_path / "delta", iceberg


def _inputs(tmp_path) -> dict[str, dict]:
    """input sections reading the same rows: from Parquet, from the Delta table, from the Iceberg table."""
    return {"parquet": {"path": str(tmp_path / "in.parquet")},
            "delta": {"path": str(tmp_path / "delta"), "format": "delta"},
            "iceberg": {"format": "iceberg", "catalog": _catalog(tmp_path), "identifier": IDENTIFIER}}


def _config(tmp_path, inp: dict, **output):
    return config_from_dict({
        "input": {"id_column": "pair_id", **inp},
        "prompt": {"template": "Product: {title}\n{description}\nQuery: {query}\nRelevant?"},
        "labels": ["Yes", "No"],
        "output": {"path": str(tmp_path / "out.parquet"), **output}})


@pytest.fixture
def rows(tmp_path, small_input) -> pa.Table:
    table = pq.read_table(small_input).select(COLUMNS)
    pq.write_table(table, tmp_path / "in.parquet")
    return table


def test_a_delta_and_an_iceberg_table_read_the_rows_parquet_reads(tmp_path, rows):
    _tables(tmp_path, rows)
    read = {}
    for name, inp in _inputs(tmp_path).items():
        config = _config(tmp_path, {**inp, "batch_rows": 5}, keep_columns=COLUMNS[1:])  # batches cut within the table
        prepared = prepare_job(config, tokenize=False, source=open_job(config, with_model=False)).input
        read[name] = (prepared.ids.to_pylist(), prepared.kept.to_pydict())
    assert read["delta"] == read["parquet"] == read["iceberg"]
    assert read["parquet"][0] == rows.column("pair_id").to_pylist()


def test_the_input_identity_is_the_tables_version_pinned_when_the_job_opens(tmp_path, rows):
    delta, iceberg = _tables(tmp_path, rows)
    inputs = _inputs(tmp_path)
    first = {name: open_job(_config(tmp_path, inputs[name]), with_model=False) for name in ("delta", "iceberg")}
    assert first["delta"].identity["input"][0]["version"] == 0
    assert first["iceberg"].identity["input"][0]["version"] == iceberg.current_snapshot().snapshot_id
    unchanged = open_job(_config(tmp_path, inputs["iceberg"]), with_model=False)
    assert unchanged.identity["input"] == first["iceberg"].identity["input"]
    tonight = rows.set_column(0, "pair_id", pa.array([f"{i}-new" for i in rows.column("pair_id").to_pylist()]))
    deltalake.write_deltalake(str(delta), tonight, mode="append")  # tonight's commits
    iceberg.append(tonight)
    for name, before in first.items():
        now = open_job(_config(tmp_path, inputs[name]), with_model=False)
        assert now.identity["input"] != before.identity["input"]
        old, new = before.identity["input"][0]["version"], now.identity["input"][0]["version"]
        assert f"changed (version {old} → {new})" in describe_changes(before.identity, now.identity)[0]
        # a job opened before the commit still reads the version it opened (12 rows, not 24)
        config = _config(tmp_path, inputs[name])
        assert prepare_job(config, tokenize=False, source=before).input.num_rows == 12
        assert prepare_job(config, tokenize=False, source=now).input.num_rows == 24
        version = before.identity["input"][0]["version"]
        pinned = open_job(_config(tmp_path, {**inputs[name], "version": version}), with_model=False)
        assert pinned.identity["input"] == before.identity["input"]


def test_a_table_that_is_not_there_and_a_missing_column_are_named(tmp_path, rows):
    _tables(tmp_path, rows)
    inputs = _inputs(tmp_path)
    (tmp_path / "not_delta").mkdir()
    cases = [
        ({"path": str(tmp_path / "not_delta"), "format": "delta"}, f"input.path: {tmp_path}/not_delta is not a Delta table"),
        ({**inputs["delta"], "version": 3}, r"input.version: the Delta table .* has no version 3 \(its versions: 0 to 0\)"),
        ({**inputs["iceberg"], "identifier": "raw.nope"}, "input.identifier: the Iceberg catalog 'local' has no table 'raw.nope'"),
        ({**inputs["iceberg"], "version": 42}, "input.version: the Iceberg table raw.pairs has no snapshot 42"),
        ({**inputs["iceberg"], "catalog": {"name": "local", "type": "sql", "uri": f"sqlite:///{tmp_path}/no/catalog.db"}},
         "input.catalog: cannot open the Iceberg catalog 'local'"),
    ]
    for inp, message in cases:
        with pytest.raises(InputError, match=message):
            open_job(_config(tmp_path, inp), with_model=False)
    for name in ("delta", "iceberg"):
        config = _config(tmp_path, inputs[name], keep_columns=["colour"])
        where = "warehouse/raw/pairs" if name == "iceberg" else "delta"  # the table's folder
        with pytest.raises(InputError, match=rf"{where}: column\(s\) \['colour'\] not found .* the file has columns "
                                             r"\['description', 'pair_id', 'product_id', 'query', 'title'\]"):
            prepare_job(config, tokenize=False, source=open_job(config, with_model=False))


def test_a_table_input_names_its_table_in_the_job_file(tmp_path):
    iceberg = {"format": "iceberg", "catalog": {"name": "local"}, "identifier": IDENTIFIER}
    cases = [({"format": "iceberg", "identifier": IDENTIFIER}, "input.catalog: the Iceberg catalog the table is in"),
             ({"format": "iceberg", "catalog": {"name": "local"}}, "input.path: required"),
             ({**iceberg, "path": "x"}, "input.path: an Iceberg table is named by input.catalog and input.identifier"),
             ({**iceberg, "identifier": "pairs"}, "input.identifier: 'pairs' is not namespace.table"),
             ({"path": "x.parquet", "version": 3}, "input.catalog / identifier / version: read a table"),
             ({"path": "t", "format": "delta", "identifier": IDENTIFIER}, "input.catalog / input.identifier: name an Iceberg"),
             ({"path": "t", "format": "delta", "filter": {"day": "1"}}, "input.filter: selects hive partition folders")]
    for inp, message in cases:
        with pytest.raises(JobConfigError, match=message):
            _config(tmp_path, inp)
    assert _config(tmp_path, iceberg).input.identifier == IDENTIFIER


@pytest.mark.slow  # three runs of the built-in model: make test-all (the quick tier compares the rows read)
def test_jobs_reading_a_delta_and_an_iceberg_table_score_as_the_parquet_rows(tmp_path, rows):
    _tables(tmp_path, rows)
    scores = {}
    for name, inp in _inputs(tmp_path).items():
        job = write_job(tmp_path, tmp_path / "in.parquet", input={"path": None, **inp, "id_column": "pair_id"},
                        output={"path": str(tmp_path / f"{name}.parquet")})
        summary = run_job(load_job(job), progress=False)
        assert summary.rows_ok == 12
        out = pq.read_table(tmp_path / f"{name}.parquet")
        scores[name] = dict(zip(out.column("pair_id").to_pylist(), out.column("p_Yes").to_pylist()))
    assert scores["delta"] == scores["parquet"] == scores["iceberg"]
