"""`output.mode: incremental`: the second night scores only the rows whose content changed or is
new; every carried row keeps the first night's bits; the output holds every row of tonight's input
(on the token-store path of a fixed-labels job and on the in-memory path of a choices job)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore import run_job
from batchscore.errors import JobConfigError
from batchscore.jobfile import config_from_dict, load_job
from batchscore.output.layout import OutputFiles
from tests.conftest import write_job


def _nights(tmp_path, small_input):
    """Night 1: the 12 sample rows; night 2: rows 1 and 5 changed, one row added."""
    first = pq.read_table(small_input).to_pydict()
    second = {k: list(v) for k, v in first.items()}
    for i in (1, 5):
        second["query"][i] += " for a wedding"
    for k in second:
        second[k].append(second[k][0])
    second["pair_id"][-1], second["query"][-1] = "new-1", "garden chairs"
    return first, second


def _run(tmp_path, rows: dict, path, output: dict | None = None, **overrides):
    pq.write_table(pa.table(rows), tmp_path / "in.parquet")
    job = load_job(write_job(tmp_path, tmp_path / "in.parquet",
                             output={"path": str(path), "mode": "incremental", **(output or {})}, **overrides))
    summary = run_job(job, progress=False)
    return summary, pq.read_table(path).to_pandas().set_index("pair_id")


def test_the_second_night_scores_only_changed_and_new_rows_and_carries_the_bits(tmp_path, small_input):
    first, second = _nights(tmp_path, small_input)
    output = tmp_path / "out" / "scores.parquet"
    night1, out1 = _run(tmp_path, first, output)
    assert (night1.carry.carried, night1.carry.scored, night1.carry.dropped) == (0, 12, 0)
    assert OutputFiles(output).rows.exists()
    night2, out2 = _run(tmp_path, second, output)
    assert (night2.carry.carried, night2.carry.scored, night2.carry.dropped) == (10, 3, 2)
    assert len(out2) == 13 and (out2["status"] == "ok").all() and list(out2.index) == second["pair_id"]
    carried = [i for i in first["pair_id"] if i not in (first["pair_id"][1], first["pair_id"][5])]
    assert (out2.loc[carried, "p_Yes"].values == out1.loc[carried, "p_Yes"].values).all()  # the same bits
    metrics = night2.to_dict()
    assert (metrics["rows_carried"], metrics["rows_scored"], metrics["rows_dropped"]) == (10, 3, 2)


@pytest.mark.slow  # three runs: make test-all
def test_with_batch_invariance_an_incremental_night_is_a_full_runs_output_bit_for_bit(tmp_path, small_input):
    """engine.batch_invariant: a row's bits do not depend on what else is scored, so the second
    night's output equals a full fresh run of its input, bit for bit."""
    first, second = _nights(tmp_path, small_input)
    output = tmp_path / "out" / "scores.parquet"
    invariant = {"engine": {"kind": "torch", "dtype": "float32", "token_budget": 1024, "batch_invariant": True}}
    from batchscore.errors import JobConfigError

    try:
        _run(tmp_path, first, output, **invariant)
    except JobConfigError as exc:  # the mode refuses by name where this CPU's kernels are not row-invariant
        if "not bit-identical" not in str(exc):
            raise
        pytest.skip(f"engine.batch_invariant refused here: {exc}")
    night2, out2 = _run(tmp_path, second, output, **invariant)
    assert (night2.carry.carried, night2.carry.scored) == (10, 3)
    _, fresh = _run(tmp_path, second, tmp_path / "fresh" / "scores.parquet", output={"mode": "full"}, **invariant)
    assert out2.equals(fresh)  # row for row, bit for bit


@pytest.mark.slow  # three runs: make test-all
def test_a_choices_job_carries_on_the_in_memory_path_and_all_carried_scores_nothing(tmp_path, small_input):
    first, second = _nights(tmp_path, small_input)
    for rows in (first, second):
        rows["options"] = [[" Yes", " No", " Maybe"]] * len(rows["pair_id"])
    choices = {"labels": [], "input": {"id_column": "pair_id", "choices_column": "options"}}
    output = tmp_path / "out" / "scores.parquet"
    _, out1 = _run(tmp_path, first, output, **choices)
    night2, out2 = _run(tmp_path, second, output, **choices)
    assert (night2.carry.carried, night2.carry.scored, night2.carry.dropped) == (10, 3, 2)
    kept = [i for i in out1.index if i in out2.index and i not in (first["pair_id"][1], first["pair_id"][5])]
    assert [list(p) for p in out2.loc[kept, "p_choices"]] == [list(p) for p in out1.loc[kept, "p_choices"]]
    again, out3 = _run(tmp_path, second, tmp_path / "again" / "scores.parquet", **choices,
                       output={"previous": str(output)})
    assert (again.carry.carried, again.carry.scored, again.processed_tokens) == (13, 0, 0)
    assert [list(p) for p in out3["p_choices"]] == [list(p) for p in out2.loc[out3.index, "p_choices"]]


def test_incremental_is_refused_where_rows_are_not_carried(tmp_path):
    with pytest.raises(JobConfigError, match="output.previous: the previous night's output"):
        config_from_dict({"input": {"path": "x.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"],
                          "output": {"path": "o.parquet", "previous": "p.parquet"}})
    with pytest.raises(JobConfigError, match="output.mode incremental: for labels and choices jobs"):
        config_from_dict({"input": {"synthetic": {"workload": "micro"}}, "labels": ["Yes", "No"],
                          "output": {"path": "o.parquet", "mode": "incremental"}})


def test_a_shard_of_an_incremental_job_is_refused_by_name(tmp_path, small_input):
    from click.testing import CliRunner

    from batchscore.cli import main

    job = write_job(tmp_path, small_input, output={"path": str(tmp_path / "o.parquet"), "mode": "incremental"})
    result = CliRunner().invoke(main, ["run", str(job), "-q", "--shard", "0/2"])
    assert result.exit_code == 2 and "output.mode incremental: not with --shard" in result.output
    assert not (tmp_path / "o.parquet").exists()


@pytest.mark.slow  # three CLI runs, one killed: make test-all
def test_a_night_killed_after_its_rows_file_resumes_carrying_the_same_rows(tmp_path, small_input):
    """The night's rows file waits in the parts folder until the output's marker: a run killed
    before the marker resumes carrying from the previous night's file, the same rows (it is the
    same partial run), and the file is in place once the night is complete."""
    import os
    import subprocess
    import sys

    first, second = _nights(tmp_path, small_input)
    output = tmp_path / "out" / "scores.parquet"
    _run(tmp_path, first, output)
    before = OutputFiles(output).rows.read_bytes()
    pq.write_table(pa.table(second), tmp_path / "in.parquet")
    command = [sys.executable, "-m", "batchscore.cli", "run", str(tmp_path / "job.yaml"), "-q",
               "--metrics", str(tmp_path / "m.json")]
    killed = subprocess.run(command, env=dict(os.environ, BATCHSCORE_FAULT="rows"))
    assert killed.returncode == -9 and OutputFiles(output).rows.read_bytes() == before
    resumed = subprocess.run(command, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert (metrics["rows_carried"], metrics["rows_scored"], metrics["resumed_rows"]) == (10, 3, 3)
    assert OutputFiles(output).rows.read_bytes() != before and not OutputFiles(output).parts.exists()


def _two_thousand_rows() -> dict:
    """2,000 distinct rows of the sample data: each of its 200 product-query pairs under ten
    shopper contexts (the queries differ, the product pages are shared as in a real catalogue)."""
    from pathlib import Path

    sample = pq.read_table(Path(__file__).resolve().parent.parent / "sample_data" / "relevance.parquet").to_pydict()
    contexts = ["", " for a gift", " on a budget", " for travel", " for my office", " for a child",
                " in winter", " that lasts", " for a beginner", " for every day"]
    rows = {k: [] for k in sample}
    for n, context in enumerate(contexts):
        for i in range(len(sample["pair_id"])):
            for k in sample:
                rows[k].append(sample[k][i])
            rows["pair_id"][-1] = f"{sample['pair_id'][i]}-c{n}"
            rows["query"][-1] = sample["query"][i] + context
    return rows


@pytest.mark.slow  # 2,000 + 300 rows of the real model: make test-all
def test_a_night_of_2000_rows_with_200_changed_and_100_new_scores_300_and_carries_the_first_nights_bits(tmp_path):
    first = _two_thousand_rows()
    assert len(first["pair_id"]) == len(set(first["pair_id"])) == 2000
    second = {k: list(v) for k, v in first.items()}
    changed = list(range(7, 2000, 10))  # 200 rows spread over the input, their queries edited
    for i in changed:
        second["query"][i] += " with free returns"
    for n in range(100):  # 100 new rows, new ids and new queries
        for k in second:
            second[k].append(first[k][n * 19])
        second["pair_id"][-1], second["query"][-1] = f"new-{n}", first["query"][n * 19] + " in a new size"
    output = tmp_path / "out" / "scores.parquet"
    settings = {"engine": {"kind": "torch", "token_budget": 4096}}
    night1, out1 = _run(tmp_path, first, output, **settings)
    assert (night1.carry.scored, night1.rows) == (2000, 2000)
    night2, out2 = _run(tmp_path, second, output, **settings)
    assert (night2.carry.scored, night2.carry.carried, night2.carry.dropped) == (300, 1800, 200)
    assert len(out2) == 2100 and (out2["status"] == "ok").all() and list(out2.index) == second["pair_id"]
    carried = [first["pair_id"][i] for i in range(2000) if i not in set(changed)]
    for column in ("p_Yes", "p_No"):  # every carried row: the first night's bits
        assert (out2.loc[carried, column].values == out1.loc[carried, column].values).all()
    rescored = [first["pair_id"][i] for i in changed]
    assert (out2.loc[rescored, "p_Yes"].values != out1.loc[rescored, "p_Yes"].values).mean() > 0.9  # really scored again
