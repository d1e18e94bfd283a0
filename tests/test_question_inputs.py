"""Questions jobs' inputs read as the values they are: a map column of the state is an object,
and a record that failed as a whole is reported once, under no question."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from batchscore.jobfile import config_from_dict
from batchscore.run.open import open_job, prepare_job


def test_a_map_state_column_is_an_object_and_a_repeated_map_key_is_that_rows_error(tmp_path):
    data = tmp_path / "in.parquet"
    attrs = pa.array([[("size", "L"), ("color", "red")], [("size", "S"), ("size", "M")], []],
                     pa.map_(pa.string(), pa.string()))
    pq.write_table(pa.table({"id": ["a", "b", "c"], "subject": ["Shirt", "Shoe", "Hat"], "attrs": attrs}), data)
    config = config_from_dict({"input": {"path": str(data), "id_column": "id"},
                               "prompt": {"state_columns": ["subject", "attrs"]},
                               "questions": {"fits": {"type": "noul", "instructions": "Does it fit?"}},
                               "output": {"path": str(tmp_path / "out.parquet")}})
    prepared = prepare_job(config, source=open_job(config, for_output=False)).input
    a, b, c = prepared.task_input.records
    assert json.loads(a.request.state_text) == {"subject": "Shirt", "attrs": {"size": "L", "color": "red"}}
    assert json.loads(c.request.state_text)["attrs"] == {}  # an empty map is an empty object, not a list
    assert b.request is None
    assert b.error == f"{data}:2: field 'attrs': the map holds 'size' twice; an object holds a key once"


def test_per_row_questions_as_json_text_refuse_a_key_written_twice(tmp_path):
    data = tmp_path / "in.parquet"
    good = json.dumps({"fits": {"type": "noul", "instructions": "Does it fit?"}})
    twice = '{"fits": {"type": "noul", "instructions": "Does it fit?"}, "fits": {"type": "noul", "instructions": "Red?"}}'
    pq.write_table(pa.table({"id": ["a", "b"], "subject": ["Shirt", "Shoe"], "qs": [good, twice]}), data)
    config = config_from_dict({"input": {"path": str(data), "id_column": "id", "questions_column": "qs"},
                               "prompt": {"state_columns": ["subject"]}, "output": {"path": str(tmp_path / "o.parquet")}})
    a, b = prepare_job(config, source=open_job(config, for_output=False)).input.task_input.records
    assert a.error is None and [q.key for q in a.request.questions] == ["fits"]
    assert b.error == f"{data}:2: field 'qs': key 'fits' appears twice in one JSON object; a JSON reader keeps only the last"


def test_a_record_that_failed_as_a_whole_is_reported_once_under_no_question(tmp_path):
    from batchscore.report import write_report
    from batchscore.tasks.questions.report import read_questions

    null = pa.array([None] * 3, pa.float64())
    table = pa.table({
        "id": ["a", "b", "c"],
        "team.choice": ["billing", None, None], "team.p.billing": [0.7, None, None],
        "team.p.shipping": [0.3, None, None], "team.confidence": [0.4, None, None],
        "team.label_mass": [0.9, None, None], "team.argmax_is_label": [True, None, None],
        "team.status": ["ok", "error", None], "team.error": [None, "question 'team': has 300 options", None],
        "refund.p_yes": [0.8, 0.3, None], "refund.confidence": null, "refund.label_mass": [0.9, 0.9, None],
        "refund.argmax_is_label": [True, True, None], "refund.status": ["ok", "ok", None],
        "refund.error": pa.array([None] * 3, pa.string()),
        "status": ["ok", "error", "error"], "error": [None, "team: has 300 options", "in.jsonl:3: not valid JSON"]})
    team, refund = read_questions(table)
    assert (team.answered, team.failed, team.whole) == (1, 1, 1)
    assert team.errors == {"question 'team': has 300 options": 1}  # its own failure only
    assert (refund.answered, refund.failed, refund.whole, refund.errors) == (2, 0, 1, {})
    path = tmp_path / "out.parquet"
    pq.write_table(table, path)
    html = write_report(path).read_text()
    assert html.count("in.jsonl:3: not valid JSON") == 1  # once, in the summary



def test_a_null_state_column_is_the_json_value_null_and_the_row_is_scored(tmp_path):
    """README ("What a run guarantees") and jobs.md agree with the reader: in a `state_columns` job a
    null column is part of the state, shown as JSON null, and the record is read (no row error);
    a null field a template names stays a row error (test_bad_inputs)."""
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "subject": ["Shirt", None], "size": [None, "M"]}), data)
    config = config_from_dict({"input": {"path": str(data), "id_column": "id"},
                               "prompt": {"state_columns": ["subject", "size"]},
                               "questions": {"fits": {"type": "noul", "instructions": "Does it fit?"}},
                               "output": {"path": str(tmp_path / "out.parquet")}})
    prepared = prepare_job(config, source=open_job(config, for_output=False)).input
    a, b = prepared.task_input.records
    assert a.error is None and b.error is None
    assert json.loads(a.request.state_text) == {"subject": "Shirt", "size": None}
    assert json.loads(b.request.state_text) == {"subject": None, "size": "M"}
