"""Outputs a warehouse loads as they are: the Parquet schema records the model, the job's hash, the
batchscore version and when the output was written (beside the data, never in it), and
`output.column_separator: "__"` names a questions output's columns without a dot (BigQuery refuses
dots), which the report reads back."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

import batchscore
from batchscore.cli import main
from batchscore.jobfile import load_job
from batchscore.run.runner import run_job

from tests.conftest import write_job, write_sample_subset
from tests.test_decision_quality import TRUTHS, questions
from tests.test_decision_quality import write_job as write_questions_job


def _provenance(path) -> dict[str, str]:
    metadata = pq.read_schema(path).metadata or {}
    return {k.decode(): v.decode() for k, v in metadata.items() if k.startswith(b"batchscore.")}


def _check_provenance(path, started: datetime) -> None:
    recorded = _provenance(path)
    marker = json.loads(path.with_name("_" + path.name + ".complete.json").read_text())
    assert recorded["batchscore.model"] == "smollm2-135m-instruct"
    assert recorded["batchscore.job_hash"] == marker["output_hash"]  # the completion marker's identity
    assert recorded["batchscore.version"] == batchscore.__version__
    written = datetime.fromisoformat(recorded["batchscore.run_time"])
    assert written.tzinfo is not None and started - timedelta(seconds=1) <= written <= datetime.now(timezone.utc)


def test_a_labels_output_records_the_run_in_its_schema(tmp_path):
    data = write_sample_subset(tmp_path / "in.parquet", queries=2, product_ids=("P001", "P002"))
    started = datetime.now(timezone.utc)
    run_job(load_job(write_job(tmp_path, data)), progress=False)
    _check_provenance(tmp_path / "out.parquet", started)
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 4


@pytest.mark.slow  # a questions run and its report (~5 s); make test keeps the labels case
def test_a_questions_output_with_separator_holds_no_dot_and_reports(tmp_path):
    path = write_questions_job(tmp_path, score={"calibrate": "batch"}, calibrate=TRUTHS,
                               output={"column_separator": "__", "review": {"max_error": 0.5}})
    started = datetime.now(timezone.utc)
    result = CliRunner().invoke(main, ["run", str(path), "-q", "--report"])
    assert result.exit_code == 0, result.output
    out = tmp_path / "out.parquet"
    names = pq.read_schema(out).names
    assert not [name for name in names if "." in name], names
    for q in questions():  # every question's columns, joined by "__"
        assert f"{q.key}__status" in names and f"{q.key}__label_mass" in names
        assert all(f"{q.key}__p_cal__{option}" in names for option in q.options)
    assert "team__choice" in names and "team__needs_review" in names
    _check_provenance(out, started)
    assert _provenance(out)["batchscore.column_separator"] == "__"
    html = (tmp_path / "_out.parquet.report.html").read_text()  # the report reads the columns back by question
    assert all(f'id="q-{q.key}"' in html for q in questions())
    # each reviewed question says what output.review did (its threshold, or why none), as the labels page does
    summary = json.loads((tmp_path / "_out.parquet.complete.json").read_text())["summary"]
    for key, review in summary["review"]["questions"].items():
        section = html.split(f'id="q-{key}"', 1)[1].split('id="q-', 1)[0]
        assert "output.review" in section and (review["threshold"] is not None or review["reason"][:40] in section)


def test_column_names_that_would_collide_are_refused_at_load(tmp_path):
    """Under `column_separator: "__"` question `x` with option `status` and question `x__p` would both
    write `x__p__status`: refused by name before anything runs (one silently overwrote the other);
    a labels job's `p_<label>` keeps no dot under `__` either."""
    import yaml

    from batchscore.errors import JobConfigError
    from batchscore.jobfile import parse_set_options

    questions = {"x": {"type": "choice", "instructions": "Which?", "criteria": {"status": None, "other": None}},
                 "x__p": {"type": "noul", "instructions": "Is it?"}}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"input": {"path": "in.jsonl"}, "prompt": {"state_columns": ["s"]},
                                   "questions": questions, "output": {"path": "out.parquet"}}))
    load_job(job)  # with the separator '.', the names differ
    with pytest.raises(JobConfigError, match=r"would both be written as the column 'x__p__status'"):
        load_job(job, parse_set_options(["output.column_separator=__"]))
    labels = write_job(tmp_path, tmp_path / "in.parquet", labels=["3.5", "4"])
    load_job(labels)
    with pytest.raises(JobConfigError, match=r"'p_3.5' would still hold a dot"):
        load_job(labels, parse_set_options(["output.column_separator=__"]))
