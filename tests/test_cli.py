"""The CLI on real jobs: exit codes, the output Parquet, help texts, and bad input without tracebacks."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import EXIT_CONFIG, EXIT_ERROR_RATE, EXIT_INPUT


def invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


def test_help_of_every_command_shows_an_example():
    assert "Example:" in invoke("--help").output
    for name in main.commands:
        result = invoke(name, "--help")
        assert result.exit_code == 0
        assert "Example:" in result.output, name


def test_run_writes_one_row_per_input_row(job_factory, small_input, tmp_path):
    job = job_factory(small_input)
    metrics = tmp_path / "metrics.json"
    result = invoke("run", job, "--quiet", "--metrics", metrics)
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pandas()
    source = pq.read_table(small_input).to_pandas()
    assert list(out["pair_id"]) == list(source["pair_id"])
    assert list(out.columns) == ["pair_id", "product_id", "p_Yes", "p_No", "label", "label_mass",
                                 "status", "error"]
    assert (out["status"] == "ok").all()
    assert ((out["p_Yes"] + out["p_No"] - 1).abs() < 1e-9).all()
    assert ((out["label_mass"] > 0) & (out["label_mass"] <= 1)).all()
    assert set(out["label"]) <= {"Yes", "No"}
    summary = json.loads(metrics.read_text())
    assert summary["rows"] == len(source) and summary["rows_error"] == 0
    assert summary["processed_tokens"] < summary["logical_tokens"]


@pytest.mark.slow  # a full run for one option
def test_output_option_overrides_the_job(job_factory, small_input, tmp_path):
    target = tmp_path / "elsewhere" / "scores.parquet"
    result = invoke("run", job_factory(small_input), "-q", "--output", target,
                    "--set", "engine.token_budget=256")
    assert result.exit_code == 0, result.output
    assert pq.read_table(target).num_rows == 12


def test_plan_json_has_the_documented_keys(job_factory, small_input):
    result = invoke("plan", job_factory(small_input), "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    for key in ["num_requests", "num_groups", "logical_tokens", "processed_tokens", "saving_ratio",
                "multilevel_saving_ratio", "plan_seconds"]:
        assert key in stats
    assert stats["num_requests"] == 12
    assert 0 < stats["saving_ratio"] <= stats["multilevel_saving_ratio"] < 1


def test_missing_input_file(job_factory, tmp_path):
    result = invoke("run", job_factory(tmp_path / "nope.parquet"), "-q")
    assert result.exit_code == EXIT_INPUT
    assert "file not found" in result.output and "nope.parquet" in result.output


def test_template_field_that_is_not_a_column(job_factory, small_input):
    job = job_factory(small_input, prompt={"template": "Q: {qeury}"})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_INPUT
    assert "qeury" in result.output and "input.parquet" in result.output


def test_empty_input(job_factory, tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"pair_id": pa.array([], pa.string()), "query": pa.array([], pa.string())}), empty)
    result = invoke("run", job_factory(empty, output={"keep_columns": []}, prompt={"template": "{query}"}), "-q")
    assert result.exit_code == EXIT_INPUT
    assert "holds no rows" in result.output


def test_null_fields_are_row_errors_and_the_job_goes_on(job_factory, tmp_path):
    path = tmp_path / "in.jsonl"
    rows = [{"pair_id": f"r{i}", "query": q} for i, q in enumerate(["red boots", None, "tent", "coffee"])]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    job = job_factory(path, prompt={"template": "Query: {query}\nIs this about shoes? Answer Yes or No."},
                      output={"keep_columns": [], "max_error_rate": 0.5})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["status"] for r in out] == ["ok", "error", "ok", "ok"]
    assert "'query' is null" in out[1]["error"] and "in.jsonl:2" in out[1]["error"]
    assert out[1]["p_Yes"] is None and out[0]["p_Yes"] is not None


def test_error_rate_over_the_limit_fails_after_writing(job_factory, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"pair_id": "a", "query": null}\n{"pair_id": "b", "query": "boots"}\n')
    job = job_factory(path, prompt={"template": "{query}"}, output={"keep_columns": []})
    result = invoke("run", job, "-q")
    assert result.exit_code == EXIT_ERROR_RATE
    assert "max_error_rate" in result.output
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 2


def test_prompt_longer_than_the_context_is_a_row_error(job_factory, tmp_path):
    path = tmp_path / "in.jsonl"
    long_text = "word " * 9000  # > 8192 tokens, the model's context
    path.write_text(json.dumps({"pair_id": "long", "query": long_text}) + "\n"
                    + json.dumps({"pair_id": "short", "query": "boots"}) + "\n")
    job = job_factory(path, prompt={"template": "{query}"}, output={"keep_columns": [], "max_error_rate": 0.5})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert out[0]["status"] == "error" and "longer than the maximum 8192" in out[0]["error"]
    assert out[1]["status"] == "ok"


@pytest.mark.slow  # make test keeps the options tests of test_options_torch
def test_multi_token_labels_are_scored(job_factory, small_input, tmp_path):
    """Labels of any length: 'Definitely relevant' is three tokens after the chat prompt (it used to
    be refused); the output keeps the label columns."""
    result = invoke("run", job_factory(small_input, labels=["Definitely relevant", "No"]), "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pandas()
    assert list(out.columns) == ["pair_id", "product_id", "p_Definitely relevant", "p_No", "label", "label_mass",
                                 "status", "error"]
    assert (out["status"] == "ok").all() and ((out["p_Definitely relevant"] + out["p_No"] - 1).abs() < 1e-9).all()


def test_unknown_model_lists_what_is_available(job_factory, small_input):
    result = invoke("run", job_factory(small_input, model="gpt-17"), "-q")
    assert result.exit_code == EXIT_CONFIG
    assert "smollm2-135m-instruct" in result.output


def test_models_command_lists_builtins():
    result = invoke("models")
    assert result.exit_code == 0 and "smollm2-135m-instruct" in result.output


def test_rows_over_the_memory_budget_are_row_errors_naming_the_memory(job_factory, small_input, tmp_path):
    job = job_factory(small_input, engine={"memory_budget": 2**20, "hybrid_chunk": 64},
                      output={"keep_columns": [], "max_error_rate": 1.0})
    result = invoke("run", job, "-q")
    assert result.exit_code == 0, result.output
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert len(out) == 12 and all(r["status"] == "error" for r in out)
    assert "engine.memory_budget" in out[0]["error"] and "MiB" in out[0]["error"]
    # named as the reader names a row: the input file and its row number, not an internal row id
    assert [r["error"].split(": ")[0] for r in out] == [f"{small_input}:{n}" for n in range(1, 13)]


@pytest.mark.slow  # two full runs
def test_shuffling_the_input_rows_leaves_every_rows_scores_unchanged(job_factory, small_input, tmp_path):
    """Order invariance: the plan regroups rows, so a row's scores must not depend on its neighbours."""
    first = tmp_path / "in_order.parquet"
    assert invoke("run", job_factory(small_input), "-q", "-o", first).exit_code == 0
    shuffled_input = tmp_path / "shuffled.parquet"
    table = pq.read_table(small_input)
    pq.write_table(table.take([7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 6, 4]), shuffled_input)
    second = tmp_path / "shuffled_out.parquet"
    assert invoke("run", job_factory(shuffled_input), "-q", "-o", second).exit_code == 0
    a = pq.read_table(first).to_pandas().set_index("pair_id")
    b = pq.read_table(second).to_pandas().set_index("pair_id").loc[a.index]
    assert list(pq.read_table(second).column("pair_id").to_pylist()) == table.take(
        [7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 6, 4]).column("pair_id").to_pylist()  # output keeps input order
    assert (a[["p_Yes", "p_No", "label_mass"]] - b[["p_Yes", "p_No", "label_mass"]]).abs().max().max() <= 1e-4
    assert (a["label"] == b["label"]).all()
