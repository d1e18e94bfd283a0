"""More guarantees a hostile verification found broken: bad ids, job files whose keys collide,
API sections, signals, paths the run will write, and messages naming where a row came from."""

import json

import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_INPUT
from tests.test_hardening import invoke, write_job
from tests.test_questions_hardening import TICKETS, write_job as write_questions_job


# ---------------------------------------------------------------------------- ids

@pytest.mark.parametrize("rows", [[None, None], ["a", None, None]])
def test_null_ids_in_a_labels_job_are_refused_naming_the_line(tmp_path, rows):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": i, "t": [1, 2, 3]}) + "\n" for i in rows))
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(tmp_path / "out.parquet")})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_INPUT, result.output
    line = rows.index(None) + 1
    assert f"in.jsonl:{line}: input.id_column 'id' is null" in result.output
    assert not (tmp_path / "out.parquet").exists()


def test_null_ids_in_a_questions_job_are_refused_naming_the_line(tmp_path):
    rows = [{**t, "ticket_id": None} for t in TICKETS[:2]]
    result = CliRunner().invoke(main, ["run", str(write_questions_job(tmp_path, rows)), "-q"])
    assert result.exit_code == EXIT_INPUT, result.output
    assert "tickets.jsonl:1: input.id_column 'ticket_id' is null (and 1 more rows)" in result.output


# ---------------------------------------------------------------------------- job files

@pytest.mark.parametrize("questions, says", [
    ("  kind:\n    type: choice\n    options: {1: one, true: yes-ish}\n",
     "key 'true' written twice in one mapping, lines 7 and 7 (read as the same key as '1')"),
    ("  a:\n    type: yes_no\n  a:\n    type: choice\n    options: [x, y]\n",
     "key 'a' written twice in one mapping, lines 5 and 7"),
])
def test_a_key_written_twice_in_a_job_file_is_refused(tmp_path, questions, says):
    job = tmp_path / "job.yaml"
    job.write_text("model: smollm2-135m-instruct\ninput: {path: in.jsonl}\noutput: {path: out.parquet}\n"
                   "questions:\n" + questions)
    result = invoke("run", job, "-q")
    assert result.exit_code == 2, result.output
    assert says in result.output


def test_a_merge_may_override_the_keys_it_brings(tmp_path):
    from batchscore.config import safe_load_yaml

    assert safe_load_yaml("b: &b {x: 1, y: 2}\nc: {<<: *b, x: 3}")["c"] == {"x": 3, "y": 2}


# ---------------------------------------------------------------------------- the Python API

def test_the_callers_sections_win_over_keyword_defaults_and_a_clash_is_refused():
    import pandas as pd

    import batchscore

    df = pd.DataFrame({"q": ["refund please", "where is my parcel"]})
    common = dict(template="Q: {q}\nAnswer:", labels=[" yes please", " no"],
                  engine={"kind": "torch", "dtype": "float32", "threads": 1})
    by_section = batchscore.score_dataframe(df, score={"normalize": "byte"},
                                            output={"logprobs": True, "audit_rows": 0}, **common)
    by_keyword = batchscore.score_dataframe(df, normalize="byte", logprobs=True, output={"audit_rows": 0}, **common)
    by_sum = batchscore.score_dataframe(df, output={"audit_rows": 0}, **common)
    assert "logp_yes please" in by_section.columns
    assert by_section["p_yes please"].tolist() == by_keyword["p_yes please"].tolist()
    assert by_section["p_yes please"].tolist() != by_sum["p_yes please"].tolist()  # a 2-token and a 1-token option
    with pytest.raises(ValueError, match="normalize='token' and score={'normalize': 'byte'} disagree"):
        batchscore.score_dataframe(df, normalize="token", score={"normalize": "byte"}, **common)
