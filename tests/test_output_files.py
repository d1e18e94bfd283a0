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
        "out.parquet.lock", "out.parquet.parts", "out.parquet.complete.json", "out.parquet.report.html"]
    assert files.lock("shard-0-of-3").name == "out.parquet.shard-0-of-3.lock" and files.path == tmp_path / "out.parquet"
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
