"""The input's identity column by column: fix the data and rerun.

Truth and kept columns are assembly inputs: editing their values in the input file keeps every
scored part (a job stopped at assembly by a truth problem resumes without `--fresh`, a finished
output is assembled again), while an edit to a column a prompt is made of is a different job, as
before. The digests themselves: the same values give the same digest however the file is cut into
row groups, and a change names the column.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from batchscore import run_job
from batchscore.errors import CalibrationError, ResumeMismatch
from batchscore.jobfile import config_from_dict, load_job
from batchscore.output.identity import describe_changes, input_identities
from batchscore.prepare.input_columns import assembly_columns, scoring_columns
from tests.conftest import REPO, SAMPLE, write_job


@pytest.fixture
def forwards():
    """Counts every torch module forward in this process (the engines' and the audit's alike)."""
    import torch

    count = [0]
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda module, args: count.__setitem__(
        0, count[0] + 1))
    yield count
    handle.remove()


def _relevance(path, bad_row: int | None = None, **row_groups):
    """P001's ten sample rows with a truth column `relevant` (one value not a label at `bad_row`)
    and a pass-through column `note`."""
    rows = [r for r in pq.read_table(SAMPLE).to_pylist() if r["product_id"] == "P001"]
    for i, r in enumerate(rows):
        r["relevant"] = "Maybe" if i == bad_row else ("Yes" if i % 3 == 0 else "No")
        r["note"] = f"note {i}"
    pq.write_table(pa.Table.from_pylist(rows), path, **row_groups)
    return path


def _edit(path, column: str, row: int, value) -> None:
    """Write `path` again with one value changed, as a user fixing the data would."""
    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    values[row] = value
    pq.write_table(table.set_column(table.schema.get_field_index(column), column, pa.array(values)), path)


def _labels_job(folder, data, **output):
    return load_job(write_job(folder, data, calibrate={"truth_column": "relevant"},
                              output={"path": str(folder / "out.parquet"), "keep_columns": ["product_id", "note"],
                                      "audit_rows": 0, "review": {"max_error": 0.3}, **output}))


# ---------------------------------------------------------------------------- the digests


def test_truth_and_kept_edits_leave_the_scoring_identity_and_a_prompt_edit_names_its_column(tmp_path):
    data = _relevance(tmp_path / "in.parquet")
    config = _labels_job(tmp_path, data)
    scoring, assembly = scoring_columns(config), assembly_columns(config)
    assert scoring == ["pair_id", "title", "description", "query"]
    assert assembly == ["product_id", "note", "relevant"]
    files = [(data, "parquet")]
    before = input_identities(files, scoring, assembly)

    _edit(data, "relevant", 4, "Yes")
    _edit(data, "note", 2, "edited")
    after = input_identities(files, scoring, assembly)
    assert after[0] == before[0]  # the scores' inputs are unchanged
    assert after[1] != before[1]  # the assembly's are not

    _edit(data, "query", 1, "a different query")
    edited = input_identities(files, scoring, assembly)
    assert edited[0] != before[0]
    assert describe_changes({"input": before[0]}, {"input": edited[0]}) == [
        f"input file {data.resolve()} changed (column 'query')"]


def test_the_same_values_cut_into_other_row_groups_have_the_same_digests(tmp_path):
    one = _relevance(tmp_path / "one.parquet")
    many = _relevance(tmp_path / "many.parquet", row_group_size=3)
    assert pq.ParquetFile(many).metadata.num_row_groups == 4
    columns = ["pair_id", "title", "query", "relevant"]
    [a], _ = input_identities([(one, "parquet")], columns, [])
    [b], _ = input_identities([(many, "parquet")], columns, [])
    assert a["columns"] == b["columns"] and a["rows"] == b["rows"] == 10


def test_a_questions_jobs_truth_columns_are_assembly_inputs():
    config = config_from_dict({"input": {"path": "in.parquet", "id_column": "ticket_id"},
                               "prompt": {"state_columns": ["subject", "body"]},
                               "questions": {"refund": {"type": "noul", "instructions": "Refund?"}},
                               "calibrate": {"truth_columns": {"refund": "true_refund"}},
                               "output": {"path": "out.parquet", "keep_columns": ["subject", "channel"]}})
    assert scoring_columns(config) == ["ticket_id", "subject", "body"]
    assert assembly_columns(config) == ["channel", "true_refund"]  # subject is a state column: scoring


def test_files_without_columns_stay_whole(tmp_path):
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"q": "a", "t": "Yes"}\n')
    scoring, assembly = input_identities([(lines, "jsonl")], ["q"], ["t"])
    assert set(scoring[0]) == {"file", "size", "digest"} and assembly == []
    openai = config_from_dict({"input": {"path": "b.jsonl", "format": "openai_batch"}, "labels": ["Yes", "No"],
                               "output": {"path": "out.jsonl"}})
    assert scoring_columns(openai) is None  # the request bodies are the prompts


# ---------------------------------------------------------------------------- real runs


@pytest.mark.slow  # two real runs
def test_a_truth_problem_fixed_in_the_input_reruns_without_fresh_and_without_a_forward(tmp_path, forwards):
    data = _relevance(tmp_path / "in.parquet", bad_row=3)
    with pytest.raises(CalibrationError) as caught:
        run_job(_labels_job(tmp_path, data), progress=False)
    assert caught.value.exit_code == 2 and "'Maybe'" in str(caught.value)
    assert (tmp_path / "out.parquet.parts").is_dir() and not (tmp_path / "out.parquet").exists()

    _edit(data, "relevant", 3, "Yes")  # the fix, in the input file itself
    forwards[0] = 0
    summary = run_job(_labels_job(tmp_path, data), progress=False)  # no --fresh
    assert forwards[0] == 0 and summary.resumed_rows == 10 and summary.rows_ok == 10
    assert summary.quality.review is not None
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("relevant").to_pylist()[3] == "Yes"
    assert run_job(_labels_job(tmp_path, data), progress=False).skipped  # finished is finished


@pytest.mark.slow  # three real runs
def test_a_kept_edit_reassembles_and_a_prompt_edit_scores_again(tmp_path, forwards):
    data = _relevance(tmp_path / "in.parquet")
    first = run_job(_labels_job(tmp_path, data), progress=False)
    assert forwards[0] > 0 and first.rows_ok == 10
    raw = ["pair_id", "p_Yes", "p_No", "label_mass"]
    before = pq.read_table(tmp_path / "out.parquet")

    _edit(data, "note", 5, "edited note")
    forwards[0] = 0
    second = run_job(_labels_job(tmp_path, data), progress=False)
    assert forwards[0] == 0 and second.rederived  # nothing scored
    after = pq.read_table(tmp_path / "out.parquet")
    assert after.column("note").to_pylist()[5] == "edited note"
    assert after.select(raw).equals(before.select(raw))

    _edit(data, "query", 0, "a cordless drill for a beginner")  # the prompt of row 0: another job
    third = run_job(_labels_job(tmp_path, data), progress=False)
    assert forwards[0] > 0 and not third.rederived and not third.skipped and third.resumed_rows == 0
    final = pq.read_table(tmp_path / "out.parquet")
    assert final.column("p_Yes").to_pylist()[0] != before.column("p_Yes").to_pylist()[0]
    assert final.column("p_Yes").to_pylist()[1:] == pytest.approx(before.column("p_Yes").to_pylist()[1:], abs=1e-4)


@pytest.mark.slow  # two real runs
def test_a_prompt_edit_during_a_stopped_run_is_refused_naming_the_column(tmp_path):
    data = _relevance(tmp_path / "in.parquet", bad_row=3)
    with pytest.raises(CalibrationError):
        run_job(_labels_job(tmp_path, data), progress=False)
    _edit(data, "relevant", 3, "Yes")
    _edit(data, "title", 2, "another title")
    with pytest.raises(ResumeMismatch, match=r"in\.parquet changed \(column 'title'\).*--fresh"):
        run_job(_labels_job(tmp_path, data), progress=False)


TICKET_TRUTH = ["billing", "shipping", "security", "shipping", "other", "billing", "security", "shipping",
                "shipping", "billing", "security", "shipping"]


@pytest.mark.slow  # two real runs
def test_a_questions_truth_problem_fixed_in_the_input_reruns_without_a_forward(tmp_path, forwards):
    rows = [json.loads(line) for line in (REPO / "sample_data" / "tickets.jsonl").read_text().splitlines()]
    for row, team in zip(rows, TICKET_TRUTH):
        row["true_team"] = team
    rows[4]["true_team"] = "sales"  # not an option of the question
    data = tmp_path / "tickets.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    questions = yaml.safe_load((REPO / "jobs" / "decisions.yaml").read_text())["questions"]
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "input": {"path": str(data), "id_column": "ticket_id"},
        "prompt": {"state_columns": ["subject", "body"], "system": "You route customer-support tickets."},
        "questions": {"team": questions["team"]}, "model": "smollm2-135m-instruct",
        "engine": {"kind": "torch", "dtype": "float32"}, "calibrate": {"truth_columns": {"team": "true_team"}},
        "score": {"calibrate": "batch"},
        "output": {"path": str(tmp_path / "out.parquet"), "audit_rows": 0}}, sort_keys=False))
    with pytest.raises(CalibrationError) as caught:
        run_job(load_job(job), progress=False)
    assert caught.value.exit_code == 2 and "'sales'" in str(caught.value)

    _edit(data, "true_team", 4, "other")
    forwards[0] = 0
    summary = run_job(load_job(job), progress=False)
    assert forwards[0] == 0 and summary.resumed_rows == summary.questions.reads == 12
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("true_team").to_pylist() == TICKET_TRUTH
    assert pc.all(pc.equal(out.column("status"), "ok")).as_py()
