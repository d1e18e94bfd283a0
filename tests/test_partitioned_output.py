"""`output.partition_by`: the output written hive-style (`<output>/<column>=<value>/part-….parquet`),
exactly once. pyarrow.dataset and DuckDB read the folder as the output's rows after a run, and no
row while one runs (killed while scoring, or with the dataset written but not yet renamed into
place); a resume finishes it once; re-derive and `batchscore report` read it back."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from batchscore.errors import JobConfigError, OutputError
from batchscore.jobfile import load_job, parse_set_options
from batchscore.output import partitioned
from batchscore.output.layout import OutputFiles
from batchscore.output.table import PARTITION_KEY, with_metadata
from batchscore.run.open import check_output_path
from batchscore.run.runner import run_job

from tests.conftest import write_job, write_sample_subset

duckdb = pytest.importorskip("duckdb")

PARTITION_BY = ["product_id", "label"]


def _arrow_rows(folder) -> list[dict]:
    """The folder's rows as pyarrow.dataset reads it (hive partitions), sorted by id."""
    if not folder.exists():
        return []
    return sorted(ds.dataset(folder, format="parquet", partitioning="hive").to_table().to_pylist(),
                  key=lambda row: row["pair_id"])


def _duckdb_rows(folder) -> list[dict]:
    """The same through DuckDB's glob with hive partitioning ([] when no file matches)."""
    try:
        relation = duckdb.sql(f"select * from read_parquet('{folder}/**/*.parquet', hive_partitioning=true) "
                              "order by pair_id")
    except duckdb.IOException:  # no file matches the glob
        return []
    return [dict(zip(relation.columns, row)) for row in relation.fetchall()]


def _table(rows: int = 6) -> pa.Table:
    table = pa.table({"pair_id": [f"r{i}" for i in range(rows)], "product_id": ["P2", "P1", None, "P1", "P2", "P1"][:rows],
                      "n": pa.array(range(rows), type=pa.int16()), "p_Yes": [i / 10 for i in range(rows)],
                      "label": ["Yes", "No", "Home & Garden", None, "Yes", "No"][:rows]})
    return with_metadata(table, {PARTITION_KEY: '["product_id", "label"]', "batchscore.model": "m"})


def test_a_partitioned_write_reads_back_with_its_types_columns_and_rows(tmp_path):
    """read_dataset gives back the columns, types (int16, null partitions) and schema metadata
    written; in_row_order restores the input's row order by id; DuckDB reads the same rows."""
    table = _table()
    out = tmp_path / "out"
    partitioned.write_table(table, out, PARTITION_BY)
    names = sorted(str(p.relative_to(out)) for p in partitioned.data_files(out))
    assert "product_id=P1/label=No/part-00000-0.parquet" in names
    assert "product_id=__HIVE_DEFAULT_PARTITION__/label=Home%20%26%20Garden/part-00000-0.parquet" in names
    back = partitioned.read_dataset(out)
    assert back.schema.remove_metadata() == table.schema.remove_metadata()
    assert back.schema.metadata[b"batchscore.model"] == b"m"
    assert back.num_rows == 6 and back.column("pair_id").to_pylist() != table.column("pair_id").to_pylist()
    assert partitioned.in_row_order(back, "pair_id", table.column("pair_id").combine_chunks()).equals(table)
    assert partitioned.in_row_order(back, "pair_id", pa.array(["r0", "r1"])) is None  # not those rows
    expected = sorted(table.to_pylist(), key=lambda row: row["pair_id"])
    assert [{**row, "n": int(row["n"])} for row in _duckdb_rows(out)] == expected


def test_a_write_replaces_the_earlier_output_whole_and_clears_a_killed_write(tmp_path):
    out = tmp_path / "out"
    partitioned.write_table(_table(6), out, PARTITION_BY)
    stale = tmp_path / "_out.writing-dead"  # what a run killed while writing leaves
    (stale / "label=Yes").mkdir(parents=True)
    pq.write_table(_table(1), stale / "label=Yes" / "part-00000-0.parquet")
    digest = partitioned.output_digest(out)
    partitioned.write_table(_table(2), out, PARTITION_BY)  # fewer partitions than before: none of the old left
    assert partitioned.read_dataset(out).num_rows == 2 and len(partitioned.data_files(out)) == 2
    assert partitioned.output_digest(out) != digest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the killed write's folder removed
    assert ds.dataset(tmp_path, format="parquet", partitioning="hive").count_rows() == 2  # `_` names skipped


def test_a_link_planted_at_the_output_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    partitioned.write_table(_table(), victim, PARTITION_BY)
    before = partitioned.output_digest(victim)
    (tmp_path / "out").symlink_to(victim, target_is_directory=True)
    partitioned.write_table(_table(2), tmp_path / "out", PARTITION_BY)
    assert not (tmp_path / "out").is_symlink() and partitioned.read_dataset(tmp_path / "out").num_rows == 2
    assert partitioned.output_digest(victim) == before  # what the link pointed to: untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "victim"]  # the link itself removed


def test_an_output_folder_holding_anything_else_is_refused(tmp_path):
    """The folder is replaced whole: one holding another file is never the output."""
    out = tmp_path / "scores"
    out.mkdir()
    check_output_path(str(out), folder=True)  # empty: fine
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"holding notes.txt, which is not a partition"):
        check_output_path(str(out), folder=True)
    partitioned.write_table(_table(), tmp_path / "done", PARTITION_BY)
    check_output_path(str(tmp_path / "done"), folder=True)  # an earlier partitioned output: written again
    with pytest.raises(OutputError, match=r"is a partitioned output's folder; set output.partition_by"):
        check_output_path(str(tmp_path / "done"))


def test_a_file_inside_the_output_folder_is_refused_as_a_write_path(tmp_path):
    from batchscore.errors import WritePathError
    from batchscore.output.write_paths import check_report_path

    out = tmp_path / "scores"
    partitioned.write_table(_table(), out, PARTITION_BY)
    with pytest.raises(WritePathError, match=r"is inside the output folder .*, which each write of the output replaces"):
        check_report_path("--html", out / "report.html", out)
    check_report_path("--html", tmp_path / "report.html", out)


@pytest.mark.parametrize("setting, message", [
    ("output.partition_by=[p_Yes]", r"'p_Yes' is not an output column to partition by; give the id column, a kept"),
    ("output.partition_by=[label,label]", r"'label' is named 2 times"),
    ("output.partition_by=[title]", r"'title' is not an output column"),  # an input column not kept
])
def test_a_partition_column_the_output_does_not_write_plainly_is_refused_at_load(tmp_path, small_input, setting,
                                                                                 message):
    job = write_job(tmp_path, small_input)
    load_job(job, parse_set_options(["output.partition_by=[product_id,label,pair_id,status]"]))
    with pytest.raises(JobConfigError, match=message):
        load_job(job, parse_set_options([setting]))


def test_a_partitioned_output_is_parquet_in_a_local_folder(tmp_path, small_input):
    job = write_job(tmp_path, small_input, output={"path": str(tmp_path / "out.jsonl"), "partition_by": ["label"]})
    with pytest.raises(JobConfigError, match=r"a partitioned output is Parquet; output.format is jsonl"):
        load_job(job)
    job = write_job(tmp_path, small_input, output={"path": "s3://bucket/scores", "partition_by": ["label"]})
    with pytest.raises(JobConfigError, match=r"is in an object store \(not built\)"):
        load_job(job)


def test_a_partitioned_run_reads_as_its_rows_and_resumes_complete(tmp_path, small_input):
    """In process: pyarrow.dataset and DuckDB read the partitioned output as the job's rows, every
    input row once; a rerun finds it complete (its marker names the folder's content). The slow
    test below compares it with a one-file run's rows."""
    data = write_sample_subset(tmp_path / "in.parquet", queries=2, product_ids=("P001", "P002"))
    out = tmp_path / "out" / "scores"
    job = write_job(tmp_path, data, output={"path": str(out), "partition_by": PARTITION_BY})
    summary = run_job(load_job(job), progress=False)
    assert summary.rows_ok == 4
    reference = sorted(partitioned.read_dataset(out).to_pylist(), key=lambda row: row["pair_id"])
    assert [r["pair_id"] for r in reference] == sorted(pq.read_table(data).column("pair_id").to_pylist())
    assert _arrow_rows(out) == _duckdb_rows(out) == reference
    assert all(r["label"] in ("Yes", "No") and r["status"] == "ok" for r in reference)
    assert {p.parent.parent.name for p in partitioned.data_files(out)} == {"product_id=P001", "product_id=P002"}
    assert sorted(p.name for p in out.parent.iterdir()) == ["_scores.complete.json", "scores"]
    again = run_job(load_job(job), progress=False)
    assert again.skipped and _arrow_rows(out) == reference


@pytest.mark.slow  # six CLI runs (~75 s): make test-all
def test_no_row_while_it_runs_a_resume_completes_it_and_it_rederives_and_reports(tmp_path, small_input):
    """Killed while scoring, then killed with the dataset written but not renamed into place: the
    output folder holds no row (nor its parent, read by pyarrow.dataset); the resume writes it once, equal
    to a one-file run's rows; a calibration added since re-derives it (nothing scored, each row's
    raw scores kept) and `batchscore report` reads it."""
    command = [sys.executable, "-m", "batchscore.cli", "run"]
    single = write_job(tmp_path, small_input, output={"path": str(tmp_path / "one.parquet")})
    assert subprocess.run(command + [str(single), "-q"], capture_output=True).returncode == 0
    reference = sorted(pq.read_table(tmp_path / "one.parquet").to_pylist(), key=lambda row: row["pair_id"])
    folder = tmp_path / "out"
    out = folder / "scores"
    job = write_job(tmp_path, small_input, output={"path": str(out), "part_rows": 4, "partition_by": PARTITION_BY})
    run = command + [str(job), "-q"]

    for fault in ("part:2", "dataset"):
        stopped = subprocess.run(run, env=dict(os.environ, BATCHSCORE_FAULT=fault), capture_output=True, text=True)
        assert stopped.returncode == -9, stopped.stderr[-2000:]
        assert not out.exists() and OutputFiles(out).parts.is_dir()
        # pyarrow skips `_` names; DuckDB's `**` does not, but the files there are not yet `*.parquet`
        assert _arrow_rows(out) == _duckdb_rows(out) == [] == _arrow_rows(folder) == _duckdb_rows(folder)
    writing = [p for p in folder.iterdir() if p.name.startswith("_scores.writing-")]
    assert len(writing) == 1 and list(writing[0].rglob("*.parquet.unfinished"))  # the killed write's files, unread

    done = subprocess.run(run + ["--metrics", str(tmp_path / "m.json")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _arrow_rows(out) == _duckdb_rows(out) == reference
    assert sorted(p.name for p in folder.iterdir()) == ["_scores.complete.json", "scores"]
    assert '"resumed_rows": 12' in (tmp_path / "m.json").read_text()  # nothing scored twice

    rederived = subprocess.run(run + ["--set", "score.calibrate=batch", "--metrics", str(tmp_path / "m2.json")],
                               capture_output=True, text=True)
    assert rederived.returncode == 0, rederived.stderr[-2000:]
    assert '"rederived": true' in (tmp_path / "m2.json").read_text()
    rows = _duckdb_rows(out)
    assert [(r["pair_id"], r["p_Yes"]) for r in rows] == [(r["pair_id"], r["p_Yes"]) for r in reference]
    assert all(r["p_cal_Yes"] is not None for r in rows)

    report = subprocess.run([sys.executable, "-m", "batchscore.cli", "report", str(out)], capture_output=True, text=True)
    assert report.returncode == 0, report.stderr[-2000:]
    html = (folder / "_scores.report.html").read_text()
    assert "12" in html and "P(label)" in html

    # partition_by set on the finished one-file output: re-derived into a folder, nothing scored
    one = tmp_path / "one.parquet"
    moved = subprocess.run(run + ["-o", str(one), "--set", "output.partition_by=[label]", "--metrics",
                                  str(tmp_path / "m3.json")], capture_output=True, text=True)
    assert moved.returncode == 0, moved.stderr[-2000:]
    assert '"rederived": true' in (tmp_path / "m3.json").read_text() and one.is_dir()
    assert _duckdb_rows(one) == reference
