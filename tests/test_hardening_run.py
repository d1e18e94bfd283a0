"""Run-level promises kept on small jobs and through the Python API: the run's files (metrics,
Prometheus, report) written by `run_job` and `score_dataframe` as by `batchscore run`; a run
refused by the lock writes nothing of the holder's; SIGTERM anywhere exits 130 with metrics; the
completeness marker names its output by content; hostile inputs (NaN in token ids, deep YAML)
fail where they should and no wider."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_CONFIG, EXIT_INTERRUPTED, EXIT_LOCKED
from tests.conftest import REPO, write_job


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


# ---------------------------------------------------------------------------- the Python API


def test_score_dataframe_keeps_the_callers_id_column_and_prompt_section(tmp_path):
    import pandas as pd

    import batchscore

    df = pd.DataFrame({"key": ["a", "b"], "q": ["Is Paris in France?", "Is Paris in Japan?"]}, index=[5, 7])
    metrics, prom = tmp_path / "m.json", tmp_path / "m.prom"
    scores = batchscore.score_dataframe(  # through run_job(..., metrics=, metrics_prom=), as the CLI writes them
        df, template="Question: {{ q | upper }}\nAnswer Yes or No:", labels=["Yes", "No"],
        input={"id_column": "key"}, prompt={"engine": "jinja"}, engine={"dtype": "float32"},
        output={"audit_rows": 0}, metrics=str(metrics), metrics_prom=str(prom))
    assert list(scores.index) == [5, 7]
    assert "key" not in scores.columns and "row_id" not in scores.columns
    assert (scores["status"] == "ok").all()
    # the jinja template was rendered per row (the format engine would score one literal prompt twice)
    assert abs(scores.loc[5, "p_Yes"] - scores.loc[7, "p_Yes"]) > 1e-6
    recorded = json.loads(metrics.read_text())
    assert recorded["status"] == "ok" and recorded["rows"] == 2
    assert "batchscore_rows" in prom.read_text()



# ---------------------------------------------------------------------------- lock, SIGTERM


def test_a_run_refused_by_the_lock_writes_none_of_the_holders_files(tmp_path, small_input):
    from batchscore.output.layout import OutputFiles
    from batchscore.output.lock import OutputLock

    job = write_job(tmp_path, small_input)
    output = tmp_path / "out.parquet"
    metrics, prom = tmp_path / "shared.json", tmp_path / "shared.prom"
    metrics.write_text(json.dumps({"status": "ok", "exit_code": 0, "rows": 99}, indent=2))
    prom.write_text("# HELP batchscore_rows rows\nbatchscore_rows{job=\"holder\"} 99\n")
    before = metrics.read_bytes(), prom.read_bytes()
    with OutputLock(OutputFiles(str(output))):  # the holder, healthy
        result = invoke("run", job, "-q", "-o", output, "--metrics", metrics, "--metrics-prom", prom)
    assert result.exit_code == EXIT_LOCKED, result.output
    assert (metrics.read_bytes(), prom.read_bytes()) == before
    assert not output.exists()


def run_with_fault(job, output, fault, *extra):
    env = dict(os.environ, PYTHONPATH=str(REPO), BATCHSCORE_FAULT=fault)
    proc = subprocess.run([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "-o", str(output), *extra],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    return proc.returncode, proc.stdout


@pytest.mark.slow  # two subprocess runs, one with the audit's reference model
@pytest.mark.parametrize("point", ["start", "audit"])
def test_sigterm_at_any_moment_exits_130_and_writes_the_metrics(tmp_path, small_input, point):
    job = write_job(tmp_path, small_input, output={"audit_rows": 2})
    output, metrics = tmp_path / "out.parquet", tmp_path / "m.json"
    code, out = run_with_fault(job, output, f"{point}:1:TERM", "--metrics", str(metrics))
    assert code == EXIT_INTERRUPTED, out
    assert "Traceback" not in out
    recorded = json.loads(metrics.read_text())
    assert recorded["status"] == "failed" and recorded["exit_code"] == EXIT_INTERRUPTED
    code, out = run_with_fault(job, output, "none")  # the rerun finishes the job
    assert code == 0, out
    assert pq.read_table(output).num_rows == 12


# ---------------------------------------------------------------------------- the completeness marker


def test_the_marker_names_its_output_by_content(tmp_path):
    from batchscore.output.layout import OutputFiles
    from batchscore.output.parts import completed_summary, recorded_summary, write_completion_marker

    output = tmp_path / "out.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "p": [0.25, 0.75]}), output)
    files = OutputFiles(str(output))
    write_completion_marker(files, "job-hash", {"rows": 2})
    assert completed_summary(files, "job-hash") == {"rows": 2}
    original = output.read_bytes()
    pq.write_table(pa.table({"id": ["a", "b"], "p": [0.75, 0.25]}), output)  # the same size, other scores
    assert len(output.read_bytes()) == len(original) and output.read_bytes() != original
    assert completed_summary(files, "job-hash") is None and recorded_summary(files) is None


@pytest.mark.slow  # two full runs
def test_another_parquet_of_the_same_size_is_not_taken_for_the_finished_output(tmp_path, small_input):
    job = write_job(tmp_path, small_input)
    output = tmp_path / "out.parquet"
    assert invoke("run", job, "-q", "-o", output).exit_code == 0
    original = output.read_bytes()
    table = pq.read_table(output)
    ids = table.column("pair_id").to_pylist()
    swapped = table.set_column(0, "pair_id", pa.array(ids[1:] + ids[:1]))  # the same ids, another order
    pq.write_table(swapped.replace_schema_metadata(table.schema.metadata), output)
    tampered = output.read_bytes()
    if len(tampered) != len(original):  # the writer's layout differs: make the same size by hand
        tampered = bytearray(original)
        at = original.index(ids[0].encode())
        tampered[at:at + len(ids[0])] = ids[1].encode()
        output.write_bytes(bytes(tampered))
    assert len(output.read_bytes()) == len(original) and output.read_bytes() != original
    result = invoke("run", job, "-q", "-o", output)
    assert result.exit_code == 0, result.output
    assert "already the complete output" not in result.output
    assert pq.read_table(output).column("pair_id").to_pylist() == ids  # scored and written again


# ---------------------------------------------------------------------------- hostile inputs


def yaml_job(folder, **job):
    import yaml

    job = {"model": "smollm2-135m-instruct", "labels": ["Yes", "No"],
           "engine": {"kind": "torch", "dtype": "float32", "token_budget": 256}, **job}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, allow_unicode=True))
    return path


def test_a_bad_value_in_one_token_id_list_fails_only_that_row(tmp_path):
    values = {"ok": [1, 2, 3], "nan": [1, float("nan"), 3], "float": [1, 2.5, 3], "string": [1, "7", 3],
              "nested": [[1, 2], [3]], "bool": [1, True, 3], "text": "1 2 3", "also-ok": [4, 5, 6]}
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": k, "t": v}) + "\n" for k, v in values.items()))  # NaN as JSON allows
    out = tmp_path / "out.parquet"
    job = yaml_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                   output={"path": str(out), "max_error_rate": 1.0, "audit_rows": 0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out).to_pandas().set_index("id")
    assert list(rows.index) == list(values)  # every row exactly once, in order
    assert set(rows.index[rows["status"] == "ok"]) == {"ok", "also-ok"}
    for number, key in enumerate(values, start=1):
        if key not in ("ok", "also-ok"):
            assert rows.loc[key, "error"].startswith(f"{data}:{number}: field 't'"), rows.loc[key, "error"]


@pytest.mark.parametrize("style", ["flow", "block"])
def test_a_job_file_nested_5000_deep_is_exit_2_naming_the_depth(tmp_path, style):
    head = "labels: [Yes, No]\nprompt: {template: '{q}'}\ninput: {path: in.parquet}\n"
    if style == "flow":
        body = "engine: {vllm_args: {a: " + "[" * 5000 + "]" * 5000 + "}}\n"
    else:  # one space per level keeps it under the 1 MiB limit
        body = "".join(" " * i + f"k{i}:\n" for i in range(1200)) + " " * 1200 + "k: 1\n"
    job = tmp_path / "deep.yaml"
    job.write_text(head + body)
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "nested more than 100 deep" in result.output and "bug" not in result.output


# ---------------------------------------------------------------------------- calibrate.from, compiler cache


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished labels run (12 rows, every one too long to score): its output and completion marker."""
    from tests.conftest import write_sample_subset

    folder = tmp_path_factory.mktemp("finished")
    data = write_sample_subset(folder / "input.parquet", queries=4, product_ids=("P001", "P002", "P004"))
    job = write_job(folder, data, engine={"max_length": 8}, output={"max_error_rate": 1.0})  # no model load
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    return folder / "out.parquet"


@pytest.mark.parametrize("calibration, named", [
    ([1.0], "calibration is list"),
    ({"method": "temperature", "labels": ["Yes", "No"], "normalize": "sum", "params": [1.0]}, "not a mapping"),
    ({"method": "temperature", "labels": ["Yes", "No"], "normalize": "sum", "params": {"temperature": 0}},
     "temperature is 0; expected a finite number above 0"),
    ({"method": "temperature", "labels": ["Yes", "No"], "normalize": "sum", "params": {"temperature": "1"}},
     "temperature is '1'"),
])
def test_a_hand_edited_calibrate_from_marker_is_refused_before_scoring(tmp_path, finished_run, calibration, named):
    import shutil

    previous = tmp_path / "previous.parquet"
    shutil.copy(finished_run, previous)
    marker = json.loads(finished_run.with_name(f"_{finished_run.name}.complete.json").read_text())
    marker["summary"]["calibration"] = calibration
    previous.with_name(f"_{previous.name}.complete.json").write_text(json.dumps(marker))
    data = pq.read_table(finished_run.parent / "input.parquet")
    pq.write_table(data, tmp_path / "input.parquet")
    job = write_job(tmp_path, tmp_path / "input.parquet", score={"calibrate": "temperature"},
                    calibrate={"from": str(previous)})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert named in result.output and "calibrate.from" in result.output
    assert not (tmp_path / "out.parquet").exists()


def test_a_compiler_cache_path_that_is_a_file_is_dropped_before_torch_compiler_loads(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    code = ("import logging; logging.basicConfig()\n"
            "from batchscore.engines.torch.inductor_cache import use_usable_inductor_cache\n"
            "use_usable_inductor_cache()\n"
            "import transformers.masking_utils  # imports torch._dynamo, which creates the cache folder\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHINDUCTOR_CACHE_DIR=str(blocker))
    proc = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout
    assert "TORCHINDUCTOR_CACHE_DIR" in proc.stdout and "starts cold" in proc.stdout


@pytest.mark.slow  # a full run in a subprocess
def test_a_compiler_cache_path_that_is_a_file_does_not_fail_a_run(tmp_path, small_input):
    job = write_job(tmp_path, small_input)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    env = dict(os.environ, PYTHONPATH=str(REPO), TORCHINDUCTOR_CACHE_DIR=str(blocker))
    proc = subprocess.run([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout
    assert "TORCHINDUCTOR_CACHE_DIR" in proc.stdout and "starts cold" in proc.stdout  # said, not fatal
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 12


# ---------------------------------------------------------------------------- messages


def test_a_prompt_over_engine_max_length_names_engine_max_length(tmp_path, small_input):
    job = write_job(tmp_path, small_input, engine={"max_length": 64}, output={"max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    errors = [e for e in pq.read_table(tmp_path / "out.parquet").column("error").to_pylist() if e]
    assert errors and all("longer than the maximum 64 (engine.max_length)" in e for e in errors), errors[:1]


@pytest.mark.slow  # a full run with the model
def test_one_labeled_row_is_not_called_null_in_every_row(tmp_path):
    from tests.conftest import write_sample_subset

    data = write_sample_subset(tmp_path / "input.parquet", queries=3, product_ids=("P001",))
    table = pq.read_table(data)
    table = table.append_column("relevant", pa.array(["Yes"] + [None] * (table.num_rows - 1), pa.string()))
    pq.write_table(table, data)
    job = write_job(tmp_path, data, score={"calibrate": "temperature"}, calibrate={"truth_column": "relevant"})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "null in every scored row" not in result.output
    assert "1 scored row is labeled in 'relevant'" in result.output and "at least 2" in result.output


@pytest.mark.slow  # a full run with the model
def test_a_fit_on_one_class_warns_in_the_log_and_the_summary(tmp_path):
    from tests.conftest import write_sample_subset

    data = write_sample_subset(tmp_path / "input.parquet", queries=4, product_ids=("P001",))
    table = pq.read_table(data)
    table = table.append_column("relevant", pa.array(["No"] * table.num_rows, pa.string()))
    pq.write_table(table, data)
    metrics = tmp_path / "m.json"
    job = write_job(tmp_path, data, score={"calibrate": "temperature"}, calibrate={"truth_column": "relevant"})
    result = CliRunner().invoke(main, ["run", str(job), "-q", "--metrics", str(metrics)])
    assert result.exit_code == 0, result.output
    assert "every fit row has the same true label" in json.loads(metrics.read_text())["calibration"]["source"]


# ---------------------------------------------------------------------------- the report of decision outputs


QUESTION = {"refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
            "team": {"type": "choice", "instructions": "Which team?", "criteria": {"billing": None, "shipping": None}}}


@pytest.fixture(scope="module")
def decision_batch(tmp_path_factory):
    """A batch of one chat line and 4 answered System One lines (one with a question of its own)."""
    folder = tmp_path_factory.mktemp("decision_report")
    chat = {"custom_id": "chat-0", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "Is the sky blue? Yes or No."}]}}
    decisions = [{"custom_id": f"so-{i}", "method": "POST", "url": "/v1/systemone",
                  "body": {"model": "m", "state": f"Ticket {i}: my parcel is late, refund me",
                           "questions": QUESTION if i else {"urgent": {"type": "noul"}}}} for i in range(4)]
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in [chat, *decisions]))
    job = folder / "job.yaml"
    job.write_text(json.dumps({"input": {"path": str(source), "format": "openai_batch"}, "labels": ["Yes", "No"],
                               "model": "smollm2-135m-instruct", "engine": {"kind": "torch", "dtype": "float32"},
                               "output": {"path": str(folder / "out.jsonl"), "audit_rows": 0}}))
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    return folder / "out.jsonl"


def test_decision_lines_beside_a_chat_line_are_not_reported_as_errors(decision_batch, tmp_path):
    from batchscore.report import load_output, read_output_table

    output = load_output(decision_batch, table=read_output_table(decision_batch))
    assert output.rows == 1 and output.ok.all()  # the chat line; the 4 answered lines are not errors
    assert output.notes and "4 decision line(s)" in output.notes[0]
    html = tmp_path / "r.html"
    assert invoke("report", decision_batch, "--html", html).exit_code == 0
    assert "4 decision line(s)" in html.read_text()


def test_a_batch_of_decision_lines_alone_is_reported_per_question(decision_batch, tmp_path):
    from batchscore.report.data import read_output_table
    from batchscore.tasks.questions.report import read_questions

    alone = tmp_path / "decisions.jsonl"
    alone.write_text("".join(line + "\n" for line in decision_batch.read_text().splitlines()
                             if json.loads(line)["custom_id"] != "chat-0"))
    questions = {q.key: q for q in read_questions(read_output_table(alone))}
    assert set(questions) == {"urgent", "refund", "team"}
    assert (questions["refund"].records, questions["refund"].answered) == (3, 3)  # asked of 3 lines, not 4
    assert (questions["urgent"].records, questions["urgent"].answered) == (1, 1)
    assert sum(questions["team"].answers.values()) == 3 and set(questions["team"].answers) <= {"billing", "shipping"}
    result = invoke("report", alone, "--html", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    assert "refund" in (tmp_path / "r.html").read_text()


def test_per_row_questions_and_a_question_missing_a_column_are_reported(decision_batch, tmp_path):
    from batchscore.report.data import read_output_table
    from batchscore.tasks.questions.report import read_questions

    # a per-row-questions table output: each row's answers as JSON in `answers`, no fixed question columns
    lines = [json.loads(x) for x in decision_batch.read_text().splitlines()]
    rows = [{"ticket_id": x["custom_id"], "answers": json.dumps(x["response"]["body"]["answers"]), "status": "ok",
             "error": None} for x in lines if "answers" in x["response"]["body"]]
    rows.append({"ticket_id": "broken", "answers": None, "status": "error", "error": "field 'subject' is null"})
    table_path = tmp_path / "per_row.parquet"
    pq.write_table(pa.Table.from_pylist(rows), table_path)
    questions = {q.key: q for q in read_questions(read_output_table(table_path))}
    assert questions["refund"].answered == 3 and questions["refund"].whole == 1 and questions["refund"].errors == {}
    assert invoke("report", table_path, "--html", tmp_path / "r.html").exit_code == 0

    # a questions table with one question's label_mass column dropped: reported, naming what is missing
    table = read_output_table(table_path)
    cut = table.drop_columns(["team.label_mass"])
    cut_path = tmp_path / "cut.parquet"
    pq.write_table(cut, cut_path)
    questions = {q.key: q for q in read_questions(read_output_table(cut_path))}
    assert questions["team"].missing == ["team.label_mass"] and questions["team"].answered == 3
    assert invoke("report", cut_path, "--html", tmp_path / "cut.html").exit_code == 0
    assert "team.label_mass" in (tmp_path / "cut.html").read_text()


@pytest.mark.parametrize("calibration, named", [
    ([1.0], "recorded no per-question values"),
    ({"method": "temperature", "questions": {"refund": ["not", "a", "mapping"]}}, "no fitted values for question"),
    ({"method": "temperature", "questions": {"refund": {"options": None, "params": {"temperature": 0}}}},
     "temperature is 0; expected a finite number above 0"),
])
def test_a_hand_edited_question_calibration_is_refused(tmp_path, calibration, named):
    import yaml

    from batchscore.errors import CalibrationError
    from batchscore.jobfile import load_job
    from batchscore.tasks.questions.quality import check_calibration_source
    from batchscore.output.layout import OutputFiles
    from batchscore.output.parts import write_completion_marker
    from batchscore.tasks.questions.requests import parse_systemone

    questions = {"refund": {"type": "noul", "instructions": "Does the customer ask for money back?"}}
    options = list(parse_systemone({"state": "", "questions": questions}).questions[0].options)
    if isinstance(calibration, dict) and isinstance(calibration["questions"]["refund"], dict):
        calibration["questions"]["refund"]["options"] = options
    previous = tmp_path / "previous.parquet"
    pq.write_table(pa.table({"ticket_id": ["t1"]}), previous)
    write_completion_marker(OutputFiles(str(previous)), "hash", {"calibration": calibration})
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"input": {"path": str(tmp_path / "in.jsonl"), "id_column": "ticket_id"},
                                   "prompt": {"state_columns": ["body"]}, "questions": questions,
                                   "score": {"calibrate": "temperature"}, "calibrate": {"from": str(previous)},
                                   "output": {"path": str(tmp_path / "out.parquet")}}))
    with pytest.raises(CalibrationError, match=named):  # exit 2, before any scoring
        check_calibration_source(load_job(job))
