"""Numbers people can act on, for a questions job: calibration, review and out-of-scope per
question (`questions:` jobs written as a table; `tasks/questions/files.py` calls this).

Each of the job's questions is judged on its own, exactly as `scores/quality.py` judges a labels
job: its option probabilities over the records that answered it form an [N, n] matrix; the
labeled records (a non-null value in `calibrate.truth_columns.<id>`) are split by
`calibrate.seed` into fit and evaluation records; the method's values are fitted (or reused
from `calibrate.from`), and the measures and the review threshold use the evaluation records.

Columns per question `<id>` (after all the questions' own columns): `<id>.p_cal.<option>` with
`score.calibrate` (and `<id>.choice` follows them, unless the calibration made the question's
evaluation records worse in log-loss: then it stays raw, with a warning naming the question);
`<id>.needs_review` with `output.review`
(over `score.confidence`'s definition of the calibrated probabilities; `<id>.confidence` stays
TypeSafe's, as the formats define it); `<id>.out_of_scope` with `output.out_of_scope`.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from batchscore.errors import CalibrationError
from batchscore.scores import calibration, review
from batchscore.tasks.questions.answers import QuestionAnswer
from batchscore.scores.quality import (SHOWN, QualityResult, batch_warnings, calibrate_rows, out_of_scope_column,
                                       review_column, split_labeled, wanted as quality_wanted, worse_warning)
from batchscore.tasks.questions.columns import CHOICE, NEEDS_REVIEW, OUT_OF_SCOPE, P_CAL
from batchscore.tasks.questions.columns import column as question_column
from batchscore.tasks.questions.requests import parse_systemone

log = logging.getLogger("batchscore")

QUESTION_METHODS = ("none", "batch", "temperature", "vector", "platt")  # contextual: labels jobs only
TRUE_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def wanted(config) -> bool:
    """The job asks for any column or measure this module gives."""
    return quality_wanted(config) or bool(config.calibrate.truth_columns)


def calibrated(config, question) -> bool:
    """Whether `question` is calibrated: every question with `batch` or `calibrate.from`; with a
    fitted method, the questions that have a truth column (the others stay uncalibrated)."""
    method = config.score.calibrate
    if method == "none":
        return False
    if method in calibration.FITTED and config.calibrate.from_ is None:
        return str(question.key) in config.calibrate.truth_columns
    return True


def reviewed(config, question) -> bool:
    """Whether `question` gets a review threshold: with output.review, where it has a truth column."""
    return config.output.review is not None and str(question.key) in config.calibrate.truth_columns


def column_types(config, questions: Sequence) -> dict[str, str]:
    """The columns this module adds, per question in order, with their kind."""
    if not wanted(config):
        return {}
    columns: dict[str, str] = {}
    for question in questions:
        q = str(question.key)
        if calibrated(config, question):
            columns.update({question_column(q, P_CAL, option): "float64" for option in question.options})
        if reviewed(config, question):
            columns[question_column(q, NEEDS_REVIEW)] = "bool"
        if config.output.out_of_scope is not None:
            columns[question_column(q, OUT_OF_SCOPE)] = "bool"
    return columns


def truth_index(question, value: Any) -> int | None:
    """The option index `value` names for `question`, or None when it names none. Accepted: the
    option's name (choice; score "0".."n-1"), a score's level text or integer level, and for noul
    (yes/no) and predicate (false/true) a boolean or yes/no/true/false/1/0."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 1.0 from a pandas column of 1/0 with nulls (float64) is 1
    if isinstance(value, bool) or question.type in ("noul", "predicate"):
        word = TRUE_WORDS.get(str(value).strip().lower())
        if word is None or question.type not in ("noul", "predicate"):
            return None
        return (0 if word else 1) if question.type == "noul" else (1 if word else 0)
    text = str(value).strip()
    names = {option.strip(): i for i, option in enumerate(question.options)}
    if question.type == "score" and question.levels:
        names.update({str(level).strip(): i for i, level in enumerate(question.levels)})
    return names.get(text)


def add_question_quality(config, questions: Sequence, answers: list[list | None], kept: pa.Table,
                         ids: pa.Array) -> tuple[dict[str, list], dict[str, list], QualityResult]:
    """(the new columns' values, `<id>.choice` values that follow calibration, what was done).

    answers: per record, its answers to `questions` in order (a QuestionAnswer, or its error), or
    None for a record that failed as a whole. Raises CalibrationError."""
    if not wanted(config):
        return {}, {}, QualityResult()
    method = config.score.calibrate
    previous = previous_calibration(config, questions) if config.calibrate.from_ is not None else {}
    columns: dict[str, list] = {}
    choices: dict[str, list] = {}
    result = QualityResult(confidence_method=config.score.confidence)
    calibrated_, reviewed_, scoped = {}, {}, {}
    for j, question in enumerate(questions):
        q = str(question.key)
        p, mass, ok = _matrix(question, [None if a is None else a[j] for a in answers])
        log_p = calibration.log_probs(np.where(ok[:, None], p, np.nan))
        column = config.calibrate.truth_columns.get(q)
        truth = _truth(question, column, kept, ok, ids)
        labeled = np.flatnonzero(ok & (truth >= 0))
        fitting = method in calibration.FITTED and config.calibrate.from_ is None
        fit_rows, eval_rows = split_labeled(labeled, config.calibrate, fitting)
        info = {"options": list(question.options), "params": None, "source": None, "truth_column": column,
                "labeled_rows": int(len(labeled)), "fit_rows": int(len(fit_rows)), "eval_rows": int(len(eval_rows)),
                "before": calibration.measures(log_p[eval_rows], truth[eval_rows]) if len(eval_rows) else None,
                "after": None}
        final_p = p
        if method != "none" and not ok.any():
            info["source"] = "no answered record: nothing to calibrate"
            log.warning("score.calibrate: question %r has no answered record; its p_cal columns are null", q)
            for option in question.options:
                columns[question_column(q, P_CAL, option)] = [None] * len(ok)
        elif method != "none" and not calibrated(config, question):
            info["source"] = "no truth column: uncalibrated"
            log.warning("score.calibrate %s: question %r has no truth column (calibrate.truth_columns); it stays "
                        "uncalibrated", method, q)
        elif method != "none":
            params, info["source"] = _params(config, question, method, log_p, ok, truth, fit_rows, previous)
            info["params"] = params
            cal_p, info["after"] = calibrate_rows(method, params, log_p, ok, truth, eval_rows)
            worse = worse_warning(method, info["before"], info["after"], f"question {q!r}")
            info["applied"] = worse is None
            if worse is None:
                final_p = cal_p
            if method == "batch":
                info["warnings"] = batch_warnings(p, cal_p, ok, list(question.options), f"question {q!r}")
            if worse is not None:
                info["warnings"] = [*info.get("warnings", []), worse]
            for i, option in enumerate(question.options):
                columns[question_column(q, P_CAL, option)] = [float(v) if good else None for v, good in zip(cal_p[:, i], ok)]
            if question.type == "choice" and worse is None:
                best = np.argmax(np.nan_to_num(final_p, nan=-np.inf), axis=1)
                choices[question_column(q, CHOICE)] = [question.options[b] if good else None for b, good in zip(best, ok)]
        info["calibrated"] = method != "none" and bool(info["params"])
        calibrated_[q] = info
        num_options = np.full(len(ok), len(question.options))
        if config.output.review is not None and not reviewed(config, question):
            reviewed_[q] = {"reviewed": False, "reason": "no truth column (calibrate.truth_columns)"}
            log.warning("output.review: question %r has no truth column (calibrate.truth_columns); it is not "
                        "reviewed", q)
        elif config.output.review is not None:
            conf = review.confidence(np.nan_to_num(final_p, nan=0.0), num_options, mass, config.score.confidence)
            array, reviewed_[q] = review_column(config, final_p, num_options, mass, conf, ok, truth, eval_rows,
                                               f"calibrate.truth_columns.{q} ({column!r})", f"question {q!r}")
            columns[question_column(q, NEEDS_REVIEW)] = array.to_pylist()
        if config.output.out_of_scope is not None:
            array, scoped[q] = out_of_scope_column(config, mass, ok, eval_rows)
            columns[question_column(q, OUT_OF_SCOPE)] = array.to_pylist()
    if method != "none" or config.calibrate.truth_columns:
        result.calibration = {"method": method, "normalize": config.score.normalize, "questions": calibrated_,
                              "holdout_fraction": config.calibrate.holdout_fraction
                              if method in calibration.FITTED and config.calibrate.from_ is None else None,
                              "seed": config.calibrate.seed}
    result.review = {"questions": reviewed_} if reviewed_ else None
    result.out_of_scope = {"questions": scoped} if scoped else None
    return columns, choices, result


def check_calibration_source(config) -> None:
    """Fail before scoring when `calibrate.from` holds no values this questions job can reuse."""
    if config.calibrate.from_ is not None:
        previous_calibration(config, parse_systemone({"state": "", "questions": config.questions}).questions)


def previous_calibration(config, questions: Sequence) -> dict[str, dict]:
    """Question id -> the fitted values `calibrate.from`'s completion marker recorded for it;
    raises CalibrationError when a question, its options or the method differ."""
    from batchscore.output.layout import OutputFiles
    from batchscore.output.parts import marker_problem, recorded_summary

    path = config.calibrate.from_
    summary = recorded_summary(OutputFiles(path))
    if summary is None:
        raise CalibrationError(f"calibrate.from: {path} {marker_problem(OutputFiles(path))}; give the output of a "
                               "finished run of this batchscore")
    recorded = summary.get("calibration") or {}
    method = config.score.calibrate
    if not isinstance(recorded, dict) or recorded.get("method") != method \
            or not isinstance(recorded.get("questions"), dict):
        raise CalibrationError(f"calibrate.from: {path} recorded no per-question values of score.calibrate {method} "
                               f"(it recorded {(recorded.get('method') if isinstance(recorded, dict) else None) or 'no calibration'})")
    params = {}
    for question in questions:
        q = str(question.key)
        entry = recorded["questions"].get(q) or {}
        if not isinstance(entry, dict) or entry.get("params") is None or entry.get("options") != list(question.options):
            raise CalibrationError(f"calibrate.from: {path} holds no fitted values for question {q!r} with the "
                                   f"options {list(question.options)} (it has {sorted(recorded['questions'])})")
        problem = calibration.params_problem(method, entry["params"], len(question.options))
        if problem:
            raise CalibrationError(f"calibrate.from: {path}'s completion marker: question {q!r}: the {method} "
                                   f"calibration cannot be applied: {problem}")
        params[q] = entry["params"]
    return params


# ---------------------------------------------------------------------------- pieces


def _matrix(question, answers: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([N, n] option probabilities, NaN where unanswered; [N] label mass; [N] answered)."""
    n = len(question.options)
    p = np.full((len(answers), n), np.nan)
    mass = np.full(len(answers), np.nan)
    ok = np.zeros(len(answers), dtype=bool)
    for r, answer in enumerate(answers):
        if isinstance(answer, QuestionAnswer):
            p[r], mass[r], ok[r] = answer.probabilities, answer.label_mass, True
    return p, mass, ok


def _truth(question, column: str | None, kept: pa.Table, ok: np.ndarray, ids: pa.Array) -> np.ndarray:
    """[N] each record's true option index for `question`, -1 where unknown. Raises
    CalibrationError naming the records whose value names no option."""
    truth = np.full(len(ok), -1, dtype=np.int64)
    if column is None:
        return truth
    values = kept.column(column).to_pylist()
    bad = []
    for row in np.flatnonzero(ok):
        if values[row] is None or isinstance(values[row], float) and np.isnan(values[row]):
            continue  # unlabeled (NaN: a pandas float column's missing value)
        index = truth_index(question, values[row])
        if index is None:
            bad.append(row)
        else:
            truth[row] = index
    if bad:
        shown = ", ".join(f"row {ids[int(r)].as_py()!r}: {values[r]!r}" for r in bad[:SHOWN])
        more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        raise CalibrationError(f"calibrate.truth_columns.{question.key} {column!r}: {len(bad)} row(s) hold a value "
                               f"that is not one of the options {list(question.options)} ({shown}{more}); make them "
                               "one, or null to leave a row unlabeled")
    return truth


def _params(config, question, method: str, log_p: np.ndarray, ok: np.ndarray, truth: np.ndarray,
            fit_rows: np.ndarray, previous: dict) -> tuple[dict, str]:
    """(the method's values for `question`, where they came from)."""
    q = str(question.key)
    if config.calibrate.from_ is not None:
        return previous[q], f"calibrate.from {config.calibrate.from_}"
    if method == "batch":
        return {"bias": calibration.batch_bias(log_p[ok]).tolist()}, f"the mean over {int(ok.sum())} answered records"
    if not len(fit_rows):
        labeled = int((ok & (truth >= 0)).sum())
        why = (f"calibrate.truth_columns.{q} is null in every answered record; label some" if not labeled else
               f"{labeled} answered record{'s are' if labeled > 1 else ' is'} labeled, and calibrate.holdout_fraction "
               f"{config.calibrate.holdout_fraction:g} keeps {'them' if labeled > 1 else 'it'} all for evaluation; label "
               "more (at least 2: one fits, one evaluates)")
        raise CalibrationError(f"score.calibrate {method}: question {q!r} has no labeled record to fit on — {why}, "
                               "or reuse fitted values with calibrate.from")
    return (calibration.fit(method, log_p[fit_rows], truth[fit_rows]), f"fitted on {len(fit_rows)} labeled records"
            + calibration.one_class_warning(truth[fit_rows], method, f"question {q!r}: "))
