"""More guarantees a hostile verification found broken: bad ids, job files whose keys collide,
API sections, signals, paths the run will write, and messages naming where a row came from."""

import json

import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_INPUT, EXIT_OUTPUT
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


# ---------------------------------------------------------------------------- SIGTERM

def test_sigterm_is_not_swallowed_by_a_librarys_except_exception():
    """A library that probes with `try: ... except Exception:` (as imports of optional packages
    do) must not swallow the SIGTERM that ends the run."""
    import os
    import signal

    from batchscore.run.run_files import exit_status, interrupt_on_sigterm

    with pytest.raises(KeyboardInterrupt) as caught:
        with interrupt_on_sigterm():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs between bytecodes
                    pass
            except Exception:  # noqa: BLE001 - what a library does
                pass
    assert exit_status(caught.value, "run") == (130, "interrupted by SIGTERM; the rows scored so far are saved — "
                                                     "rerun the same command to resume")


def _sigterm_installed(pid: int) -> bool:
    """Whether process `pid` catches SIGTERM (its handler is installed)."""
    import signal

    with open(f"/proc/{pid}/status") as status:
        caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGTERM - 1) & 1)


@pytest.mark.slow  # five runs of the real CLI
@pytest.mark.parametrize("moment", ["start:1:TERM", "engine:1:TERM", 0.0, 1.5, "done:1:TERM"])
def test_sigterm_at_any_moment_of_a_real_run_exits_130_with_metrics(tmp_path, moment):
    """Failpoints (the run's start, the engine loaded, the metrics written) and moments after the
    handler is installed (during the imports and model load): always exit 130, metrics saying so."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "t": [1, 2 + i, 3]}) + "\n" for i in range(4)))
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(tmp_path / "out.parquet"), "audit_rows": 0})
    metrics = tmp_path / "m.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("BATCHSCORE_FAULT", None)
    if isinstance(moment, str):
        env["BATCHSCORE_FAULT"] = moment
    proc = subprocess.Popen([sys.executable, "-m", "batchscore.cli", "run", str(job), "-q", "--metrics", str(metrics)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if not isinstance(moment, str):
        deadline = time.monotonic() + 60
        while not _sigterm_installed(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(moment)
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, out
    recorded = json.loads(metrics.read_text())
    assert (recorded["status"], recorded["exit_code"]) == ("failed", 130), recorded
    assert "SIGTERM" in recorded["error"]
    if moment == "done:1:TERM":  # the output was finished: the metrics keep its summary
        assert recorded["rows_ok"] == 4


# ---------------------------------------------------------------------------- paths the run writes

@pytest.mark.parametrize("flag", ["--metrics", "--metrics-prom"])
def test_a_metrics_path_under_a_plain_file_is_refused_before_any_work(tmp_path, flag):
    from tests.test_hardening import token_job

    _, out, job = token_job(tmp_path)
    (tmp_path / "afile").write_text("not a folder")
    result = invoke("run", job, "-q", flag, tmp_path / "afile" / "m.json")
    assert result.exit_code == EXIT_OUTPUT, result.output
    assert f"{flag} {tmp_path / 'afile' / 'm.json'}: {tmp_path / 'afile'} is a file, not a folder" in result.output
    assert not out.exists() and not (tmp_path / "_out.parquet.parts").exists()  # nothing scored


def test_an_error_path_under_a_plain_file_is_refused_before_any_work(tmp_path):
    from tests.test_hardening import openai_requests

    (tmp_path / "afile").write_text("not a folder")
    out = tmp_path / "out.jsonl"
    job = write_job(tmp_path, input={"path": str(openai_requests(tmp_path)), "format": "openai_batch"},
                    output={"path": str(out), "error_path": str(tmp_path / "afile" / "errors.jsonl")})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_OUTPUT, result.output
    assert "output.error_path" in result.output and "is a file, not a folder" in result.output
    assert not out.exists() and not (tmp_path / "_out.jsonl.parts").exists()


# ---------------------------------------------------------------------------- the report

def test_a_question_missing_its_answer_column_is_named_in_the_report():
    import pyarrow as pa

    from batchscore.tasks.questions.report import read_questions

    common = {"confidence": [0.9], "label_mass": [0.8], "argmax_is_label": [True], "status": ["ok"], "error": [None]}
    columns = {f"{key}.{name}": values for key in ("refund", "kind") for name, values in common.items()}
    columns["kind.p.billing"] = [0.7]  # a choice question without its `.choice`
    by_key = {q.key: q for q in read_questions(pa.table({**columns, "status": ["ok"], "error": [None]}))}
    assert (by_key["refund"].kind, by_key["refund"].missing) == ("yes/no", ["refund.p_yes"])
    assert (by_key["kind"].kind, by_key["kind"].missing) == ("choice", ["kind.choice"])


# ---------------------------------------------------------------------------- row errors say where

def test_prompt_length_empty_and_vocabulary_errors_name_file_and_line(tmp_path):
    import pyarrow.parquet as pq

    data = tmp_path / "in.jsonl"
    rows = [[5, 6, 7], [], [3, 4, 99999999], list(range(1, 80))]
    data.write_text("".join(json.dumps({"id": f"r{i}", "t": t}) + "\n" for i, t in enumerate(rows)))
    out = tmp_path / "out.parquet"
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    engine={"kind": "torch", "device": "cpu", "dtype": "float32", "max_length": 64},
                    output={"path": str(out), "max_error_rate": 1.0, "audit_rows": 0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    errors = pq.read_table(out).column("error").to_pylist()
    assert errors[0] is None
    assert errors[1].startswith(f"{data}:2: ") and "empty prompt" in errors[1]
    assert errors[2].startswith(f"{data}:3: ") and "outside the model's vocabulary" in errors[2]
    assert errors[3].startswith(f"{data}:4: ") and "longer than the maximum 64" in errors[3]


# ---------------------------------------------------------------------------- deep states

def test_a_state_nested_900_deep_is_that_rows_error(tmp_path):
    import pyarrow.parquet as pq

    deep = json.loads("[" * 900 + "1" + "]" * 900)
    rows = [{**TICKETS[0], "subject": {"a": deep}}, {**TICKETS[1], "subject": None}]  # one column type: nested
    path = write_questions_job(tmp_path, rows, output={"max_error_rate": 1.0})
    result = CliRunner().invoke(main, ["run", str(path), "-q"])
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert out[0]["status"] == "error" and out[1]["status"] == "ok"
    assert out[0]["error"].startswith(f"{tmp_path / 'tickets.jsonl'}:1: ")
    assert "field 'subject' is nested more than 100 levels deep" in out[0]["error"]


# ---------------------------------------------------------------------------- lock files

def test_a_run_refused_before_any_work_leaves_no_lock_file(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": None, "t": [1, 2, 3]}) + "\n" for _ in range(2)))
    out = tmp_path / "out.parquet"
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(out)})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_INPUT, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "job.yaml"]


def test_a_lock_file_left_by_an_earlier_run_stays_after_a_refusal(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": None, "t": [1, 2, 3]}) + "\n")
    out = tmp_path / "out.parquet"
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(out)})
    left = tmp_path / "_out.parquet.lock"  # a crashed run's
    left.write_text("{}")
    assert invoke("run", job, "-q").exit_code == EXIT_INPUT
    assert left.exists()
