"""score.calibrate, score.confidence, output.review and output.out_of_scope: the math against hand
computations, the review threshold's guarantee on simulated draws, the job keys, and real runs
of the sample job with the built-in model."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import JobConfigError
from batchscore.jobfile import ALLOWED, config_from_dict, load_job
from batchscore.scores import calibration, review
from batchscore.output.layout import OutputFiles
from batchscore.output.parts import recorded_summary
from batchscore.run.open import assembly_config, scoring_config
from batchscore.run.runner import run_job

from .conftest import SAMPLE, write_job

# ---------------------------------------------------------------------------- calibration methods


def test_batch_calibration_divides_out_the_mean_log_probability():
    p = np.array([[0.8, 0.2], [0.6, 0.4]])
    bias = calibration.batch_bias(np.log(p))
    assert bias == pytest.approx([(math.log(0.8) + math.log(0.6)) / 2, (math.log(0.2) + math.log(0.4)) / 2])
    cal = np.exp(calibration.batch_calibrate(np.log(p), bias))
    # by hand: p0/p1 of each row divided by the geometric mean ratio sqrt((0.8·0.6)/(0.2·0.4)) = sqrt(6)
    first, second = 4 / math.sqrt(6), 1.5 / math.sqrt(6)
    assert cal[0] == pytest.approx([first / (1 + first), 1 / (1 + first)])
    assert cal[1] == pytest.approx([second / (1 + second), 1 / (1 + second)])
    assert cal.sum(axis=1) == pytest.approx([1, 1])


def test_contextual_calibration_divides_by_the_content_free_probabilities():
    p = np.array([[0.7, 0.2, 0.1]])
    p_cf = np.array([0.5, 0.25, 0.25])
    cal = np.exp(calibration.contextual_calibrate(np.log(p), np.log(p_cf)))
    ratios = np.array([0.7 / 0.5, 0.2 / 0.25, 0.1 / 0.25])  # 1.4, 0.8, 0.4
    assert cal[0] == pytest.approx(ratios / ratios.sum())
    # an input that looks like the content-free one comes out uniform
    assert np.exp(calibration.contextual_calibrate(np.log(p_cf[None, :]), np.log(p_cf)))[0] == pytest.approx([1 / 3] * 3)


def _synthetic_logits(rng, rows: int, classes: int, scale: float) -> np.ndarray:
    return rng.normal(0.0, scale, size=(rows, classes))


def _sample(rng, log_p: np.ndarray) -> np.ndarray:
    p = np.exp(log_p)
    return (rng.random(len(p))[:, None] > np.cumsum(p, axis=1)).sum(axis=1)


def test_temperature_fit_recovers_a_known_temperature():
    rng = np.random.default_rng(0)
    z = _synthetic_logits(rng, 20000, 4, 3.0)
    truth = _sample(rng, calibration.log_softmax(z / 2.5))  # the labels follow softmax(z / 2.5)
    fitted = calibration.fit_temperature(calibration.log_softmax(z), truth)
    assert fitted == pytest.approx(2.5, rel=0.05)
    # and the fit lowers the NLL of the labels
    before = calibration.measures(calibration.log_softmax(z), truth)
    after = calibration.measures(calibration.temperature_scale(calibration.log_softmax(z), fitted), truth)
    assert after["nll"] < before["nll"] and after["ece"] < before["ece"]


def test_vector_and_platt_fits_recover_known_scalings():
    rng = np.random.default_rng(1)
    z = calibration.log_softmax(_synthetic_logits(rng, 20000, 3, 2.0))
    w, b = np.array([1.5, 0.7, 1.0]), np.array([0.4, -0.3, 0.0])
    truth = _sample(rng, calibration.vector_scale(z, w, b))
    fw, fb = calibration.fit_vector(z, truth)
    assert fw == pytest.approx(w, abs=0.08)
    assert np.array(fb) - fb[2] == pytest.approx(b, abs=0.08)  # b is known up to a shared shift

    z2 = calibration.log_softmax(_synthetic_logits(rng, 20000, 2, 2.0))
    truth2 = _sample(rng, calibration.platt_scale(z2, 0.5, 0.3))
    a, b2 = calibration.fit_platt(z2, truth2)
    assert (a, b2) == pytest.approx((0.5, 0.3), abs=0.05)


def test_measures_by_hand():
    p = np.array([[0.9, 0.1], [0.9, 0.1], [0.6, 0.4], [0.3, 0.7]])
    truth = np.array([0, 1, 0, 1])
    got = calibration.measures(np.log(p), truth)
    # bins of width 1/15: 0.9, 0.9 in one (accuracy 1/2), 0.6 and 0.7 alone (both right)
    assert got["ece"] == pytest.approx(2 / 4 * 0.4 + 1 / 4 * 0.4 + 1 / 4 * 0.3)
    assert got["brier"] == pytest.approx((0.02 + 1.62 + 0.32 + 0.18) / 4)
    assert got["nll"] == pytest.approx(-(math.log(0.9) + math.log(0.1) + math.log(0.6) + math.log(0.7)) / 4)
    assert got["accuracy"] == 0.75


# ---------------------------------------------------------------------------- confidence and review


def test_confidence_definitions_by_hand():
    p = np.array([[0.5, 0.3, 0.2]])
    n, mass = np.array([3]), np.array([0.8])
    h = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    expected = {"top": 0.5, "margin": 0.2, "entropy": 1 - h / math.log(3), "typesafe": (0.5 - 1 / 3) / (2 / 3),
                "top_x_mass": 0.4}
    assert set(expected) == set(review.CONFIDENCE_METHODS)
    for method, value in expected.items():
        assert review.confidence(p, n, mass, method)[0] == pytest.approx(value), method
    # a row of one option (padding 0) is certain
    assert review.confidence(np.array([[1.0, 0.0]]), np.array([1]), np.array([0.5]), "entropy")[0] == 1.0


def test_clopper_pearson_upper_bound():
    # no error in n rows: the bound solves (1 − U)^n = 1 − confidence
    assert review.clopper_pearson_upper(0, 59, 0.95) == pytest.approx(1 - 0.05 ** (1 / 59))
    assert review.first_step(0.05, 0.95) == 59  # the fewest rows whose bound can be ≤ 5%
    # with errors: P(Binomial(n, U) ≤ e) = 1 − confidence
    u = review.clopper_pearson_upper(3, 100, 0.9)
    tail = sum(math.comb(100, i) * u ** i * (1 - u) ** (100 - i) for i in range(4))
    assert tail == pytest.approx(0.1, abs=1e-9)
    assert review.clopper_pearson_upper(5, 5, 0.95) == 1.0


def _true_risk(t: float) -> float:
    """The simulated model below: confidence ~ U(0, 1), P(wrong | c) = 0.4 (1 − c), so the
    error rate of the rows with confidence ≥ t is 0.2 (1 − t)."""
    return 0.2 * (1 - t)


def test_review_threshold_meets_its_budget_at_the_stated_confidence():
    rng = np.random.default_rng(7)
    max_error, confidence, draws = 0.05, 0.9, 400
    over, coverage = 0, []
    for _ in range(draws):
        conf = rng.random(2000)
        correct = rng.random(2000) >= 0.4 * (1 - conf)
        chosen = review.choose_threshold(conf, correct, max_error, confidence)
        if chosen.threshold is not None:
            assert chosen.upper_bound <= max_error
            over += _true_risk(chosen.threshold) > max_error  # the accepted rows' error in the population
        coverage.append(chosen.coverage)
    assert over / draws <= 1 - confidence  # the bound holds at ≥ the stated rate
    assert np.mean(coverage) > 0.05  # and it accepts rows (the best possible is 25%: risk 0.05 at t = 0.75)


def test_review_threshold_keeps_ties_together_and_can_accept_nothing():
    conf = np.array([0.9] * 100 + [0.5] * 100)
    correct = np.array([True] * 100 + [False] * 100)
    chosen = review.choose_threshold(conf, correct, 0.05, 0.95)
    assert (chosen.threshold, chosen.accepted, chosen.errors) == (0.9, 100, 0)
    nothing = review.choose_threshold(np.linspace(0, 1, 30), np.ones(30, dtype=bool), 0.05, 0.95)
    assert nothing.threshold is None and nothing.coverage == 0.0  # 30 rows cannot show ≤ 5% at 95%


# ---------------------------------------------------------------------------- job keys


def _job(**extra) -> dict:
    job = {"input": {"path": "in.parquet"}, "prompt": {"template": "Q: {q}"}, "labels": ["Yes", "No"],
           "output": {"path": "out.parquet"}}
    for key, value in extra.items():
        job[key] = {**job.get(key, {}), **value} if isinstance(value, dict) else value
    return job


@pytest.mark.parametrize("extra, named", [
    ({"score": {"calibrate": "isotonic"}}, "score.calibrate: must be one of none, batch"),
    ({"score": {"confidence": "vibes"}}, "score.confidence: must be one of top"),
    ({"score": {"calibrate": "platt"}, "labels": ["a", "b", "c"], "calibrate": {"truth_column": "t"}},
     "score.calibrate platt: binary labels only"),
    ({"score": {"calibrate": "batch"}, "labels": [], "input": {"choices_column": "options"}},
     "score.calibrate batch: applies to fixed labels, not to per-row choices"),
    ({"score": {"calibrate": "temperature"}}, "score.calibrate temperature: fitted on labeled rows"),
    ({"output": {"review": {"max_error": 0.05}}}, "output.review: needs calibrate.truth_column"),
    ({"output": {"review": {"max_error": 1.5}}, "calibrate": {"truth_column": "t"}}, "output.review.max_error"),
    ({"output": {"out_of_scope": {"min_label_mass": "sometimes"}}}, "output.out_of_scope.min_label_mass"),
    ({"output": {"out_of_scope": {"min_label_mass": 2}}}, "output.out_of_scope.min_label_mass"),
    ({"calibrate": {"holdout_fraction": 1.0, "truth_column": "t"}}, "calibrate.holdout_fraction"),
    ({"calibrate": {"truth_columns": {"team": "gold_team"}}}, "calibrate.truth_columns: for questions jobs"),
    ({"calibrate": {"from": "old.parquet"}}, "calibrate.from: score.calibrate is none"),
    ({"calibrate": {"fromm": "x"}}, "unknown key 'calibrate.fromm' (did you mean calibrate.from?)"),
    ({"calibrate": {"truth_column": "label"}}, "calibrate.truth_column: 'label' is also a column"),
])
def test_bad_values_are_refused_naming_the_key(extra, named):
    with pytest.raises(JobConfigError) as info:
        config_from_dict(_job(**extra))
    assert info.value.exit_code == 2
    assert any(named in problem for problem in info.value.problems), info.value.problems


def test_keys_parse_and_the_truth_column_is_kept():
    config = config_from_dict(_job(score={"calibrate": "temperature", "confidence": "margin"},
                                   calibrate={"truth_column": "gold", "from": "file:///tmp/prev.parquet", "seed": 3},
                                   output={"review": {"max_error": 0.1}, "out_of_scope": {"min_label_mass": "auto"}}))
    assert config.calibrate.from_ == "/tmp/prev.parquet" and config.calibrate.seed == 3
    assert config.output.review.max_error == 0.1 and config.output.review.confidence == 0.95
    assert config.output.out_of_scope.min_label_mass == "auto"
    assert "gold" in config.output.keep_columns  # copied into the output
    assert ALLOWED["score.calibrate"] == calibration.METHODS


def test_the_calibration_keys_are_assembly_not_scoring():
    plain = scoring_config(config_from_dict(_job()))
    assert plain["calibrate"] == {} and plain["score"] == {"normalize": "sum"}  # each key's rule: config.py
    asked = config_from_dict(_job(score={"calibrate": "batch"}, output={"review": {}}, calibrate={"truth_column": "gold"}))
    assert scoring_config(asked) == plain  # post-processing: re-derived from the raw scores, never re-scored
    assembly = assembly_config(asked)
    assert assembly["score"]["calibrate"] == "batch" and assembly["calibrate"]["truth_column"] == "gold"
    assert assembly["output"]["review"]["max_error"] == 0.05


def test_schema_lists_the_new_keys():
    from batchscore.schema import job_schema

    schema = job_schema()["$defs"]
    assert schema["ScoreConfig"]["properties"]["calibrate"]["enum"] == list(calibration.METHODS)
    assert schema["ScoreConfig"]["properties"]["confidence"]["enum"] == list(review.CONFIDENCE_METHODS)
    assert "from" in schema["CalibrateConfig"]["properties"] and "from_" not in schema["CalibrateConfig"]["properties"]
    assert schema["CalibrateConfig"]["properties"]["from"]["description"].startswith("a previous output")
    assert {"review", "out_of_scope"} <= set(schema["OutputConfig"]["properties"])


# ---------------------------------------------------------------------------- assembly (scores/quality.py)


def test_per_row_choices_get_temperature_scaled_and_choice_follows():
    from batchscore.scores.quality import add_quality_columns

    rng = np.random.default_rng(3)
    options = [["a", "b", "c"] if i % 2 else ["x", "y"] for i in range(400)]
    z = [rng.normal(0, 3, len(o)) for o in options]
    p = [np.exp(v - np.logaddexp.reduce(v)) for v in z]
    truth = [o[int(np.argmax(rng.random() < np.cumsum(np.exp(v / 2 - np.logaddexp.reduce(v / 2)))))]
             for o, v in zip(options, z)]  # drawn at temperature 2
    ok = np.ones(400, dtype=bool)
    ok[5] = False  # an error row: no scores, no truth read
    columns = {"choice": pa.array([o[int(np.argmax(q))] for o, q in zip(options, p)]),
               "choice_index": pa.array([int(np.argmax(q)) for q in p]),
               "p_choices": pa.array([q.tolist() if good else None for q, good in zip(p, ok)]),
               "label_mass": pa.array(np.full(400, 0.9))}
    config = config_from_dict(_job(labels=[], input={"choices_column": "opts"}, score={"calibrate": "temperature"},
                                   calibrate={"truth_column": "gold", "seed": 1}))
    kept = pa.table({"gold": [t if i != 7 else None for i, t in enumerate(truth)]})  # row 7 unlabeled
    ids = pa.array(np.arange(400))
    out, result = add_quality_columns(config, columns, ok, kept, ids, [o if g else None for o, g in zip(options, ok)])
    cal = result.calibration
    assert cal["labeled_rows"] == 398 and cal["fit_rows"] + cal["eval_rows"] == 398 and cal["fit_rows"] == 199
    t = cal["params"]["temperature"]
    assert 1.6 < t < 2.5  # near the temperature the truth was drawn at
    row = out["p_cal_choices"][1].as_py()
    expected = np.exp(np.log(p[1]) / t - np.logaddexp.reduce(np.log(p[1]) / t))
    assert row == pytest.approx(expected)
    assert out["p_cal_choices"][5].as_py() is None and out["choice"][5].as_py() is None
    assert out["choice"][1].as_py() == options[1][int(np.argmax(expected))]
    assert cal["after"]["nll"] < cal["before"]["nll"]


def test_a_calibration_that_worsens_its_evaluation_rows_keeps_the_raw_labels(caplog):
    """Every true label is Yes and the model leans Yes: Batch Calibration removes that lean and the
    evaluation rows get worse in log-loss. label, confidence and review stay on the raw
    probabilities; p_cal_<label> is still written; the warning gives both log-losses."""
    from batchscore.scores.quality import add_quality_columns

    rng = np.random.default_rng(5)
    yes = np.clip(rng.normal(0.75, 0.1, 60), 0.3, 0.99)
    columns = {"p_Yes": pa.array(yes), "p_No": pa.array(1 - yes),
               "label": pa.array(np.where(yes >= 0.5, "Yes", "No")), "label_mass": pa.array(np.full(60, 0.9))}
    config = config_from_dict(_job(score={"calibrate": "batch"}, calibrate={"truth_column": "relevant"},
                                   output={"review": {"max_error": 0.2, "confidence": 0.9}}))
    with caplog.at_level("WARNING", logger="batchscore"):
        out, result = add_quality_columns(config, columns, np.ones(60, dtype=bool), pa.table({"relevant": ["Yes"] * 60}),
                                          pa.array(range(60)))
    cal = result.calibration
    assert cal["applied"] is False and cal["after"]["nll"] > cal["before"]["nll"]
    assert out["label"].to_pylist() == columns["label"].to_pylist()  # raw kept
    raw = np.log(np.column_stack([yes, 1 - yes]))
    expected = np.exp(raw - raw.mean(axis=0)) / np.exp(raw - raw.mean(axis=0)).sum(axis=1, keepdims=True)
    assert np.column_stack([out["p_cal_Yes"], out["p_cal_No"]]) == pytest.approx(expected, abs=1e-9)
    assert out["confidence"].to_numpy() == pytest.approx(np.maximum(yes, 1 - yes))  # over the raw probabilities
    warned = [r.getMessage() for r in caplog.records if "worse in log-loss" in r.getMessage()]
    assert len(warned) == 1 and f"before {cal['before']['nll']:.4f}, after {cal['after']['nll']:.4f}" in warned[0]
    assert warned[0] in cal["warnings"]


# ---------------------------------------------------------------------------- real runs


def _with_truth(path, products: tuple[str, ...], null_truth: bool = False):
    """The sample rows of `products` with a `relevant` column: sample_data/make_sample.py writes
    query i for product i (P001 'waterproof boots' … P010 'tool to hang shelves'), so a pair is
    relevant exactly when the query's number is the product's − 1."""
    rows = [r for r in pq.read_table(SAMPLE).to_pylist() if r["product_id"] in products]
    for r in rows:
        match = int(r["product_id"][1:]) - 1 == int(r["pair_id"][-2:])
        r["relevant"] = None if null_truth else "Yes" if match else "No"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory):
    """4 products × 10 queries, Batch Calibration, a review budget and an automatic out-of-scope floor."""
    folder = tmp_path_factory.mktemp("batch")
    data = _with_truth(folder / "in.parquet", ("P001", "P002", "P003", "P004"))
    job = write_job(folder, data, score={"calibrate": "batch"}, calibrate={"truth_column": "relevant"},
                    output={"path": str(folder / "out.parquet"), "keep_columns": ["product_id"], "audit_rows": 0,
                            "review": {"max_error": 0.3, "confidence": 0.9},
                            "out_of_scope": {"min_label_mass": "auto"}})
    summary = run_job(load_job(job), progress=False)
    return folder, summary, pq.read_table(folder / "out.parquet").to_pandas()


def test_batch_run_writes_calibrated_columns_and_the_summary(batch_run):
    folder, summary, out = batch_run
    assert list(out.columns) == ["pair_id", "product_id", "relevant", "p_Yes", "p_No", "label", "label_mass",
                                 "p_cal_Yes", "p_cal_No", "confidence", "needs_review", "out_of_scope", "status", "error"]
    raw = np.log(out[["p_Yes", "p_No"]].to_numpy())
    bias = raw.mean(axis=0)  # Batch Calibration by hand, from the written raw probabilities
    expected = np.exp(raw - bias) / np.exp(raw - bias).sum(axis=1, keepdims=True)
    assert out[["p_cal_Yes", "p_cal_No"]].to_numpy() == pytest.approx(expected, abs=1e-9)
    cal = summary.quality.calibration
    # label follows p_cal, unless the calibration made the evaluation rows worse in log-loss
    assert cal["applied"] == (cal["after"]["nll"] <= cal["before"]["nll"])
    follows = expected if cal["applied"] else np.exp(raw)
    assert (out["label"] == np.where(follows[:, 0] >= follows[:, 1], "Yes", "No")).all()
    assert out["confidence"].to_numpy() == pytest.approx(follows.max(axis=1))  # score.confidence top

    assert cal["method"] == "batch" and cal["params"]["bias"] == pytest.approx(bias, abs=1e-9)
    assert cal["labeled_rows"] == cal["eval_rows"] == 40 and cal["fit_rows"] == 0  # nothing fitted: all evaluate
    assert cal["label_counts"]["calibrated"]["Yes"] == int((expected[:, 0] >= expected[:, 1]).sum())
    assert cal["before"]["rows"] == 40 and cal["after"]["ece"] is not None
    assert summary.quality.confidence_method == "top"
    stored = recorded_summary(OutputFiles(str(folder / "out.parquet")))  # the completion marker keeps it
    assert stored["calibration"]["params"] == cal["params"] and stored["review"] == summary.quality.review


def test_batch_run_review_and_out_of_scope_follow_their_definitions(batch_run):
    _, summary, out = batch_run
    rev = summary.quality.review
    threshold = rev["threshold"]
    accepted = out["confidence"] >= threshold if threshold is not None else np.zeros(len(out), dtype=bool)
    assert (out["needs_review"] == ~accepted).all()
    assert rev["accepted_rows"] == int(accepted.sum()) and rev["rows"] == 40
    if threshold is not None:  # the accepted evaluation rows meet the budget by the bound
        wrong = int(((out["label"] != out["relevant"]) & accepted).sum())
        assert wrong == rev["errors"]
        assert review.clopper_pearson_upper(wrong, int(accepted.sum()), 0.9) <= 0.3
    assert set(rev["by_confidence"]) == set(review.CONFIDENCE_METHODS)
    floor = np.percentile(out["label_mass"], 1)
    assert summary.quality.out_of_scope["min_label_mass"] == pytest.approx(floor)
    assert (out["out_of_scope"] == (out["label_mass"] < floor)).all() and summary.quality.out_of_scope["rows"] >= 1


def test_calibrate_from_reuses_the_recorded_values(batch_run, tmp_path):
    folder, first, _ = batch_run
    data = _with_truth(tmp_path / "in.parquet", ("P005",), null_truth=True)
    job = write_job(tmp_path, data, score={"calibrate": "batch"},
                    calibrate={"from": str(folder / "out.parquet")},
                    output={"path": str(tmp_path / "out.parquet"), "audit_rows": 0})
    summary = run_job(load_job(job), progress=False)
    assert summary.quality.calibration["params"] == first.quality.calibration["params"]  # no refit on these 10 rows
    assert summary.quality.calibration["source"].startswith("calibrate.from")
    out = pq.read_table(tmp_path / "out.parquet").to_pandas()
    raw = np.log(out[["p_Yes", "p_No"]].to_numpy()) - np.array(first.quality.calibration["params"]["bias"])
    assert out["p_cal_Yes"].to_numpy() == pytest.approx(np.exp(raw[:, 0]) / np.exp(raw).sum(axis=1), abs=1e-9)


@pytest.mark.slow  # with the exactness audit's float32 reference
def test_contextual_run_scores_the_content_free_input_beside_the_rows(tmp_path):
    data = _with_truth(tmp_path / "in.parquet", ("P006",))
    job = write_job(tmp_path, data, score={"calibrate": "contextual"}, output={"path": str(tmp_path / "out.parquet"), "audit_rows": 32})
    summary = run_job(load_job(job), progress=False)
    out = pq.read_table(tmp_path / "out.parquet").to_pandas()
    assert len(out) == 10 and summary.rows == 10 and list(out["pair_id"]) == [f"P006-Q{i:02d}" for i in range(10)]
    p_cf = np.exp(summary.quality.calibration["params"]["log_p_content_free"])
    ratio = out[["p_Yes", "p_No"]].to_numpy() / p_cf
    assert out[["p_cal_Yes", "p_cal_No"]].to_numpy() == pytest.approx(ratio / ratio.sum(axis=1, keepdims=True))
    assert summary.audit.rows == 10  # the exactness audit reads the rows, not the content-free input


def test_review_without_a_labeled_row_exits_2_naming_output_review(tmp_path):
    data = _with_truth(tmp_path / "in.parquet", ("P007",), null_truth=True)
    job = write_job(tmp_path, data, calibrate={"truth_column": "relevant"},
                    output={"path": str(tmp_path / "out.parquet"), "audit_rows": 0, "review": {}})
    result = CliRunner().invoke(main, ["run", str(job), "-q"])
    assert result.exit_code == 2, result.output
    assert "output.review" in result.output and "none of the 10 scored rows" in result.output
    assert (tmp_path / "_out.parquet.parts").exists()  # the scored rows are kept for the rerun


def test_truth_values_that_are_not_labels_are_named():
    from batchscore.errors import CalibrationError
    from batchscore.scores.quality import add_quality_columns

    config = config_from_dict(_job(calibrate={"truth_column": "relevant"}))
    columns = {"p_Yes": pa.array([0.4, 0.6, 0.3]), "p_No": pa.array([0.6, 0.4, 0.7]),
               "label": pa.array(["No", "Yes", "No"]), "label_mass": pa.array([0.5, 0.5, 0.5])}
    kept = pa.table({"relevant": ["No", " Yes ", "yes!"]})  # surrounding spaces are fine, other text is not
    with pytest.raises(CalibrationError) as info:
        add_quality_columns(config, columns, np.ones(3, dtype=bool), kept, pa.array(["a", "b", "c"]))
    assert info.value.exit_code == 2
    assert "calibrate.truth_column 'relevant': 1 row(s)" in str(info.value) and "row 'c': 'yes!'" in str(info.value)


def test_a_nan_truth_leaves_the_row_unlabeled_as_a_null_does():
    """JSON Lines may write NaN; a truth column of floats holds it for an unknown label: the row is
    unlabeled (jobs.md), not the text 'nan' refused with exit 2."""
    from batchscore.scores.quality import _truth

    config = config_from_dict(_job(calibrate={"truth_column": "relevant"}))
    kept = pa.table({"relevant": pa.array([1.0, float("nan"), None, 0.0])})
    truth = _truth(config, kept, np.ones(4, dtype=bool), pa.array(["a", "b", "c", "d"]), ["0.0", "1.0"], None)
    assert truth.tolist() == [1, -1, -1, 0]
