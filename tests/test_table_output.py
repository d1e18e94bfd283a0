"""`output.table`: the finished output published to a Delta Lake table, merged by id night after
night, every version readable, and committed exactly once however a run is killed and resumed."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore import run_job
from batchscore.errors import JobConfigError
from batchscore.jobfile import config_from_dict, load_job
from tests.conftest import write_job

deltalake = pytest.importorskip("deltalake")


def _nights(small_input):
    first = pq.read_table(small_input).to_pydict()
    second = {k: list(v) for k, v in first.items()}
    second["query"][1] += " for a wedding"
    for k in second:
        second[k].append(second[k][0])
    second["pair_id"][-1], second["query"][-1] = "new-1", "garden chairs"
    return first, second


def _job(tmp_path, rows: dict, night: str, table):
    pq.write_table(pa.table(rows), tmp_path / "in.parquet")
    return write_job(tmp_path, tmp_path / "in.parquet",
                     output={"path": str(tmp_path / f"{night}.parquet"), "table": {"path": str(table)}})


@pytest.mark.slow  # two runs: make test-all (the quick tier checks the job file's table keys)
def test_two_nights_merge_into_one_table_and_the_first_version_stays_readable(tmp_path, small_input):
    first, second = _nights(small_input)
    table = tmp_path / "relevance"
    night1 = run_job(load_job(_job(tmp_path, first, "2026-11-28", table)), progress=False)
    night2 = run_job(load_job(_job(tmp_path, second, "2026-11-29", table)), progress=False)
    assert (night1.table_version, night2.table_version) == (0, 1)
    now = deltalake.DeltaTable(str(table)).to_pandas().set_index("pair_id").sort_index()
    before = deltalake.DeltaTable(str(table), version=0).to_pandas().set_index("pair_id").sort_index()
    out2 = pq.read_table(tmp_path / "2026-11-29.parquet").to_pandas().set_index("pair_id").sort_index()
    assert len(before) == 12 and len(now) == 13 and "new-1" in now.index  # merged by id: one row updated, one new
    assert now.loc[out2.index, "p_Yes"].tolist() == out2["p_Yes"].tolist()
    assert before.loc[first["pair_id"][1], "p_Yes"] != now.loc[first["pair_id"][1], "p_Yes"]  # the edited row
    history = deltalake.DeltaTable(str(table)).history()
    assert [h["operation"] for h in history] == ["MERGE", "WRITE"]
    assert history[0]["batchscore.output"].endswith("2026-11-29.parquet") and "batchscore.run" in history[0]
    duckdb = pytest.importorskip("duckdb")
    files = deltalake.DeltaTable(str(table)).file_uris()
    read = duckdb.sql(f"select count(*) from read_parquet({[f.removeprefix('file://') for f in files]!r})")
    assert read.fetchall()[0][0] == 13


def test_a_table_needs_a_path_and_a_parquet_output():
    base = {"input": {"path": "x.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"]}
    with pytest.raises(JobConfigError, match="output.table.path: the Delta table"):
        config_from_dict({**base, "output": {"path": "o.parquet", "table": {"mode": "merge"}}})
    with pytest.raises(JobConfigError, match="output.table.mode: must be one of merge, append, overwrite"):
        config_from_dict({**base, "output": {"path": "o.parquet", "table": {"path": "t", "mode": "upsert"}}})
    with pytest.raises(JobConfigError, match="output.table: publishes a Parquet output; output.format is jsonl"):
        config_from_dict({**base, "output": {"path": "o.jsonl", "table": {"path": "t"}}})


@pytest.mark.slow  # four CLI runs, two of them killed: make test-all
@pytest.mark.parametrize("point", ["table", "published"])
def test_a_run_killed_at_its_commit_leaves_the_last_version_and_the_resume_commits_once(tmp_path, small_input, point):
    """Killed before its commit (`table`): the table stays at version 0 and the rerun commits
    version 1. Killed after it, before the completion marker (`published`): the rerun finds its
    commit and commits nothing more."""
    first, second = _nights(small_input)
    table = tmp_path / "relevance"
    command = [sys.executable, "-m", "batchscore.cli", "run", "-q"]
    assert subprocess.run([*command, str(_job(tmp_path, first, "n1", table))]).returncode == 0
    job = _job(tmp_path, second, "n2", table)
    killed = subprocess.run([*command, str(job)], env=dict(os.environ, BATCHSCORE_FAULT=point))
    assert killed.returncode == -9
    assert deltalake.DeltaTable(str(table)).version() == (0 if point == "table" else 1)
    assert deltalake.DeltaTable(str(table), version=0).to_pyarrow_table().num_rows == 12  # readable throughout
    resumed = subprocess.run([*command, str(job)], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "table: version 1 of the Delta table holds it" in resumed.stdout
    history = deltalake.DeltaTable(str(table)).history()
    assert [h["version"] for h in history] == [1, 0]  # committed once
    assert deltalake.DeltaTable(str(table)).to_pyarrow_table().num_rows == 13
