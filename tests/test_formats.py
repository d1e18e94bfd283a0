"""Wire formats come from one registry: the allowed values of input.format and output.format, and
a new format is one module plus its registration."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from batchscore.formats import discover_files, input_names, iter_batches, output_names, suffix_formats, unregister


def test_the_allowed_formats_come_from_the_registry():
    import batchscore.formats.openai_batch  # noqa: F401 - imported before the others: the order holds
    from batchscore.jobfile import ALLOWED

    assert ALLOWED["input.format"] == input_names() == ("auto", "parquet", "jsonl", "openai_batch", "delta", "iceberg")
    assert ALLOWED["output.format"] == output_names() == ("auto", "parquet", "jsonl", "openai_batch")
    assert suffix_formats()[".ndjson"] == "jsonl" and suffix_formats()[".pq"] == "parquet"


def test_an_unregistered_format_is_a_job_error_naming_the_key(small_input, job_factory):
    from batchscore.errors import JobConfigError
    from batchscore.jobfile import load_job

    with pytest.raises(JobConfigError, match="output.format: must be one of auto, parquet, jsonl, openai_batch, got 'csv'"):
        load_job(job_factory(small_input, output={"format": "csv"}))


TOY_MODULE = '''
"""CSV in and out: the whole of a toy wire format."""

import pyarrow.csv as pacsv

from batchscore.formats import InputBatch, WireFormat, register
from batchscore.io.atomic import atomic_write


def read(path, batch_rows, columns, json_columns):
    table = pacsv.read_csv(path)
    for start in range(0, table.num_rows, batch_rows):
        part = table.slice(start, batch_rows)
        yield InputBatch(path, start + 2, part, [None] * part.num_rows)  # line 1 is the header


def write(table, path, **_):
    atomic_write(path, lambda tmp: pacsv.write_csv(table, tmp))


CSV = register(WireFormat("csv", suffixes=(".csv",), read=read, write=write))
'''


@pytest.mark.slow
def test_a_toy_csv_format_is_one_module_and_its_registration(tmp_path, monkeypatch, small_input, job_factory):
    """The toy format's module is the only code written: a CSV input is found by its suffix, read
    in batches, scored by the built-in model, and its results written as CSV, one row per input
    row."""
    from batchscore.jobfile import load_job
    from batchscore.run.runner import run_job

    (tmp_path / "toy_csv_format.py").write_text(textwrap.dedent(TOY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = pq.read_table(small_input)
    csv_input = tmp_path / "input.csv"
    pacsv.write_csv(rows, csv_input)
    try:
        importlib.import_module("toy_csv_format")
        assert "csv" in input_names() and "csv" in output_names()
        assert discover_files(str(tmp_path / "*.csv")) == [(csv_input, "csv")]
        assert sum(b.table.num_rows for b in iter_batches([(csv_input, "csv")], 5)) == rows.num_rows
        job = load_job(job_factory(csv_input, output={"path": str(tmp_path / "scores.csv"), "format": "csv"}))
        summary = run_job(job, progress=False)
        assert summary.rows_ok == rows.num_rows
        written = pacsv.read_csv(tmp_path / "scores.csv").to_pandas().set_index("pair_id")
        assert sorted(written.index) == sorted(rows.column("pair_id").to_pylist())
        assert (written["status"] == "ok").all()
        assert ((written["p_Yes"] + written["p_No"]) - 1).abs().max() < 1e-6
    finally:
        unregister("csv")
        sys.modules.pop("toy_csv_format", None)
    assert "csv" not in input_names()
