"""Output files: their names (output/layout.py), atomic writes following the umask, and the lock
that keeps two runs apart."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from batchscore.errors import OutputLocked
from batchscore.io.atomic import atomic_write
from batchscore.jobfile import config_from_dict
from batchscore.output.layout import OutputFiles, default_error_path, output_columns
from batchscore.run.open import output_files
from batchscore.output.lock import OutputLock


def test_every_file_beside_an_output_is_named_once(tmp_path):
    files = OutputFiles(str(tmp_path / "out.parquet"))
    assert [p.name for p in files.all_siblings()] == [
        "_out.parquet.lock", "_out.parquet.parts", "_out.parquet.complete.json", "_out.parquet.report.html",
        "_out.parquet.rows", "_out.parquet.reads"]
    assert files.lock("shard-0-of-3").name == "_out.parquet.shard-0-of-3.lock" and files.path == tmp_path / "out.parquet"
    batch = output_files(config_from_dict({"input": {"path": "in.jsonl", "format": "openai_batch"},
                                                  "labels": ["Yes", "No"], "output": {"path": "/x/batch.jsonl"}}))
    assert batch.errors == "/x/batch.errors.jsonl" and str(batch.all_siblings()[3]) == "/x/batch.errors.jsonl"
    assert default_error_path("s3://b/o/scores.NDJSON") == "s3://b/o/scores.errors.jsonl"
    assert default_error_path("out.parquet") == "out.parquet.errors.jsonl"


def test_output_columns_in_order():
    assert output_columns([" Yes", "No "], logprobs=True) == ["p_Yes", "p_No", "label", "label_mass", "logp_Yes",
                                                               "logp_No", "status", "error"]
    assert output_columns([], choices=True) == ["choice", "choice_index", "p_choices", "label_mass", "status", "error"]


def test_atomic_write_follows_the_umask(tmp_path):
    path = atomic_write(tmp_path / "out.txt", lambda tmp: open(tmp, "w").write("x"))
    expected = 0o666 & ~_umask()
    assert stat.S_IMODE(path.stat().st_mode) == expected
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temporary file left


def test_atomic_write_leaves_nothing_when_the_write_fails(tmp_path):
    def fail(tmp):
        open(tmp, "w").write("half")
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "out.txt", fail)
    assert list(tmp_path.iterdir()) == []


def test_the_lock_is_exclusive_across_processes_and_dies_with_its_holder(tmp_path):
    output = tmp_path / "out.parquet"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from batchscore.output.lock import OutputLock;"
        "from batchscore.output.layout import OutputFiles;"
        f"lock = OutputLock(OutputFiles({str(output)!r})); lock.acquire(); print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(OutputLocked, match=f"pid {holder.pid}"):
        OutputLock(OutputFiles(output)).acquire()
    holder.kill()
    holder.wait()
    with OutputLock(OutputFiles(output)):  # the kernel released the dead holder's lock
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.slow  # two CLI runs: make test-all
def test_the_output_folder_reads_as_a_dataset_while_a_run_is_stopped_and_after_it(tmp_path, small_input):
    """pyarrow.dataset and DuckDB over the output's folder: no row of a run's own files while it is
    unfinished (lock, parts, token store), exactly the output's rows once it is done (report and
    marker beside it)."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from tests.conftest import write_job

    folder = tmp_path / "out"
    folder.mkdir()
    job = write_job(tmp_path, small_input, output={"path": str(folder / "scores.parquet"), "part_rows": 4})

    def rows() -> tuple[int, int]:
        arrow = ds.dataset(folder, format="parquet").count_rows()
        duckdb = pytest.importorskip("duckdb")
        try:
            found = duckdb.sql(f"select count(*) from read_parquet('{folder}/**/*.parquet')").fetchall()[0][0]
        except duckdb.IOException:  # no file matches the glob
            found = 0
        return arrow, found

    command = [sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "--report"]
    stopped = subprocess.run(command, env=dict(os.environ, BATCHSCORE_FAULT="part:2"), capture_output=True, text=True)
    assert stopped.returncode == -9, stopped.stderr[-2000:]
    assert OutputFiles(folder / "scores.parquet").parts.is_dir() and rows() == (0, 0)
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == [
        "_scores.parquet.complete.json", "_scores.parquet.report.html", "scores.parquet"]
    assert rows() == (pq.read_table(folder / "scores.parquet").num_rows,) * 2 == (12, 12)
