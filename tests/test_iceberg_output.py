"""`output.table.format: iceberg`: the finished output published to an Iceberg table through a
local SQL catalog (SQLite + a warehouse folder), merged by id night after night, every snapshot
readable by its id, committed exactly once however a run is killed and resumed."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore import run_job
from batchscore.config import TableConfig
from batchscore.errors import JobConfigError, OutputError
from batchscore.formats.table import read_parquet
from batchscore.jobfile import config_from_dict, load_job
from batchscore.output.iceberg_table import RUN_KEY
from batchscore.output.table_publish import publish
from tests.conftest import write_job
from tests.test_table_output import _nights

pyiceberg_catalog = pytest.importorskip("pyiceberg.catalog")
IDENTIFIER = "nightly.relevance"


def _catalog(tmp_path) -> dict:
    """A local SQL catalog in folders the first publish makes."""
    return {"name": "local", "type": "sql", "uri": f"sqlite:///{tmp_path}/iceberg/catalog.db",
            "warehouse": f"file://{tmp_path}/iceberg/warehouse"}


def _table(tmp_path):
    catalog = dict(_catalog(tmp_path))
    return pyiceberg_catalog.load_catalog(catalog.pop("name"), **catalog).load_table(IDENTIFIER)


def _runs(table) -> list[str]:
    """The run each snapshot's commit carried, oldest first."""
    return [s.summary.additional_properties.get(RUN_KEY) for s in table.snapshots()]


def _output(tmp_path, name: str, ids: list[str], p_yes: list[float], product: list[str]):
    path = tmp_path / f"{name}.parquet"
    pq.write_table(pa.table({"pair_id": ids, "product_id": product, "p_Yes": p_yes,
                             "p_No": [1 - p for p in p_yes], "status": ["ok"] * len(ids)}), path)
    return path


def test_two_outputs_merge_by_id_each_snapshot_readable_and_a_run_commits_once(tmp_path):
    """The publishing step alone, on two finished outputs: the second merges by id (one row
    updated, one new), the first snapshot reads as it was, and publishing a run again finds its
    snapshot and commits nothing."""
    config = TableConfig(format="iceberg", catalog=_catalog(tmp_path), identifier=IDENTIFIER,
                         partition_by=["product_id"])
    lineage = {"batchscore.model": "m", "batchscore.output": "o"}
    first = _output(tmp_path, "n1", ["a", "b", "c"], [0.1, 0.2, 0.3], ["P1", "P1", "P2"])
    second = _output(tmp_path, "n2", ["b", "d"], [0.9, 0.4], ["P1", "P2"])
    pq.write_table(pq.read_table(second).append_column("p_cal_Yes", pa.array([0.8, 0.5])), second)  # a new column
    snapshot1 = publish(config, first, "pair_id", "run-1", lineage, read_output=read_parquet)
    snapshot2 = publish(config, second, "pair_id", "run-2", lineage, read_output=read_parquet)
    assert publish(config, second, "pair_id", "run-2", lineage, read_output=read_parquet) == snapshot2  # found
    table = _table(tmp_path)
    assert table.current_snapshot().snapshot_id == snapshot2 != snapshot1
    now = {r["pair_id"]: r["p_Yes"] for r in table.scan().to_arrow().to_pylist()}
    assert now == {"a": 0.1, "b": 0.9, "c": 0.3, "d": 0.4}
    calibrated = {r["pair_id"]: r["p_cal_Yes"] for r in table.scan().to_arrow().to_pylist()}
    assert calibrated == {"a": None, "b": 0.8, "c": None, "d": 0.5}  # added to the schema, null for older rows
    before = {r["pair_id"]: r["p_Yes"] for r in table.scan(snapshot_id=snapshot1).to_arrow().to_pylist()}
    assert before == {"a": 0.1, "b": 0.2, "c": 0.3}
    assert set(_runs(table)) == {"run-1", "run-2"} and _runs(table)[0] == "run-1"
    assert table.current_snapshot().summary.additional_properties["batchscore.model"] == "m"
    assert [f.name for f in table.spec().fields] == ["product_id"]  # an identity partition
    append = TableConfig(format="iceberg", catalog=_catalog(tmp_path), identifier=IDENTIFIER, mode="append")
    publish(append, first, "pair_id", "run-3", lineage, read_output=read_parquet)
    assert _table(tmp_path).scan().to_arrow().num_rows == 7
    overwrite = TableConfig(format="iceberg", catalog=_catalog(tmp_path), identifier=IDENTIFIER, mode="overwrite")
    publish(overwrite, second, "pair_id", "run-4", lineage, read_output=read_parquet)
    assert sorted(_table(tmp_path).scan().to_arrow().column("pair_id").to_pylist()) == ["b", "d"]


def test_a_catalog_that_cannot_open_and_a_missing_column_are_named(tmp_path):
    output = _output(tmp_path, "n1", ["a"], [0.1], ["P1"])
    gone = {"name": "local", "type": "sql", "uri": f"sqlite:///{tmp_path}"}  # a folder, not a SQLite file
    config = TableConfig(format="iceberg", catalog=gone, identifier=IDENTIFIER)
    with pytest.raises(OutputError, match="output.table.catalog: cannot open the Iceberg catalog 'local'"):
        publish(config, output, "pair_id", "run-1", {}, read_output=read_parquet)
    config = TableConfig(format="iceberg", catalog=_catalog(tmp_path), identifier=IDENTIFIER, partition_by=["day"])
    with pytest.raises(OutputError, match=r"output.table: \['day'\] are not columns of the output"):
        publish(config, output, "pair_id", "run-1", {}, read_output=read_parquet)


def test_an_iceberg_table_needs_a_catalog_and_an_identifier():
    base = {"input": {"path": "x.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"]}

    def table(**keys):
        return config_from_dict({**base, "output": {"path": "o.parquet", "table": {"format": "iceberg", **keys}}})

    with pytest.raises(JobConfigError, match="output.table.catalog: the Iceberg catalog the table is in"):
        table(identifier="nightly.scores")
    with pytest.raises(JobConfigError, match="output.table.identifier: the Iceberg table's identifier"):
        table(catalog={"name": "local"})
    with pytest.raises(JobConfigError, match="output.table.identifier: 'scores' is not namespace.table"):
        table(catalog={"name": "local"}, identifier="scores")
    with pytest.raises(JobConfigError, match="output.table.format: must be one of delta, iceberg"):
        table(format="hudi", path="t")
    assert table(catalog={"name": "local"}, identifier="nightly.scores").output.table.identifier == "nightly.scores"


def test_a_local_catalog_relative_to_the_job_file(tmp_path):
    """A SQLite file and a warehouse folder given relative to the job file are found there, as the
    job's other paths are (input, output); URLs and absolute paths stay as written."""
    relative = {"name": "local", "type": "sql", "uri": "sqlite:///state/catalog.db", "warehouse": "warehouse"}
    job = write_job(tmp_path, tmp_path / "in.parquet", output={"table": {"format": "iceberg", "catalog": relative,
                                                                          "identifier": IDENTIFIER}},
                    input={"path": None, "format": "iceberg", "identifier": "raw.pairs",
                           "catalog": {**relative, "warehouse": "file:///data/warehouse"}})
    config = load_job(job)
    assert config.output.table.catalog == {**relative, "uri": f"sqlite:///{tmp_path}/state/catalog.db",
                                           "warehouse": str(tmp_path / "warehouse")}
    assert config.input.catalog == {**relative, "uri": f"sqlite:///{tmp_path}/state/catalog.db",
                                    "warehouse": "file:///data/warehouse"}


def _job(tmp_path, rows: dict, night: str, table: dict):
    pq.write_table(pa.table(rows), tmp_path / "in.parquet")
    return write_job(tmp_path, tmp_path / "in.parquet",
                     output={"path": str(tmp_path / f"{night}.parquet"), "table": table})


def _iceberg(tmp_path) -> dict:
    return {"format": "iceberg", "catalog": _catalog(tmp_path), "identifier": IDENTIFIER}


@pytest.mark.slow  # two runs: make test-all (the quick tier publishes hand-written outputs)
def test_two_nights_merge_into_one_iceberg_table_and_the_first_snapshot_stays_readable(tmp_path, small_input):
    first, second = _nights(small_input)
    night1 = run_job(load_job(_job(tmp_path, first, "2026-11-28", _iceberg(tmp_path))), progress=False)
    night2 = run_job(load_job(_job(tmp_path, second, "2026-11-29", _iceberg(tmp_path))), progress=False)
    table = _table(tmp_path)
    assert table.current_snapshot().snapshot_id == night2.table_version != night1.table_version
    now = table.scan().to_pandas().set_index("pair_id").sort_index()
    before = table.scan(snapshot_id=night1.table_version).to_pandas().set_index("pair_id").sort_index()
    out2 = pq.read_table(tmp_path / "2026-11-29.parquet").to_pandas().set_index("pair_id").sort_index()
    assert len(before) == 12 and len(now) == 13 and "new-1" in now.index  # merged by id: one row updated, one new
    assert now.loc[out2.index, "p_Yes"].tolist() == out2["p_Yes"].tolist()
    assert before.loc[first["pair_id"][1], "p_Yes"] != now.loc[first["pair_id"][1], "p_Yes"]  # the edited row
    summary = table.current_snapshot().summary.additional_properties
    assert summary["batchscore.output"].endswith("2026-11-29.parquet") and summary[RUN_KEY]
    assert len(set(_runs(table))) == 2  # one commit a night (a merge makes two snapshots)


@pytest.mark.slow  # four CLI runs, two of them killed: make test-all
@pytest.mark.parametrize("point", ["table", "published"])
def test_a_run_killed_at_its_iceberg_commit_leaves_the_last_snapshot_and_the_resume_commits_once(
        tmp_path, small_input, point):
    """Killed before its commit (`table`): the table stays at the first night's snapshot and the
    rerun commits. Killed after it, before the completion marker (`published`): the rerun finds
    its snapshot and commits nothing more. Appended, so that a second commit would show as rows."""
    first, second = _nights(small_input)
    command = [sys.executable, "-m", "batchscore.cli", "run", "-q"]
    assert subprocess.run([*command, str(_job(tmp_path, first, "n1", _iceberg(tmp_path)))]).returncode == 0
    snapshot1 = _table(tmp_path).current_snapshot().snapshot_id
    job = _job(tmp_path, second, "n2", {**_iceberg(tmp_path), "mode": "append"})
    killed = subprocess.run([*command, str(job)], env=dict(os.environ, BATCHSCORE_FAULT=point))
    assert killed.returncode == -9
    after_kill = _table(tmp_path)
    assert (after_kill.current_snapshot().snapshot_id == snapshot1) == (point == "table")
    assert after_kill.scan(snapshot_id=snapshot1).to_arrow().num_rows == 12  # readable throughout
    resumed = subprocess.run([*command, str(job)], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    table = _table(tmp_path)
    assert f"table: snapshot {table.current_snapshot().snapshot_id} of the Iceberg table {IDENTIFIER} holds it" \
        in resumed.stdout
    assert len(_runs(table)) == 2 and _runs(table)[0] != _runs(table)[1]  # committed once: a snapshot a night
    assert table.scan().to_arrow().num_rows == 12 + 13
    if point == "published":
        assert table.current_snapshot().snapshot_id == after_kill.current_snapshot().snapshot_id
