"""Questions jobs (`questions:` over a table) hold the guarantees labels jobs hold.

Per-row questions written as JSON objects are read per line, never merged across rows; a
misspelt or missing column (state, id, keep, truth) is refused before any work with exit 3, a
kept or truth column named like an answer column with exit 2; everything a job file can hold is
checked at load (YAML number and boolean keys become text, noul's `{true: .., false: ..}` as the
docs show it; colliding question columns refused); state columns of any Parquet type are read
(dates, timestamps, decimals as text; binary refused naming the column); a truth column of
1.0/0.0/NaN (pandas float64) is truth; truth for some questions calibrates and reviews those,
and says so for the others. One real run (smollm2, float32) writes what these promise.
"""

from __future__ import annotations

import datetime
import decimal
import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.config import safe_load_yaml
from batchscore.errors import JobConfigError
from batchscore.jobfile import config_from_dict, load_job
from batchscore.tasks.questions.quality import add_question_quality, column_types, truth_index
from batchscore.tasks.questions.answers import read_answer
from batchscore.tasks.questions.requests import parse_systemone
from batchscore.run.open import prepare_job
from tests.conftest import REPO

TICKETS = [json.loads(line) for line in (REPO / "sample_data" / "tickets.jsonl").read_text().splitlines()]
QUESTIONS = yaml.safe_load((REPO / "jobs" / "decisions.yaml").read_text())["questions"]  # the shipped example's


def write_job(folder: Path, rows: list[dict] | None = None, *, source: Path | None = None, **sections) -> Path:
    """A `questions:` job over `rows` (JSONL) or `source`; `sections` are merged into the job."""
    folder.mkdir(parents=True, exist_ok=True)
    if source is None:
        source = folder / "tickets.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in (rows if rows is not None else TICKETS[:2])))
    job = {"input": {"path": str(source), "id_column": "ticket_id"},
           "prompt": {"state_columns": ["subject", "body"]},
           "questions": QUESTIONS, "model": "smollm2-135m-instruct",
           "engine": {"kind": "torch", "dtype": "float32"},
           "output": {"path": str(folder / "out.parquet"), "audit_rows": 0}}
    for key, value in sections.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) and key != "questions" else value
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run(path: Path, *args):
    result = CliRunner().invoke(main, ["run", str(path), "-q", *map(str, args)])
    assert "Traceback" not in result.output, result.output
    return result


# ---------------------------------------------------------------------------- per-row questions


def test_per_row_question_objects_are_read_per_line(tmp_path):
    """A JSONL column of objects is each line's own JSON: row B sees only its own options, never
    row A's question ids or options (a unified struct gave every row every row's keys)."""
    mine = {"kind": {"type": "choice", "criteria": {"billing": None, "shipping": None}}}
    theirs = {"kind": {"type": "choice", "criteria": {"x": None, "y": None, "z": None}}, "extra": {"type": "noul"}}
    rows = [{**TICKETS[0], "qs": mine}, {**TICKETS[1], "qs": theirs}, {**TICKETS[2], "qs": None}]
    path = write_job(tmp_path, rows, input={"questions_column": "qs"})
    data = yaml.safe_load(path.read_text())
    del data["questions"]
    path.write_text(yaml.safe_dump(data))
    prepared = prepare_job(load_job(path), tokenize=False)
    a, b, c = (r.request for r in prepared.input.task_input.records)
    assert [(q.key, q.options) for q in a.questions] == [("kind", ("billing", "shipping"))]
    assert [(q.key, q.options) for q in b.questions] == [("kind", ("x", "y", "z")), ("extra", ("yes", "no"))]
    assert c is None and "questions" in prepared.input.task_input.records[2].error


def test_a_parquet_struct_questions_column_is_refused(tmp_path):
    rows = [{**TICKETS[0], "qs": {"kind": {"type": "noul"}}}, {**TICKETS[1], "qs": {"other": {"type": "noul"}}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    path = write_job(tmp_path, source=tmp_path / "in.parquet", input={"questions_column": "qs"})
    result = run(path)
    assert result.exit_code == 3, result.output
    assert "input.questions_column 'qs'" in result.output and "JSON text" in result.output


# ---------------------------------------------------------------------------- columns, before any work


@pytest.mark.parametrize("sections, column, key", [
    ({"prompt": {"state_columns": ["subjekt", "body"]}}, "subjekt", "prompt.state_columns"),
    ({"prompt": {"state_columns": None, "template": "{subject}: {bdy}"}}, "bdy", "prompt.template"),
    ({"input": {"id_column": "ticket"}}, "ticket", "input.id_column"),
    ({"output": {"keep_columns": ["subjet"]}}, "subjet", "output.keep_columns"),
    ({"calibrate": {"truth_columns": {"team": "true_team"}}}, "true_team", "calibrate.truth_columns.team"),
    ({"input": {"questions_column": "qz"}}, "qz", "input.questions_column"),
])
def test_a_missing_column_is_refused_before_any_work(tmp_path, sections, column, key):
    result = run(write_job(tmp_path, **sections))
    assert result.exit_code == 3, result.output
    assert f"{column!r}: {key}" in result.output and "the file has columns" in result.output
    assert not (tmp_path / "out.parquet").exists()


@pytest.mark.parametrize("sections, key, column", [
    ({"output": {"keep_columns": ["team.choice"]}}, "output.keep_columns", "team.choice"),
    ({"output": {"keep_columns": ["status"]}}, "output.keep_columns", "status"),
    ({"calibrate": {"truth_columns": {"refund": "refund.p_yes"}}}, "calibrate.truth_columns.refund", "refund.p_yes"),
    ({"input": {"questions_column": "qs"}, "output": {"keep_columns": ["answers"]}}, "output.keep_columns",
     "answers"),
    ({"score": {"calibrate": "batch"}, "output": {"keep_columns": ["mood.p_cal.0"]}}, "output.keep_columns",
     "mood.p_cal.0"),
])
def test_a_kept_column_named_like_an_answer_column_is_refused(tmp_path, sections, key, column):
    result = run(write_job(tmp_path, **sections))
    assert result.exit_code == 2, result.output
    assert f"{key}: {column!r} is also a column batchscore writes" in result.output


# ---------------------------------------------------------------------------- the job file, at load


def config(**sections):
    job = {"input": {"path": "in.jsonl"}, "prompt": {"state_columns": ["subject"]}, "questions": QUESTIONS,
           "model": "smollm2-135m-instruct", "output": {"path": "out.parquet"}}
    job.update(sections)
    return config_from_dict(job)


def test_yaml_number_and_boolean_keys_are_text():
    """`{true: .., false: ..}` (noul, as docs/jobs.md shows it), `{1: .., 2: ..}` options and a
    number id load as the text JSON writes them."""
    questions = safe_load_yaml("""
refund: {type: noul, criteria: {true: they want money back, false: they do not}}
7: {type: choice, criteria: {1: one, 2: two}}
flag: {type: choice, criteria: {true: set, false: unset}}
""")
    loaded = config(questions=questions, calibrate={"truth_columns": {7: "t"}})
    assert loaded.questions["refund"]["criteria"] == {"true": "they want money back", "false": "they do not"}
    assert list(loaded.questions) == ["refund", "7", "flag"] and list(loaded.questions["7"]["criteria"]) == ["1", "2"]
    assert loaded.calibrate.truth_columns == {"7": "t"}
    parsed = parse_systemone({"state": "", "questions": loaded.questions}).questions
    assert parsed[0].descriptions == ("they want money back", "they do not")
    assert parsed[1].options == ("1", "2") and parsed[2].options == ("true", "false")


@pytest.mark.parametrize("questions, message", [
    ({"a": {"type": "choice", "criteria": {1.5: None, "b": None}}}, "questions.a.criteria: the key 1.5 is a float"),
    ({"a": {"type": "choice", "criteria": {1: None, "1": None}}}, "the keys '1' and '1' are the same"),
    ({"a": {"type": "choice", "criteria": {"x.status": None, "y": None}}, "a.p.x": {"type": "noul"}},
     "two questions' columns are both named 'a.p.x.status'"),
])
def test_question_maps_that_cannot_be_written_are_refused_at_load(questions, message):
    with pytest.raises(JobConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        config(questions=questions)


def test_a_calibration_column_named_like_another_questions_answer_is_refused_at_load():
    questions = {"a": {"type": "choice", "criteria": {"x": None, "y": None}},
                 "a.p_cal": {"type": "choice", "criteria": {"q": None, "r": None}}}
    config(questions=questions)  # without calibration the names differ
    with pytest.raises(JobConfigError, match="both a question's answer column and a calibration"):
        questions["a"]["criteria"] = {"choice": None, "y": None}
        config(questions=questions, score={"calibrate": "batch"})


def test_a_binary_state_column_is_refused_naming_it(tmp_path):
    rows = [{**TICKETS[0], "raw": b"\x00\x01"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    result = run(write_job(tmp_path, source=tmp_path / "in.parquet", prompt={"state_columns": ["subject", "raw"]}))
    assert result.exit_code == 3, result.output
    assert "prompt.state_columns 'raw' is a binary column" in result.output


def test_dates_timestamps_and_decimals_in_the_state_are_text(tmp_path):
    when = datetime.datetime(2026, 11, 27, 5, 30, tzinfo=datetime.timezone.utc)
    table = pa.table({"ticket_id": ["T1"], "opened": pa.array([when], pa.timestamp("us", tz="UTC")),
                      "day": pa.array([when.date()], pa.date32()),
                      "amount": pa.array([decimal.Decimal("12.50")], pa.decimal128(6, 2)),
                      "waited": pa.array([datetime.timedelta(hours=3)], pa.duration("s")),
                      "history": pa.array([[when.date()]], pa.list_(pa.date32()))})
    pq.write_table(table, tmp_path / "in.parquet")
    path = write_job(tmp_path, source=tmp_path / "in.parquet",
                     prompt={"state_columns": ["opened", "day", "amount", "waited", "history"]})
    [record] = prepare_job(load_job(path), tokenize=False).input.task_input.records
    assert record.error is None
    assert json.loads(record.request.state_text) == {"opened": "2026-11-27T05:30:00+00:00", "day": "2026-11-27",
                                                     "amount": "12.50", "waited": "3:00:00",
                                                     "history": ["2026-11-27"]}


# ---------------------------------------------------------------------------- truth


def parsed_questions():
    return parse_systemone({"state": "", "questions": QUESTIONS}).questions


def test_a_pandas_float_truth_column_of_ones_and_zeros_is_truth():
    refund = next(q for q in parsed_questions() if q.key == "refund")
    assert truth_index(refund, 1.0) == 0 and truth_index(refund, 0.0) == 1 and truth_index(refund, 0.5) is None
    mood = next(q for q in parsed_questions() if q.key == "mood")
    assert truth_index(mood, 2.0) == 2
    rng = np.random.default_rng(0)
    answers = [[read_answer(q, np.log(rng.dirichlet(np.ones(len(q.labels))) * 0.9)) for q in parsed_questions()]
               for _ in range(6)]
    kept = pa.table({"true_refund": pa.array([1.0, 0.0, float("nan"), None, 1.0, 0.0], pa.float64())})
    loaded = config(score={"calibrate": "batch"}, calibrate={"truth_columns": {"refund": "true_refund"}})
    _, _, result = add_question_quality(loaded, parsed_questions(), answers, kept, pa.array(list("abcdef")))
    assert result.calibration["questions"]["refund"]["labeled_rows"] == 4  # NaN and null: unlabeled


def test_truth_for_some_questions_calibrates_and_reviews_those_and_states_the_others(caplog):
    rng = np.random.default_rng(1)
    rows = 400
    team = parsed_questions()[0]
    answers = [[read_answer(q, np.log(rng.dirichlet(np.ones(len(q.labels))) * 0.9)) for q in parsed_questions()]
               for _ in range(rows)]
    kept = pa.table({"true_team": [team.options[i] for i in rng.integers(0, 4, rows)]})
    loaded = config(score={"calibrate": "temperature"}, calibrate={"truth_columns": {"team": "true_team"}},
                    output={"path": "out.parquet", "review": {"max_error": 0.5}})
    types = column_types(loaded, parsed_questions())
    assert [c for c in types if c.endswith("needs_review") or ".p_cal." in c] == \
        [f"team.p_cal.{o}" for o in team.options] + ["team.needs_review"]
    with caplog.at_level(logging.WARNING, logger="batchscore"):
        columns, follow, result = add_question_quality(loaded, parsed_questions(), answers, kept,
                                                       pa.array(np.arange(rows)))
    assert set(columns) == set(types) and set(follow) == {"team.choice"}
    summary = result.calibration["questions"]
    assert summary["team"]["calibrated"] and summary["team"]["params"]["temperature"] > 0
    for key in ("refund", "mood"):
        assert not summary[key]["calibrated"] and summary[key]["source"] == "no truth column: uncalibrated"
        assert result.review["questions"][key] == {"reviewed": False,
                                                   "reason": "no truth column (calibrate.truth_columns)"}
        assert f"question {key!r} has no truth column" in caplog.text
    assert "threshold" in result.review["questions"]["team"]


# ---------------------------------------------------------------------------- one real run


@pytest.mark.slow  # a real run of four tickets
def test_a_real_run_writes_text_options_objects_and_partial_truth(tmp_path):
    """YAML number/boolean option names answered and written as text, noul criteria as the docs
    show them, per-row question objects, a float truth column for one question of three."""
    questions = safe_load_yaml("""
team: {type: choice, instructions: "Which team?", criteria: {1: billing, 2: shipping, 3: security}}
refund: {type: noul, instructions: "Money back?", criteria: {true: they ask for a refund, false: they do not}}
""")
    rows = [{**t, "true_refund": v, "qs": q} for t, v, q in zip(
        TICKETS[:4], [1.0, 0.0, float("nan"), 1.0],
        [None, {"kind": {"type": "choice", "criteria": {"x": None, "y": None, "z": None}}},
         {"kind": {"type": "noul"}}, None])]
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "tickets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write_job(folder, source=folder / "tickets.jsonl", questions=questions,
                     input={"questions_column": "qs"}, score={"calibrate": "batch"},
                     calibrate={"truth_columns": {"refund": "true_refund"}})
    result = run(path)
    assert result.exit_code == 0, result.output
    table = pq.read_table(folder / "out.parquet").to_pylist()
    assert [r["status"] for r in table] == ["ok"] * 4
    assert all(r["team.choice"] in ("1", "2", "3") for r in table)
    assert set(json.loads(table[1]["answers"])["kind"]["probabilities"]) == {"x", "y", "z"}
    assert json.loads(table[2]["answers"])["kind"]["type"] == "noul"
    summary = json.loads((folder / "_out.parquet.complete.json").read_text())["summary"]
    assert summary["calibration"]["questions"]["refund"]["labeled_rows"] == 3
    assert summary["calibration"]["questions"]["team"]["truth_column"] is None
