"""Post-processing never re-scores (run/rederive.py): changing only the calibration or the review
of a finished output re-derives it from its raw columns without a single forward, and a job
stopped at assembly by bad truth data resumes from its kept parts once the job is fixed."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchscore import run_job
from batchscore.errors import CalibrationError
from batchscore.jobfile import config_from_dict, load_job
from batchscore.run.open import assembly_config, scoring_config
from tests.conftest import SAMPLE, write_job

RAW = ["pair_id", "product_id", "p_Yes", "p_No", "label_mass", "logp_Yes", "logp_No", "status", "error"]


def _labelled(path, products=("P001", "P002", "P003")):
    """Sample rows with `relevant` (Yes when the query's number is the product's − 1) and `bad`
    (the same, with one value that is not a label)."""
    rows = [r for r in pq.read_table(SAMPLE).to_pylist() if r["product_id"] in products]
    for i, r in enumerate(rows):
        r["relevant"] = "Yes" if int(r["product_id"][1:]) - 1 == int(r["pair_id"][-2:]) else "No"
        r["bad"] = "Maybe" if i == 3 else r["relevant"]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _job(folder, data, **sections):
    output = {"path": str(folder / "out.parquet"), "keep_columns": ["product_id"], "audit_rows": 0,
              "logprobs": True, **sections.pop("output", {})}
    return load_job(write_job(folder, data, output=output, **sections))


def test_changing_review_or_calibration_rederives_without_a_forward(tmp_path, forwards):
    data = _labelled(tmp_path / "in.parquet")
    first = run_job(_job(tmp_path, data, output={"audit_rows": 2}), progress=False)
    assert forwards[0] > 0 and not first.rederived and first.audit.rows == 2
    before = pq.read_table(tmp_path / "out.parquet")

    forwards[0] = 0
    job = _job(tmp_path, data, score={"calibrate": "temperature"}, calibrate={"truth_column": "relevant"},
               output={"audit_rows": 2, "review": {"max_error": 0.3, "confidence": 0.8}})
    second = run_job(job, progress=False)
    assert forwards[0] == 0  # no engine, no audit, no model loaded
    assert second.rederived and not second.skipped and second.rows == 30
    assert first.processed_tokens > 0 and first.execution.batch_token_counts  # what the first run computed
    # this run's own figures: nothing tokenized, nothing computed (not the scoring run's)
    assert (second.processed_tokens, second.logical_tokens, second.execution.batch_token_counts) == (0, 0, [])
    after = pq.read_table(tmp_path / "out.parquet")
    assert after.select(RAW).equals(before.select(RAW))  # the raw columns, bit for bit
    assert {"p_cal_Yes", "p_cal_No", "confidence", "needs_review", "relevant"} <= set(after.column_names)
    assert second.quality.calibration["method"] == "temperature" and second.quality.review["max_error"] == 0.3
    assert (second.audit.rows, second.audit.max_dp) == (first.audit.rows, first.audit.max_dp)  # the same scores
    label = after.column("label").to_pylist()
    cal = zip(after.column("p_cal_Yes").to_pylist(), after.column("p_cal_No").to_pylist())
    assert label == ["Yes" if y >= n else "No" for y, n in cal]  # label follows the calibrated probabilities

    # back to no calibration: the label is the raw one again, and the rerun after that is a no-op
    again = run_job(_job(tmp_path, data, output={"audit_rows": 2}), progress=False)
    assert forwards[0] == 0 and again.rederived
    assert pq.read_table(tmp_path / "out.parquet").equals(before)
    assert run_job(_job(tmp_path, data, output={"audit_rows": 2}), progress=False).skipped


@pytest.mark.slow  # a second real run; make test keeps the re-derivation of a finished output
def test_a_truth_problem_is_fixed_and_rerun_from_the_kept_parts(tmp_path, forwards):
    data = _labelled(tmp_path / "in.parquet")
    with pytest.raises(CalibrationError) as caught:
        run_job(_job(tmp_path, data, calibrate={"truth_column": "bad"}, output={"review": {"max_error": 0.3}}),
                progress=False)
    assert caught.value.exit_code == 2 and "'Maybe'" in str(caught.value)
    assert (tmp_path / "_out.parquet.parts").is_dir() and not (tmp_path / "out.parquet").exists()

    forwards[0] = 0  # the fix: another truth column; no --fresh, no row scored again
    summary = run_job(_job(tmp_path, data, calibrate={"truth_column": "relevant"},
                           output={"review": {"max_error": 0.3}}), progress=False)
    assert forwards[0] == 0 and summary.resumed_rows == 30 and summary.quality.review is not None
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 30


def test_the_scoring_identity_leaves_out_the_post_processing():
    def config(**sections):
        raw = {"input": {"path": "x.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"],
               "output": {"path": "out.parquet", **sections.pop("output", {})}, **sections}
        return config_from_dict(raw)

    plain = config()
    for changed in (config(score={"calibrate": "batch"}), config(score={"confidence": "margin"}),
                    config(calibrate={"truth_column": "gold"}, output={"review": {}}),
                    config(output={"out_of_scope": {"min_label_mass": 0.2}}),
                    config(score={"calibrate": "temperature"}, calibrate={"truth_column": "gold", "seed": 3})):
        assert scoring_config(changed) == scoring_config(plain)
        assert assembly_config(changed) != assembly_config(plain) == {}
    # what changes a raw score stays: contextual calibration scores a content-free input
    assert scoring_config(config(score={"calibrate": "contextual"})) != scoring_config(plain)
    assert scoring_config(config(score={"normalize": "token"})) != scoring_config(plain)


def test_review_without_a_threshold_says_why_with_the_numbers(tmp_path, caplog):
    """30 labelled rows, half of them fit a temperature: 15 evaluation rows, where a 5% budget at
    95% needs at least 59 accepted rows — in the log, the run summary and the report."""
    import numpy as np

    from batchscore.scores.quality import add_quality_columns
    from batchscore.output.table import scores_table
    from batchscore.report import write_report

    rng = np.random.default_rng(0)
    p_yes = rng.uniform(0.05, 0.95, 40)
    truth = ["Yes" if rng.random() < p else "No" for p in p_yes]
    columns = {"p_Yes": pa.array(p_yes), "p_No": pa.array(1 - p_yes),
               "label": pa.array(np.where(p_yes >= 0.5, "Yes", "No")), "label_mass": pa.array(np.full(40, 0.8))}
    config = config_from_dict({"input": {"path": "in.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"],
                               "score": {"calibrate": "temperature"}, "calibrate": {"truth_column": "gold"},
                               "output": {"path": str(tmp_path / "out.parquet"), "review": {"max_error": 0.05}}})
    kept = pa.table({"gold": truth[:30] + [None] * 10})  # 30 labelled rows
    ok, ids = np.ones(40, dtype=bool), pa.array([f"r{i}" for i in range(40)])
    with caplog.at_level("WARNING", logger="batchscore"):
        out, result = add_quality_columns(config, columns, ok, kept, ids)
    review = result.review
    assert result.calibration["eval_rows"] == 15 and review["threshold"] is None and review["min_rows"] == 59
    assert "15 evaluation rows" in review["reason"] and "at least 59 accepted rows" in review["reason"]
    assert review["reason"] in caplog.text and "every row needs review" in caplog.text
    assert out["needs_review"].to_pylist() == [True] * 40

    pq.write_table(scores_table(ids, "id", kept, out, {}), tmp_path / "out.parquet")
    html = write_report(tmp_path / "out.parquet", metrics={"review": review, "calibration": result.calibration,
                                                           "rows": 40, "rows_ok": 40, "rows_error": 0},
                        truth="gold").read_text()
    assert "15 evaluation rows" in html and "at least 59 accepted rows" in html
    # the report shows the probabilities the answers follow — calibrated, unless the calibration made
    # its evaluation rows worse in log-loss (then raw, and it says so) — and which rows fit
    applied = result.calibration["applied"]
    assert ("P_cal(Yes)" in html) == applied and ("worse in log-loss" in html) != applied
    assert "The 15 fit rows are a seeded draw of the 30 labeled rows" in html


def test_batch_calibration_warns_when_it_moves_many_answers_or_the_prior_is_skewed(caplog):
    """A batch where 'No' is truly common: the raw model says No for 80% of the rows, and batch
    calibration, which makes the mean answer uniform, turns many of them into Yes."""
    import numpy as np

    from batchscore.scores.quality import add_quality_columns

    rng = np.random.default_rng(1)
    p_yes = np.clip(rng.normal(0.3, 0.15, 100), 0.01, 0.99)
    columns = {"p_Yes": pa.array(p_yes), "p_No": pa.array(1 - p_yes),
               "label": pa.array(np.where(p_yes >= 0.5, "Yes", "No")), "label_mass": pa.array(np.full(100, 0.8))}
    config = config_from_dict({"input": {"path": "in.parquet"}, "prompt": {"template": "{q}"}, "labels": ["Yes", "No"],
                               "score": {"calibrate": "batch"}, "output": {"path": "out.parquet"}})
    with caplog.at_level("WARNING", logger="batchscore"):
        _, result = add_quality_columns(config, columns, np.ones(100, dtype=bool), pa.table({}),
                                        pa.array(np.arange(100)))
    warnings = result.calibration["warnings"]
    moved = result.calibration["label_counts"]["calibrated"]["Yes"] - result.calibration["label_counts"]["raw"]["Yes"]
    assert moved > 20 and f"changed the answer of {moved} of 100 rows" in warnings[0]
    assert all(w in caplog.text for w in warnings)
    # a balanced batch: nothing to warn about
    balanced = np.clip(rng.normal(0.5, 0.2, 100), 0.01, 0.99)
    columns.update({"p_Yes": pa.array(balanced), "p_No": pa.array(1 - balanced)})
    _, result = add_quality_columns(config, columns, np.ones(100, dtype=bool), pa.table({}), pa.array(np.arange(100)))
    assert result.calibration["warnings"] == []


def test_the_raw_choice_is_taken_again_from_the_raw_probabilities():
    """A calibrated output's `choice` follows p_cal_choices; re-derived, it starts again from
    p_choices (the first of equal probabilities, as scoring chooses)."""
    import numpy as np

    from batchscore.run.rederive import _with_raw_choice

    columns = {"p_choices": pa.array([[0.2, 0.5, 0.3], None, [0.5, 0.5]]), "choice": pa.array(["c", None, "y"])}
    ok = np.array([True, False, True])
    out = _with_raw_choice(columns, None, [["a", "b", "c"], None, ["x", "y"]], ok)
    assert out["choice"].to_pylist() == ["b", None, "x"] and out["choice_index"].to_pylist() == [1, None, 0]
    labels = _with_raw_choice({"p_Yes": pa.array([0.4, None]), "p_No": pa.array([0.6, None])}, ["Yes", "No"], None,
                              np.array([True, False]))
    assert labels["label"].to_pylist() == ["No", None]
