"""Calibration, review and out-of-scope per question of a `questions:` job.

Hand computations on made-up answers (Batch Calibration's bias and renormalization per question,
a fitted temperature recovered per question, the review threshold, what a truth value may be),
the job keys refused by name, and one real run over the twelve sample tickets (smollm2, float32)
whose output's calibrated columns equal Batch Calibration of its own raw columns, and whose
fitted values a second run reuses through `calibrate.from`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from batchscore.cli import main
from batchscore.errors import CalibrationError, JobConfigError
from batchscore.jobfile import config_from_dict
from batchscore.tasks.questions.quality import add_question_quality, column_types, truth_index
from batchscore.tasks.questions.answers import read_answer
from batchscore.tasks.questions.requests import parse_systemone
from tests.conftest import REPO

QUESTIONS = yaml.safe_load((REPO / "jobs" / "decisions.yaml").read_text())["questions"]  # the shipped example's
# the true answers of the twelve sample tickets (sample_data/tickets.jsonl), in file order
TRUE_TEAM = ["billing", "shipping", "security", "shipping", "other", "billing", "security", "shipping", "shipping",
             "billing", "security", "shipping"]
TRUE_REFUND = [True, False, False, False, False, True, False, True, False, True, False, False]
TRUE_MOOD = [1, 1, 1, 0, 0, 2, 1, 2, 0, 2, 2, 3]


def job(tmp_path: Path | None = None, **sections) -> dict:
    data = {"input": {"path": "in.jsonl", "id_column": "ticket_id"},
            "prompt": {"state_columns": ["subject", "body"], "system": "You route customer-support tickets."},
            "questions": QUESTIONS, "model": "smollm2-135m-instruct", "output": {"path": "out.parquet"}}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return data


def questions():
    return parse_systemone({"state": "", "questions": QUESTIONS}).questions


def answers_from(logits: dict[str, np.ndarray]) -> list[list]:
    """Per record, the answers of `questions()` read from made-up label log-probabilities."""
    qs = questions()
    count = len(next(iter(logits.values())))
    return [[read_answer(q, logits[str(q.key)][r]) for q in qs] for r in range(count)]


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def made_up(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Label log-probabilities per question (noul: yes, no, Yes, No), with label mass below 1."""
    rng = np.random.default_rng(seed)
    return {"team": np.log(softmax(rng.normal(size=(rows, 4)) * 2) * 0.8),
            "refund": np.log(softmax(rng.normal(size=(rows, 4))) * 0.9),
            "mood": np.log(softmax(rng.normal(size=(rows, 4)) + [1.0, 0.5, 0.0, -0.5]) * 0.7)}


# ---------------------------------------------------------------------------- hand computations


def test_batch_calibration_per_question_by_hand():
    logits = made_up(6)
    config = config_from_dict(job(score={"calibrate": "batch"}))
    ids = pa.array([f"r{i}" for i in range(6)])
    columns, follow, result = add_question_quality(config, questions(), answers_from(logits), pa.table({}), ids)
    for q in questions():
        key = str(q.key)
        p = np.array([a.probabilities for a in (r[[str(x.key) for x in questions()].index(key)]
                                                for r in answers_from(logits))])
        log_p = np.log(p)
        expected = softmax(log_p - log_p.mean(axis=0))  # Zhou et al.: remove each class's mean, renormalize
        got = np.column_stack([columns[f"{key}.p_cal.{o}"] for o in q.options])
        np.testing.assert_allclose(got, expected, atol=1e-12)
        np.testing.assert_allclose(result.calibration["questions"][key]["params"]["bias"], log_p.mean(axis=0))
    best = np.argmax(np.column_stack([columns[f"team.p_cal.{o}"] for o in questions()[0].options]), axis=1)
    assert follow["team.choice"] == [questions()[0].options[b] for b in best]
    assert set(follow) == {"team.choice"}  # noul and score keep their raw p_yes / score


def test_a_question_no_record_answered_keeps_null_calibrated_columns():
    """Failed reads (an error message instead of an answer) of one question never stop the
    assembly: its p_cal columns are null, the other questions are calibrated."""
    answers = [[a[0], "not scored: too long", a[2]] for a in answers_from(made_up(3))] + [None]
    config = config_from_dict(job(score={"calibrate": "batch"}))
    columns, _, result = add_question_quality(config, questions(), answers, pa.table({}), pa.array(list("abcd")))
    assert columns["refund.p_cal.yes"] == [None] * 4 and result.calibration["questions"]["refund"]["params"] is None
    assert columns["team.p_cal.billing"][3] is None and None not in columns["team.p_cal.billing"][:3]


def test_temperature_is_recovered_per_question_from_labeled_records():
    rng = np.random.default_rng(4)
    rows, temperature = 4000, 2.5
    true_logits = rng.normal(size=(rows, 4)) * 3
    truth = np.array([rng.choice(4, p=softmax(z[None] / 1.0)[0]) for z in true_logits])
    # the model is overconfident by `temperature`: its log-probabilities are the true ones × T
    model = {"team": np.log(softmax(true_logits * temperature)), "refund": np.log(softmax(rng.normal(size=(rows, 4)))),
             "mood": np.log(softmax(true_logits * temperature))}
    team = questions()[0]
    kept = pa.table({"true_team": [team.options[t] for t in truth], "true_mood": truth.tolist(),
                     "true_refund": [None] * rows})
    config = config_from_dict(job(score={"calibrate": "temperature"}, calibrate={
        "truth_columns": {"team": "true_team", "mood": "true_mood", "refund": "true_refund"},
        "holdout_fraction": 0.5}))
    ids = pa.array(np.arange(rows))
    with pytest.raises(CalibrationError, match="question 'refund' has no labeled record"):
        add_question_quality(config, questions(), answers_from(model), kept, ids)
    config.calibrate.truth_columns.pop("refund")
    config.score.calibrate = "temperature"
    only = [q for q in questions() if q.key != "refund"]
    answers = [[a for a, q in zip(r, questions()) if q.key != "refund"] for r in answers_from(model)]
    _, _, result = add_question_quality(config, only, answers, kept, ids)
    for key in ("team", "mood"):
        info = result.calibration["questions"][key]
        assert info["params"]["temperature"] == pytest.approx(temperature, rel=0.1)
        assert info["fit_rows"] == rows // 2 and info["eval_rows"] == rows - rows // 2
        assert info["after"]["ece"] < info["before"]["ece"]


def test_review_meets_the_budget_per_question_on_held_out_records():
    rng = np.random.default_rng(7)
    rows = 3000
    p_yes = rng.uniform(size=rows)
    truth = rng.uniform(size=rows) < p_yes  # well calibrated: P(yes) is the chance it is yes
    refund = np.log(np.column_stack([p_yes, 1 - p_yes, np.full(rows, 1e-9), np.full(rows, 1e-9)]))
    logits = {**made_up(rows), "refund": refund}
    kept = pa.table({"t_team": ["billing"] * rows, "t_refund": truth.tolist(), "t_mood": [0] * rows})
    config = config_from_dict(job(calibrate={"truth_columns": {"team": "t_team", "refund": "t_refund",
                                                               "mood": "t_mood"}},
                                  output={"review": {"max_error": 0.1, "confidence": 0.95}}))
    columns, _, result = add_question_quality(config, questions(), answers_from(logits), kept, pa.array(range(rows)))
    review = result.review["questions"]["refund"]
    accepted = ~np.array(columns["refund.needs_review"])
    correct = (p_yes >= 0.5) == truth
    assert 0 < accepted.sum() < rows
    assert 1 - correct[accepted].mean() <= 0.1  # the accepted records' error is within the budget
    assert review["accepted_rows"] == accepted.sum()
    assert set(column_types(config, questions())) == {f"{k}.needs_review" for k in QUESTIONS}


def test_a_calibration_that_worsens_its_evaluation_records_is_not_applied(caplog):
    """Batch Calibration assumes every answer about equally common; here every true team is billing
    and the model says so: removing the mean makes the evaluation records worse in log-loss. The
    team's choice stays raw, its p_cal columns are still written, and the warning names the
    question and both log-losses."""
    rng = np.random.default_rng(3)
    rows = 40
    team = np.log(softmax(np.column_stack([rng.normal(3.0, 0.5, rows), rng.normal(size=(rows, 3))])) * 0.9)
    logits = {**made_up(rows), "team": team}
    kept = pa.table({"t_team": ["billing"] * rows})
    config = config_from_dict(job(score={"calibrate": "batch"}, calibrate={"truth_columns": {"team": "t_team"}}))
    with caplog.at_level("WARNING", logger="batchscore"):
        columns, follow, result = add_question_quality(config, questions(), answers_from(logits), kept,
                                                        pa.array(range(rows)))
    info = result.calibration["questions"]["team"]
    assert info["applied"] is False and info["after"]["nll"] > info["before"]["nll"]
    assert "team.choice" not in follow  # the writer keeps the raw choice (billing for every record)
    cal = np.column_stack([columns[f"team.p_cal.{o}"] for o in questions()[0].options])
    np.testing.assert_allclose(cal, softmax(np.log(softmax(team)) - np.log(softmax(team)).mean(axis=0)), atol=1e-9)
    warned = [r.getMessage() for r in caplog.records if "worse in log-loss" in r.getMessage()]
    assert len(warned) == 1 and "question 'team'" in warned[0]
    assert f"before {info['before']['nll']:.4f}, after {info['after']['nll']:.4f}" in warned[0]
    assert warned[0] in info["warnings"]
    # the questions without a truth column have no evaluation records to judge by: calibrated as asked
    assert result.calibration["questions"]["mood"]["applied"] is True


def test_review_warnings_name_their_question_once_each(caplog):
    """A budget no question can meet: each question's "no threshold" warning names it, once."""
    rows = 30
    kept = pa.table({"t_team": ["billing"] * rows, "t_refund": [True] * rows, "t_mood": [0] * rows})
    config = config_from_dict(job(calibrate={"truth_columns": {"team": "t_team", "refund": "t_refund",
                                                               "mood": "t_mood"}},
                                  output={"review": {"max_error": 0.01, "confidence": 0.95}}))
    with caplog.at_level("WARNING", logger="batchscore"):
        _, _, result = add_question_quality(config, questions(), answers_from(made_up(rows)), kept,
                                            pa.array(range(rows)))
    warned = [r.getMessage() for r in caplog.records if "found no threshold" in r.getMessage()]
    assert sorted(w.split(":")[0] for w in warned) == sorted(f"question {k!r}" for k in QUESTIONS)
    assert len(set(warned)) == len(warned) == 3
    assert all(result.review["questions"][k]["reason"] for k in QUESTIONS)


@pytest.mark.parametrize("key, value, index", [
    ("team", "shipping", 1), ("team", " other ", 3), ("team", "Shipping", None),
    ("refund", True, 0), ("refund", "no", 1), ("refund", "YES", 0), ("refund", 0, 1), ("refund", "maybe", None),
    ("mood", 2, 2), ("mood", 2.0, 2), ("mood", "3", 3), ("mood", "annoyed", 1), ("mood", 7, None),
    ("team", True, None),
])
def test_what_a_truth_value_may_be(key, value, index):
    question = next(q for q in questions() if q.key == key)
    assert truth_index(question, value) == index


def test_a_truth_value_that_names_no_option_is_refused_naming_the_row():
    config = config_from_dict(job(calibrate={"truth_columns": {"team": "t"}}))
    kept = pa.table({"t": ["billing", "sales"]})
    only = [questions()[0]]
    answers = [[a[0]] for a in answers_from(made_up(2))]
    with pytest.raises(CalibrationError, match=r"truth_columns.team 't'.*row 'b': 'sales'"):
        add_question_quality(config, only, answers, kept, pa.array(["a", "b"]))


# ---------------------------------------------------------------------------- job keys


@pytest.mark.parametrize("sections, message", [
    ({"score": {"calibrate": "contextual"}}, "score.calibrate contextual: applies to labels jobs"),
    ({"calibrate": {"truth_columns": {"teams": "t"}}}, r"\['teams'\] are not questions of this job"),
    ({"calibrate": {"truth_column": "t"}}, "calibrate.truth_columns: {<question id>: <input column>}"),
    ({"score": {"calibrate": "vector"}}, r"calibrate.truth_columns names no question"),
    ({"score": {"calibrate": "platt"}, "calibrate": {"truth_columns": {k: "t" for k in QUESTIONS}}},
     r"two-option questions only .*team \(4 options\), mood \(4 options\)"),
    ({"output": {"review": {"max_error": 0.1}}}, r"output.review: needs a truth column for the questions to review"),
    ({"output": {"format": "openai_batch", "review": {"max_error": 0.1}}}, "not output.format openai_batch"),
    ({"calibrate": {"truth_columns": {"team": 3}}}, "each value is an input column name; got team: 3"),
])
def test_bad_question_calibration_keys_are_refused_by_name(sections, message):
    with pytest.raises(JobConfigError, match=message):
        config_from_dict(job(**sections))


def test_truth_columns_belong_to_questions_jobs():
    data = {"input": {"path": "in.jsonl"}, "prompt": {"template": "{text}"}, "labels": ["Yes", "No"],
            "calibrate": {"truth_columns": {"a": "b"}}, "output": {"path": "out.parquet"}}
    with pytest.raises(JobConfigError, match="calibrate.truth_columns: for questions jobs"):
        config_from_dict(data)


# ---------------------------------------------------------------------------- a real run


def write_job(folder: Path, **sections) -> Path:
    rows = [json.loads(line) for line in (REPO / "sample_data" / "tickets.jsonl").read_text().splitlines()]
    for row, team, refund, mood in zip(rows, TRUE_TEAM, TRUE_REFUND, TRUE_MOOD):
        row.update(true_team=team, true_refund=refund, true_mood=mood)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tickets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = {"path": str(folder / "out.parquet"), "audit_rows": 0, **sections.pop("output", {})}
    data = job(input={"path": str(folder / "tickets.jsonl")}, engine={"kind": "torch", "dtype": "float32"},
               output=output, **sections)
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


TRUTHS = {"truth_columns": {"team": "true_team", "refund": "true_refund", "mood": "true_mood"}}


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("question_quality")
    path = write_job(folder, score={"calibrate": "batch"}, calibrate=TRUTHS,
                     output={"out_of_scope": {"min_label_mass": "auto"}})
    result = CliRunner().invoke(main, ["run", str(path), "-q"])
    assert result.exit_code == 0, result.output
    return folder


def test_a_real_run_writes_batch_calibrated_columns_of_its_own_raw_columns(batch_run):
    table = pq.read_table(batch_run / "out.parquet").to_pydict()
    summary = json.loads((batch_run / "_out.parquet.complete.json").read_text())["summary"]
    assert table["true_team"] == TRUE_TEAM  # the truth columns are copied into the output
    for q in questions():
        key = str(q.key)
        raw = (np.column_stack([table[f"{key}.p.{o}"] for o in q.options]) if q.type != "noul" else
               np.column_stack([table[f"{key}.p_yes"], 1 - np.array(table[f"{key}.p_yes"])]))
        cal = np.column_stack([table[f"{key}.p_cal.{o}"] for o in q.options])
        np.testing.assert_allclose(cal, softmax(np.log(raw) - np.log(raw).mean(axis=0)), atol=1e-9)
        info = summary["calibration"]["questions"][key]
        assert info["labeled_rows"] == 12 and info["eval_rows"] == 12  # batch fits nothing: all rows evaluate
        assert info["before"]["rows"] == 12 and info["after"]["rows"] == 12
        assert summary["out_of_scope"]["questions"][key]["auto"] is True
        assert sum(table[f"{key}.out_of_scope"]) == summary["out_of_scope"]["questions"][key]["rows"]
    team = questions()[0]
    applied = summary["calibration"]["questions"]["team"]["applied"]
    # the choice follows the calibration unless it made the evaluation records worse in log-loss
    follows = np.column_stack([table[f"team.{'p_cal' if applied else 'p'}.{o}"] for o in team.options])
    assert table["team.choice"] == [team.options[i] for i in follows.argmax(axis=1)]
    assert applied == (summary["calibration"]["questions"]["team"]["after"]["nll"]
                       <= summary["calibration"]["questions"]["team"]["before"]["nll"])


def test_the_report_of_a_real_run_reads_each_question_and_its_calibration(batch_run):
    """`batchscore report` on the questions output: one section per question, the answered counts,
    the out-of-scope counts of the output's own columns and the summary's ECE before and after."""
    from batchscore.tasks.questions.report import read_questions

    result = CliRunner().invoke(main, ["report", str(batch_run / "out.parquet")])
    assert result.exit_code == 0, result.output
    html = (batch_run / "_out.parquet.report.html").read_text()
    table = pq.read_table(batch_run / "out.parquet")
    summary = json.loads((batch_run / "_out.parquet.complete.json").read_text())["summary"]
    for question in read_questions(table):
        assert f'id="q-{question.key}"' in html and question.answered == 12
        assert question.out_of_scope == sum(table.column(f"{question.key}.out_of_scope").to_pylist())
        info = summary["calibration"]["questions"][question.key]
        assert f"{info['before']['ece']:.4f} → {info['after']['ece']:.4f}" in html
    # a score answer is a 0-based level index: the summary names the levels, the report shows them
    mood = next(q for q in questions() if q.type == "score")
    assert json.loads(summary["decisions"]["score_levels"]) == {str(mood.key): list(mood.levels)}
    assert "0-based level indexes" in html and any(f"{i} = {level}" in html for i, level in enumerate(mood.levels))


@pytest.mark.slow  # a second real run
def test_calibrate_from_reuses_the_fitted_values(batch_run, tmp_path):
    path = write_job(tmp_path, score={"calibrate": "batch"}, calibrate={"from": str(batch_run / "out.parquet")})
    rows = (tmp_path / "tickets.jsonl").read_text().splitlines()
    (tmp_path / "tickets.jsonl").write_text("\n".join(rows[:3]) + "\n")  # three records: their own mean would differ
    result = CliRunner().invoke(main, ["run", str(path), "-q"])
    assert result.exit_code == 0, result.output
    first = pq.read_table(batch_run / "out.parquet").to_pydict()
    again = pq.read_table(tmp_path / "out.parquet").to_pydict()
    team = questions()[0]
    reused = np.column_stack([again[f"team.p_cal.{o}"] for o in team.options])
    # three records pack their passes otherwise than twelve: float sums in another order (1e-5)
    np.testing.assert_allclose(reused, np.column_stack([first[f"team.p_cal.{o}"][:3] for o in team.options]),
                               atol=1e-5)
    raw = np.log(np.column_stack([again[f"team.p.{o}"] for o in team.options]))
    assert np.abs(reused - softmax(raw - raw.mean(axis=0))).max() > 1e-2  # not the three records' own mean
    summary = json.loads((tmp_path / "_out.parquet.complete.json").read_text())["summary"]
    assert summary["calibration"]["questions"]["team"]["source"].startswith("calibrate.from")


def test_a_new_calibration_of_a_finished_questions_output_scores_nothing(batch_run, tmp_path):
    """Only the post-processing changed (batch → temperature calibration): the rerun reads the
    records again without tokenizing, takes each read's raw scores from the `_<output>.reads` the
    first run kept, and writes the output anew (`rederived`, nothing processed); its raw answer
    columns are the first run's bits, its calibrated ones the temperature fit's."""
    import shutil

    folder = batch_run  # in place (the job's identity names its input): its files put back after
    saved = tmp_path / "saved"
    shutil.copytree(folder, saved)
    assert (folder / "_out.parquet.reads").exists()
    path = folder / "job.yaml"
    metrics = folder / "metrics.json"
    result = CliRunner().invoke(main, ["run", str(path), "-q", "--set", "score.calibrate=temperature",
                                       "--metrics", str(metrics)])
    assert result.exit_code == 0, result.output
    summary = json.loads(metrics.read_text())
    assert summary["rederived"] is True and summary["processed_tokens"] == 0 and summary["rows_ok"] == 12
    first, again = pq.read_table(saved / "out.parquet"), pq.read_table(folder / "out.parquet")
    for q in questions():
        raw = [f"{q.key}.p.{o}" for o in q.options] if q.type != "noul" else [f"{q.key}.p_yes"]
        for name in raw:
            assert again.column(name).equals(first.column(name)), name
    calibrated = json.loads((folder / "_out.parquet.complete.json").read_text())["summary"]["calibration"]
    assert calibrated["method"] == "temperature" and calibrated["questions"]["team"]["fit_rows"] == 6
    assert again.column("team.p_cal.billing").to_pylist() != first.column("team.p_cal.billing").to_pylist()
    for name in ("out.parquet", "_out.parquet.complete.json", "_out.parquet.reads"):
        shutil.copy2(saved / name, folder / name)
