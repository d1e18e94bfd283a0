"""The input's identity column by column: fix the data and rerun.

Truth and kept columns are assembly inputs: editing their values in the input file keeps every
scored part (a job stopped at assembly by a truth problem resumes without `--fresh`, a finished
output is assembled again), while an edit to a column a prompt is made of is a different job, as
before. The digests themselves: the same values give the same digest however the file is cut into
row groups, and a change names the column.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchscore import run_job
from batchscore.cli import main
from batchscore.errors import CalibrationError, ResumeMismatch
from batchscore.jobfile import config_from_dict, load_job
from batchscore.output.identity import describe_changes, input_identities
from batchscore.run.open import assembly_columns, input_columns, line_reader, scoring_columns
from batchscore.task import InputColumns, register, task_for, unregister
from tests.conftest import REPO, SAMPLE, write_job


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


def _line_identity(config, path):
    columns = input_columns(config)
    return input_identities([(path, "jsonl")], list(columns.scoring), assembly_columns(config),
                            line_reader(config, columns))


def _write_lines(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_a_json_lines_input_is_fingerprinted_column_by_column_as_its_reader_decodes_it(tmp_path):
    data = tmp_path / "in.jsonl"
    rows = [{"pair_id": f"P{i}", "query": f"q {i}", "title": "t", "description": "d", "relevant": "Yes",
             "note": {"n": i}} for i in range(5)]
    _write_lines(data, rows)
    config = _labels_job(tmp_path, data)
    before = _line_identity(config, data)
    assert set(before[0][0]["columns"]) == {"pair_id", "title", "description", "query"}
    assert before[0][0]["rows"] == 5 and "unread" not in before[0][0]

    # the same values written otherwise (keys reordered, spaces, a blank line): the same identity
    data.write_text("\n".join(json.dumps(dict(reversed(list(r.items()))), indent=None, separators=(" ,", ": "))
                              for r in rows) + "\n\n")
    assert _line_identity(config, data) == before

    rows[2]["relevant"], rows[3]["note"] = "No", {"n": "edited"}  # truth and kept edits: assembly only
    _write_lines(data, rows)
    truth_fixed = _line_identity(config, data)
    assert truth_fixed[0] == before[0] and truth_fixed[1] != before[1]

    rows[1]["title"] = "another title"  # a prompt field: another job, named
    _write_lines(data, rows)
    edited = _line_identity(config, data)
    assert describe_changes({"input": before[0]}, {"input": edited[0]}) == [
        f"input file {data.resolve()} changed (column 'title')"]

    rows[1]["title"] = "t"
    _write_lines(data, rows)
    data.write_text(data.read_text().replace('"note": {"n": 4}', '"note": {"n": 4'))  # a line no longer JSON
    broken = _line_identity(config, data)
    assert broken[0][0]["unread"] and describe_changes({"input": before[0]}, {"input": broken[0]}) == [
        f"input file {data.resolve()} changed (which lines can be read)"]


def test_token_ids_of_a_json_lines_input_are_digested_as_each_line_writes_them(tmp_path):
    """Token lists are read per line as JSON text, as scoring reads them: one line's NaN does not
    retype the other lines' lists, so it changes the digest of its column alone."""
    data = tmp_path / "in.jsonl"
    rows = [{"id": i, "tokens": [1, 2, 3 + i], "truth": "Yes"} for i in range(3)]
    _write_lines(data, rows)
    config = config_from_dict({"input": {"path": str(data), "id_column": "id", "token_ids_column": "tokens"},
                               "labels": ["Yes", "No"], "calibrate": {"truth_column": "truth"},
                               "output": {"path": str(tmp_path / "out.parquet")}})
    assert input_columns(config).as_json == ("tokens",)
    before = _line_identity(config, data)
    assert before[0][0]["columns"].keys() == {"id", "tokens"} and before[1][0]["columns"].keys() == {"truth"}
    data.write_text(data.read_text().replace("[1, 2, 4]", "[1, 2, 4.0]"))
    assert describe_changes({"input": before[0]}, {"input": _line_identity(config, data)[0]}) == [
        f"input file {data.resolve()} changed (column 'tokens')"]


def test_files_whose_lines_are_requests_stay_whole(tmp_path):
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"q": "a", "t": "Yes"}\n')
    scoring, assembly = input_identities([(lines, "jsonl")], ["q"], ["t"])  # no reader given: whole
    assert set(scoring[0]) == {"file", "size", "digest"} and assembly == []
    openai = config_from_dict({"input": {"path": str(lines), "format": "openai_batch"}, "labels": ["Yes", "No"],
                               "output": {"path": "out.jsonl"}})
    assert input_columns(openai) is None and scoring_columns(openai) is None  # the request bodies are the prompts
    assert line_reader(openai, None)(lines, "openai_batch", ["custom_id"]) is None
    plain = config_from_dict({"input": {"path": str(lines)}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"],
                              "output": {"path": "out.parquet"}})
    [whole], assembly = _line_identity(plain, lines)  # no truth or kept column: the bytes say as much
    assert set(whole) == {"file", "size", "digest"} and assembly == []


def test_the_task_says_which_columns_its_requests_are_built_from(tmp_path):
    labels = config_from_dict({"input": {"path": "in.jsonl", "id_column": "id", "choices_column": "options"},
                               "prompt": {"template": "{a} and {b}"}, "output": {"path": "out.parquet"}})
    questions = config_from_dict({"input": {"path": "in.jsonl", "id_column": "id", "questions_column": "asks"},
                                  "prompt": {"state_columns": ["a"]}, "output": {"path": "out.parquet"}})
    assert task_for(labels).input_columns(labels) == InputColumns(("id", "a", "b", "options"))
    assert task_for(questions).input_columns(questions) == InputColumns(("id", "a", "asks"), ("asks",))
    toy = replace(task_for(labels), name="toy", claims=lambda config, files: True, default=False, input_columns=None)
    register(toy)
    try:
        assert input_columns(labels) is None  # a task that does not say: every file whole
    finally:
        unregister("toy")
    assert input_columns(labels) is not None


# ---------------------------------------------------------------------------- real runs


@pytest.mark.slow  # two real runs
def test_a_truth_problem_fixed_in_the_input_reruns_without_fresh_and_without_a_forward(tmp_path, forwards):
    data = _relevance(tmp_path / "in.parquet", bad_row=3)
    with pytest.raises(CalibrationError) as caught:
        run_job(_labels_job(tmp_path, data), progress=False)
    assert caught.value.exit_code == 2 and "'Maybe'" in str(caught.value)
    assert (tmp_path / "_out.parquet.parts").is_dir() and not (tmp_path / "out.parquet").exists()

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


def _ticket_rows_with_a_bad_truth() -> list[dict]:
    """The shipped tickets with a `true_team` column; row 4's value names no option of the question."""
    rows = [json.loads(line) for line in (REPO / "sample_data" / "tickets.jsonl").read_text().splitlines()]
    for row, team in zip(rows, TICKET_TRUTH):
        row["true_team"] = team
    rows[4]["true_team"] = "sales"
    return rows


def _team_job(folder, data, **output):
    """A questions job asking the shipped `team` question of `data`, calibrated against `true_team`."""
    questions = yaml.safe_load((REPO / "jobs" / "decisions.yaml").read_text())["questions"]
    job = folder / "job.yaml"
    job.write_text(yaml.safe_dump({
        "input": {"path": str(data), "id_column": "ticket_id"},
        "prompt": {"state_columns": ["subject", "body"], "system": "You route customer-support tickets."},
        "questions": {"team": questions["team"]}, "model": "smollm2-135m-instruct",
        "engine": {"kind": "torch", "dtype": "float32"}, "calibrate": {"truth_columns": {"team": "true_team"}},
        "score": {"calibrate": "batch"},
        "output": {"path": str(folder / "out.parquet"), "audit_rows": 0, **output}}, sort_keys=False))
    return job


@pytest.mark.slow  # two real runs
def test_a_questions_truth_problem_fixed_in_the_input_reruns_without_a_forward(tmp_path, forwards):
    data = tmp_path / "tickets.parquet"
    pq.write_table(pa.Table.from_pylist(_ticket_rows_with_a_bad_truth()), data)
    job = _team_job(tmp_path, data)
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


@pytest.mark.slow  # one real run scores, two read
def test_a_questions_truth_problem_fixed_in_a_json_lines_input_reruns_without_fresh(tmp_path, forwards):
    """The shipped tickets as JSON Lines with a truth column: a truth value no option names stops
    assembly with exit 2; fixing it in the file reruns to exit 0 with nothing scored, while a state
    field edited beside it is refused, naming the field."""
    rows = _ticket_rows_with_a_bad_truth()
    data = tmp_path / "tickets.jsonl"
    _write_lines(data, rows)
    job = _team_job(tmp_path, data, keep_columns=["subject"])
    first = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert first.exit_code == 2 and "'sales'" in first.output, first.output
    assert forwards[0] > 0 and not (tmp_path / "out.parquet").exists()

    rows[4]["true_team"] = "other"  # the fix
    body = rows[7]["body"]
    rows[7]["body"] += " Please hurry."  # a state field: what the reads are made of
    _write_lines(data, rows)
    forwards[0] = 0
    refused = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert refused.exit_code == 2 and "tickets.jsonl changed (column 'body')" in refused.output, refused.output
    assert "--fresh" in refused.output and forwards[0] == 0

    rows[7]["body"] = body  # the state as it was, the truth fixed
    _write_lines(data, rows)
    rerun = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert rerun.exit_code == 0, rerun.output
    assert forwards[0] == 0  # nothing scored: every read came from the kept parts
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.column("true_team").to_pylist() == TICKET_TRUTH
    assert pc.all(pc.equal(out.column("status"), "ok")).as_py()
    summary = json.loads((tmp_path / "_out.parquet.complete.json").read_text())["summary"]
    assert summary["resumed_rows"] == 12


def test_a_large_input_of_lines_counts_an_edit_in_its_middle(tmp_path, monkeypatch):
    """A CSV (or any input of lines) larger than FULL_HASH_BYTES is hashed whole: an edit in its
    middle changes its fingerprint (sampled, it went unnoticed on resume); a large weight file
    (no format) is still sampled."""
    import batchscore.output.identity as identity

    monkeypatch.setattr(identity, "FULL_HASH_BYTES", 1024)
    lines = [f"{i},text number {i}\n" for i in range(200_000)]
    path = tmp_path / "in.csv"
    path.write_text("id,text\n" + "".join(lines))
    before = identity.file_digest(path, "csv")
    middle = len(lines) * 3 // 10  # between the three 1 MiB samples of the ~4.6 MB file
    lines[middle] = lines[middle].replace("text", "TEXT")
    path.write_text("id,text\n" + "".join(lines))
    assert identity.file_digest(path, "csv") != before
    assert identity.file_digest(path).startswith("sampled:")


_HELD_WHILE_DIGESTING = """
import sys
import numpy as np, pyarrow as pa, pyarrow.parquet as pq
from batchscore.output.identity import input_identities
rows, path = int(sys.argv[1]), sys.argv[2]
tokens = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * 8 + 1, 8, dtype=np.int32)),
                                  pa.array(np.arange(rows * 8, dtype=np.int32) % 49152))
pq.write_table(pa.table({"id": np.arange(rows), "tokens": tokens}), path, row_group_size=50_000)
del tokens
pool = pa.default_memory_pool()
start = pool.max_memory()
input_identities([(path, "parquet")], ["tokens", "id"], [])
print(pool.max_memory() - start)
"""


def test_fingerprinting_a_parquet_input_holds_a_row_group_not_the_file(tmp_path):
    """The scoring identity reads every scoring column of a local Parquet input; the Arrow memory
    it holds while doing so must not grow with the file (a fragment that pre-buffers keeps every
    row group it has read: ~100 bytes a row of a 48-token input, 1 GB at 10M rows). Rows of 8
    tokens, both files several read batches long."""
    import subprocess
    import sys

    held = {}
    for rows in (150_000, 1_500_000):
        out = subprocess.run([sys.executable, "-c", _HELD_WHILE_DIGESTING, str(rows), str(tmp_path / f"{rows}.parquet")],
                             capture_output=True, text=True, check=True, cwd=REPO)
        held[rows] = int(out.stdout.split()[-1])
    assert held[1_500_000] < held[150_000] + 8 * 2**20, held  # 10x the rows: not ~50 MB more


def test_a_refused_resume_names_the_job_keys_that_changed():
    """A resume of another configuration is refused naming each key that changed and its values
    (it said only "the job configuration"; engine.threads was the change)."""
    before = {"config": {"engine": {"threads": 2, "kind": "torch"}, "labels": ["Yes", "No"]}}
    now = {"config": {"engine": {"threads": 1, "kind": "torch"}, "labels": ["Yes", "Maybe"]}}
    assert describe_changes(before, now) == [
        "the job configuration (engine.threads: 2 → 1; labels: ['Yes', 'No'] → ['Yes', 'Maybe'])"]
