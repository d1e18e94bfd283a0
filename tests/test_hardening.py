"""No request vanishes, no option overwrites the run's own files, one bad row never stops a job,
and no traceback reaches a user: one test per defect an attack found, on the real CLI and model."""

import json
import tracemalloc

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_CONFIG, EXIT_INPUT, EXIT_OUTPUT, RowRenderError
from batchscore.prepare.prompts import compile_template

ENGINE = {"kind": "torch", "device": "cpu", "dtype": "float32", "token_budget": 256}


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.output
    return result


def write_job(folder, **job):
    import yaml

    job = {"model": "smollm2-135m-instruct", "engine": ENGINE, "labels": ["Yes", "No"], **job}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, allow_unicode=True))
    return path


def token_rows(folder, n=3, name="in.jsonl"):
    path = folder / name
    path.write_text("".join(json.dumps({"id": f"r{i}", "t": [1, 2 + i, 3]}) + "\n" for i in range(n)))
    return path


def token_job(folder):
    """(the input of `token_rows`, the output path, the job file scoring it)."""
    data = token_rows(folder)
    out = folder / "out.parquet"
    job = write_job(folder, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(out)})
    return data, out, job


def openai_requests(folder, contents=("Is the sky blue?", "Is grass red?")):
    path = folder / "requests.jsonl"
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": c}]}})
             for i, c in enumerate(contents)]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------------------- files that vanished

def test_error_path_equal_to_the_output_is_refused_before_any_work(tmp_path):
    requests = openai_requests(tmp_path)
    out = tmp_path / "out.jsonl"
    job = write_job(tmp_path, input={"path": str(requests), "format": "openai_batch"},
                    output={"path": str(out), "error_path": str(out), "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "output.error_path" in result.output and str(out) in result.output and "is the output" in result.output
    assert not out.exists()


def test_error_path_inside_the_parts_folder_is_refused(tmp_path):
    requests = openai_requests(tmp_path)
    out = tmp_path / "out.jsonl"
    inside = tmp_path / "_out.jsonl.parts" / "errors.jsonl"
    job = write_job(tmp_path, input={"path": str(requests), "format": "openai_batch"},
                    output={"path": str(out), "error_path": str(inside), "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "parts folder" in result.output and str(inside) in result.output
    assert not out.exists()


def test_error_path_beside_the_output_under_its_own_name_is_kept(tmp_path):
    """A request that fails lands in the error file, and every custom_id is in one of the files."""
    requests = openai_requests(tmp_path, ("Is the sky blue?", "\ud83d broken", "Is grass red?"))
    out, errors = tmp_path / "out.jsonl", tmp_path / "failed.jsonl"
    job = write_job(tmp_path, input={"path": str(requests), "format": "openai_batch"},
                    output={"path": str(out), "error_path": str(errors), "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    ok = [json.loads(line)["custom_id"] for line in out.read_text().splitlines()]
    failed = [json.loads(line) for line in errors.read_text().splitlines()]
    assert sorted(ok + [f["custom_id"] for f in failed]) == ["req-0", "req-1", "req-2"]
    assert [f["custom_id"] for f in failed] == ["req-1"]


def test_metrics_prom_over_the_input_is_refused_and_the_input_kept(tmp_path):
    data = token_rows(tmp_path, name="data.jsonl")
    before = data.read_bytes()
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(tmp_path / "out.parquet")})
    result = invoke("run", job, "-q", "--metrics-prom", data)
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "--metrics-prom" in result.output and str(data) in result.output and "input" in result.output
    assert data.read_bytes() == before
    assert not (tmp_path / "out.parquet").exists()  # refused before any work


def test_metrics_and_report_html_cannot_replace_the_finished_output(tmp_path):
    data, out, job = token_job(tmp_path)
    assert invoke("run", job, "-q").exit_code == 0
    scores = out.read_bytes()
    for option in ("--metrics", "--metrics-prom"):
        result = invoke("run", job, "-q", option, out)
        assert result.exit_code == EXIT_CONFIG, result.output
        assert "is the output" in result.output
    result = invoke("report", out, "--html", out)
    assert result.exit_code == EXIT_CONFIG, result.output
    for sibling in ("_out.parquet.complete.json", "_out.parquet.lock", "_out.parquet.parts/m.json"):
        result = invoke("run", job, "-q", "--metrics", tmp_path / sibling)
        assert result.exit_code == EXIT_CONFIG, (sibling, result.output)
    assert out.read_bytes() == scores
    assert pq.read_table(out).column("id").to_pylist() == ["r0", "r1", "r2"]


def test_an_output_over_the_job_file_is_refused(tmp_path):
    data = token_rows(tmp_path)
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t"},
                    output={"path": str(tmp_path / "out.parquet")})
    before = job.read_bytes()
    result = invoke("run", job, "-q", "-o", job)
    assert result.exit_code == EXIT_CONFIG, result.output
    assert "is the job file" in result.output and job.read_bytes() == before


def test_metrics_may_go_to_the_place_the_report_looks(tmp_path):
    data, out, job = token_job(tmp_path)
    metrics = tmp_path / "out.parquet.metrics.json"
    result = invoke("run", job, "-q", "--metrics", metrics)
    assert result.exit_code == 0, result.output
    assert json.loads(metrics.read_text())["exit_code"] == 0


def test_report_html_never_replaces_a_file_that_is_not_a_report(tmp_path):
    data, out, job = token_job(tmp_path)
    assert invoke("run", job, "-q").exit_code == 0
    result = invoke("report", out, "--html", data)  # the run's input: `report` does not know it, but it is not a report
    assert result.exit_code == EXIT_CONFIG and "not a batchscore report" in result.output
    assert data.read_text().startswith('{"id": "r0"')
    assert invoke("report", out, "--html", tmp_path / "r.html").exit_code == 0
    assert invoke("report", out, "--html", tmp_path / "r.html").exit_code == 0  # its own report: replaced


def test_metrics_of_an_unreadable_job_never_replace_other_files(tmp_path):
    data = token_rows(tmp_path)
    before = data.read_bytes()
    job = tmp_path / "job.yaml"
    job.write_text("labels: [Yes, No]\nplan: {order: sideways}\n")
    result = invoke("run", job, "-q", "--metrics", data, "--metrics-prom", tmp_path / "new.prom")
    assert result.exit_code == EXIT_CONFIG
    assert data.read_bytes() == before and "not written" in result.output
    assert "batchscore_exit_code" in (tmp_path / "new.prom").read_text()


# ---------------------------------------------------------------------------- one bad row

SURROGATE_LINE = '{"id": "r1", "t": [1, 5, 3], "q": "ok", "note": "\\ud83d broken"}\n'


def test_a_lone_surrogate_in_a_column_the_job_never_reads_changes_nothing(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": "r0", "t": [1, 2, 3], "note": "fine"}\n' + SURROGATE_LINE)
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(tmp_path / "out.parquet")})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok", "ok"]


def test_a_lone_surrogate_in_a_column_the_job_reads_is_that_rows_error(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": "r0", "t": [1, 2, 3], "note": "fine"}\n' + SURROGATE_LINE
                    + '{"id": "r2", "t": [1, 2, 4], "note": "fine"}\n')
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(tmp_path / "out.parquet"), "keep_columns": ["note"], "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok", "error", "ok"]
    assert "in.jsonl:2" in out[1]["error"] and "'note'" in out[1]["error"] and "surrogate" in out[1]["error"]
    assert out[1]["note"] == "\\ud83d broken"  # kept, as its escape


def test_a_lone_surrogate_in_an_openai_message_is_that_requests_error(tmp_path):
    requests = openai_requests(tmp_path, ("Is the sky blue?", "\ud83d", "Is grass red?"))
    out = tmp_path / "out.jsonl"
    job = write_job(tmp_path, input={"path": str(requests), "format": "openai_batch"},
                    output={"path": str(out), "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    failed = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [f["custom_id"] for f in failed] == ["req-1"]
    message = failed[0]["response"]["body"]["error"]["message"]
    assert "requests.jsonl:2" in message and "body.messages" in message and "surrogate" in message
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == ["req-0", "req-2"]


def test_bytes_that_are_not_utf8_fail_only_a_row_that_reads_them(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_bytes(b'{"id": "r0", "t": [1, 2, 3], "note": "bad \xff"}\n'
                     b'{"id": "r1", "t": [1, 2, 4], "q": "bad \xfe"}\n')
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t", "id_column": "id"},
                    output={"path": str(tmp_path / "out.parquet"), "keep_columns": ["q"], "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [(r["id"], r["status"]) for r in out] == [("r0", "ok"), ("r1", "error")]  # the id is kept
    assert "in.jsonl:2: invalid UTF-8 in field 'q'" in out[1]["error"]


def test_a_parquet_string_that_is_not_utf8_is_that_rows_error(tmp_path):
    import pyarrow as pa

    text = pa.array([b"Is it?", b"bad \xff", b"Fine?"], pa.binary()).view(pa.string())  # as some writers store it
    pq.write_table(pa.table({"id": ["r0", "r1", "r2"], "q": text}), tmp_path / "in.parquet")
    job = write_job(tmp_path, input={"path": str(tmp_path / "in.parquet"), "id_column": "id"},
                    prompt={"template": "Q: {q}"},
                    output={"path": str(tmp_path / "out.parquet"), "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok", "error", "ok"]
    assert "in.parquet:2: invalid UTF-8 in field 'q'" in out[1]["error"]


def test_a_jinja_template_that_recurses_on_one_row_fails_that_row(tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "deep": d}) + "\n" for i, d in enumerate([0, 1, 0])))
    template = "{% macro f(k) %}{% if k %}{{ f(k) }}{% else %}Is it?{% endif %}{% endmacro %}{{ f(deep) }}"
    job = write_job(tmp_path, input={"path": str(data), "id_column": "id"},
                    prompt={"template": template, "engine": "jinja"},
                    output={"path": str(tmp_path / "out.parquet"), "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok", "error", "ok"]
    assert "nested more than 50 deep" in out[1]["error"] and "in.jsonl:2" in out[1]["error"]


def test_jinja_output_over_one_mib_is_a_row_error():
    template = compile_template("{{ q * n }}", "jinja")
    assert template.render({"q": "ab", "n": 3}) == "ababab"
    with pytest.raises(RowRenderError, match="limit of 1,048,576"):
        template.render({"q": "x", "n": 2_000_000})  # 2 MB: rendered whole before the limit


@pytest.mark.parametrize("source", ["{{ 'x' * n }}", "{{ 'x'.ljust(n) }}", "{{ 'x'|center(n) }}",
                                    "{{ '%*s' % (n, 'x') }}", "{{ '{:>{}}'.format('x', n) }}"])
def test_jinja_refuses_a_10_gb_string_without_allocating_it(source):
    template = compile_template(source, "jinja")
    tracemalloc.start()
    try:
        with pytest.raises(RowRenderError, match="over the limit"):
            template.render({"n": 10**10})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


# ---------------------------------------------------------------------------- no traceback

def test_a_label_with_dollar_signs_gets_its_report(tmp_path):
    data = token_rows(tmp_path)
    out = tmp_path / "out.parquet"
    job = write_job(tmp_path, labels=["$x^$", "No"],
                    input={"path": str(data), "token_ids_column": "t", "id_column": "id"}, output={"path": str(out)})
    result = invoke("run", job, "-q", "--report")
    assert result.exit_code == 0, result.output
    html = (tmp_path / "_out.parquet.report.html").read_text()
    assert "$x^$" in html
    again = invoke("report", out)  # and every rerun
    assert again.exit_code == 0, again.output


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when this returns: nothing listens there


def _unreachable_store() -> dict:
    return {"endpoint_url": f"http://127.0.0.1:{_closed_port()}", "key": "k", "secret": "s",
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}


def test_an_unreachable_input_store_is_exit_3_in_one_line(tmp_path):
    pytest.importorskip("s3fs")
    job = write_job(tmp_path, input={"path": "s3://bucket/in.jsonl", "token_ids_column": "t",
                                     "storage_options": _unreachable_store()},
                    output={"path": str(tmp_path / "out.parquet")})
    metrics = tmp_path / "m.json"
    result = invoke("run", job, "-q", "--metrics", metrics)
    assert result.exit_code == EXIT_INPUT, result.output
    assert "Traceback" not in result.output and "s3://bucket/in.jsonl" in result.output
    assert result.output.count("\n") == 1
    recorded = json.loads(metrics.read_text())
    assert recorded["exit_code"] == EXIT_INPUT and "EndpointConnectionError" in recorded["error"]
    verbose = invoke("-v", "run", job, "-q")  # the traceback, for whoever asks
    assert verbose.exit_code == EXIT_INPUT and "Traceback" in verbose.output


def test_an_unreachable_output_store_is_exit_6(tmp_path):
    pytest.importorskip("s3fs")
    data = token_rows(tmp_path)
    job = write_job(tmp_path, input={"path": str(data), "token_ids_column": "t"},
                    output={"path": "s3://bucket/out.parquet", "storage_options": _unreachable_store()})
    metrics = tmp_path / "m.json"
    result = invoke("run", job, "-q", "--metrics", metrics)
    assert result.exit_code == EXIT_OUTPUT, result.output
    assert "Traceback" not in result.output and "object store" in result.output
    assert json.loads(metrics.read_text())["exit_code"] == EXIT_OUTPUT


def test_every_escaping_error_maps_to_a_documented_code():
    import yaml

    from batchscore.cli import exit_status

    assert exit_status(yaml.YAMLError("bad"))[0] == EXIT_CONFIG
    assert exit_status(OSError(28, "No space left on device"), "run")[0] == EXIT_OUTPUT
    assert exit_status(OSError(5, "I/O error"), "report")[0] == EXIT_INPUT
    code, message = exit_status(RuntimeError("boom\nsecond line"), "run")
    assert code == 1 and "\n" not in message and "-v" in message


def test_a_repeated_per_row_option_is_that_rows_error(tmp_path):
    """Two copies of one option would split its probability between them: the row is refused,
    naming its line and both copies; the other rows are scored."""
    from batchscore.jobfile import load_job
    from batchscore.run.open import open_job, prepare_job

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "q": "Capital of France?", "c": c}) + "\n" for i, c in
                            enumerate([[" Paris", " Lyon"], [" Paris", " Lyon", " Paris"], [" Lyon", " Nice"]])))
    job = write_job(tmp_path, labels=[], input={"path": str(data), "id_column": "id", "choices_column": "c"},
                    prompt={"template": "Q: {q}\nA:"}, output={"path": str(tmp_path / "out.parquet")})
    config = load_job(job)
    prepared = prepare_job(config, source=open_job(config, for_output=False)).input
    assert sorted(r.row_id for r in prepared.requests) == [0, 2]
    assert list(prepared.errors) == [1]
    assert "in.jsonl:2" in prepared.errors[1] and "field 'c' option 2 ' Paris' repeats option 0" in prepared.errors[1]


def test_a_per_row_choice_with_one_option_is_that_rows_error(tmp_path):
    """One option alone would get P = 1 whatever the model says (a labels job needs two labels):
    the row is refused naming its line and field; the other rows are scored."""
    from batchscore.jobfile import load_job
    from batchscore.run.open import open_job, prepare_job

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"r{i}", "q": "Capital of France?", "c": c}) + "\n" for i, c in
                            enumerate([[" Paris", " Lyon"], [" Paris"], [" Lyon", " Nice"]])))
    job = write_job(tmp_path, labels=[], input={"path": str(data), "id_column": "id", "choices_column": "c"},
                    prompt={"template": "Q: {q}\nA:"}, output={"path": str(tmp_path / "out.parquet")})
    config = load_job(job)
    prepared = prepare_job(config, source=open_job(config, for_output=False)).input
    assert sorted(r.row_id for r in prepared.requests) == [0, 2] and list(prepared.errors) == [1]
    assert "in.jsonl:2: field 'c' holds one option (' Paris')" in prepared.errors[1]


def test_a_dictionary_encoded_id_column_is_checked_like_a_plain_one():
    """Parquet writers dictionary-encode string columns; the duplicate-id check reads them as strings."""
    import pyarrow as pa

    from batchscore.errors import InputError
    from batchscore.prepare.rows import check_unique_ids

    check_unique_ids(pa.array(["a", "b", None]).dictionary_encode(), "q")
    with pytest.raises(InputError, match=r"input.id_column 'q' has duplicate values, e.g. \['a'\]"):
        check_unique_ids(pa.array(["a", "b", "a"]).dictionary_encode(), "q")
