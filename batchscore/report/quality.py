"""What the report says about the quality of an output: against a truth column (accuracy and
macro-F1 with bootstrap intervals, ECE and Brier before and after calibration, reliability,
coverage against error, the confusion matrix), and without one (class prevalence with intervals).

Pure numpy (+ scipy through `significance`); ECE and Brier are scores/calibration.py's own
definitions, so the report and the run summary agree on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batchscore.errors import ReportError
from batchscore.output.summary import RunSummary
from batchscore.scores.calibration import ECE_BINS, measures
from batchscore.report.data import ScoredOutput
from batchscore.report.significance import (Interval, accuracy_of, bootstrap_confusion, macro_f1_of,
                                            wilson)


def truth_column(output: ScoredOutput, explicit: str | None, summary: RunSummary | None) -> str | None:
    """The output's truth column: `explicit` (`report --truth`; ReportError when the output has
    no such column), else the run summary's `calibration.truth_column` when the output holds it."""
    if explicit is not None:
        if explicit not in output.kept:
            raise ReportError(f"--truth {explicit!r} is not a column of {output.path} "
                              f"(its input columns: {sorted(output.kept) or 'none'})")
        return explicit
    named = ((summary.quality.calibration if summary else None) or {}).get("truth_column")
    return named if named in output.kept else None


@dataclass
class Reliability:
    """One probability set's reliability bins (the ECE's): rows per bin, their mean top
    probability and their accuracy (NaN for empty bins)."""

    name: str
    counts: np.ndarray  # [ECE_BINS]
    confidence: np.ndarray  # [ECE_BINS]
    accuracy: np.ndarray  # [ECE_BINS]


@dataclass
class Coverage:
    """Rows accepted (most confident first) against the error among them."""

    coverage: np.ndarray  # [n] share of labeled rows accepted: 1/n .. 1
    error: np.ndarray  # [n] share of the accepted rows that are wrong
    source: str  # which confidence orders the rows
    threshold: float | None = None  # output.review's threshold, from the run summary
    threshold_coverage: float | None = None  # labeled rows with confidence ≥ threshold
    threshold_error: float | None = None  # wrong among them
    max_error: float | None = None  # output.review's error budget
    reason: str | None = None  # why output.review found no threshold, with the numbers


@dataclass
class Quality:
    """Every number of the quality section (rows: ok rows whose truth is one of the labels)."""

    truth_column: str
    labels: list[str]
    rows: int
    unlabeled: int  # ok rows whose truth is null
    not_a_label: dict[str, int]  # truth values that are not a label -> ok rows (left out)
    confusion: np.ndarray  # [K, K] rows: truth, columns: predicted label
    accuracy: Interval | None
    macro_f1: Interval | None
    raw: dict  # ECE, Brier (and NLL, accuracy) of the p_<label> columns
    calibrated: dict | None  # the same of the p_cal_<label> columns, when the output has them
    reliability: list[Reliability]
    coverage: Coverage | None


def assess(output: ScoredOutput, column: str, summary: RunSummary | None = None) -> Quality:
    """The quality of `output` against its truth column `column`; `summary` (the run's) gives
    output.review's threshold and budget for the coverage curve."""
    labels = list(output.labels)
    index = {label: i for i, label in enumerate(labels)}
    values = output.kept[column]
    truth = np.full(output.rows, -1, dtype=np.int64)
    unlabeled, not_a_label = 0, {}
    for row in np.flatnonzero(output.ok):
        value = values[row]
        if value is None:
            unlabeled += 1
            continue
        text = str(value).strip()
        if text in index:
            truth[row] = index[text]
        else:
            not_a_label[text] = not_a_label.get(text, 0) + 1
    rows = np.flatnonzero(truth >= 0)
    y = truth[rows]
    predicted = np.array([index.get(output.label[r], -1) for r in rows], dtype=np.int64)
    k = len(labels)
    confusion = np.zeros((k, k), dtype=np.int64)
    np.add.at(confusion, (y[predicted >= 0], predicted[predicted >= 0]), 1)
    raw_p = _matrix(output.probs, labels, rows)
    cal_p = _matrix(output.calibrated, labels, rows) if output.calibrated else None
    sets = [("raw p_<label>", raw_p)] + ([("calibrated p_cal_<label>", cal_p)] if cal_p is not None else [])
    final_p = cal_p if cal_p is not None else raw_p
    return Quality(
        truth_column=column, labels=labels, rows=len(rows), unlabeled=unlabeled, not_a_label=not_a_label,
        confusion=confusion,
        accuracy=bootstrap_confusion(confusion, accuracy_of),
        macro_f1=bootstrap_confusion(confusion, macro_f1_of),
        raw=_measures(raw_p, y),
        calibrated=_measures(cal_p, y) if cal_p is not None else None,
        reliability=[reliability(name, p, y) for name, p in sets] if len(rows) else [],
        coverage=coverage_curve(output, rows, predicted == y, final_p, summary) if len(rows) else None,
    )


def _matrix(probs: dict[str, np.ndarray], labels: list[str], rows: np.ndarray) -> np.ndarray:
    return np.column_stack([probs[label][rows] for label in labels]) if labels else np.zeros((len(rows), 0))


def _measures(p: np.ndarray, truth: np.ndarray) -> dict:
    with np.errstate(divide="ignore"):
        return measures(np.log(p), truth)


def reliability(name: str, p: np.ndarray, truth: np.ndarray, bins: int = ECE_BINS) -> Reliability:
    """The bins of scores/calibration.py's top-label ECE over probabilities `p` [n, K]."""
    top = p.max(axis=1)
    correct = p.argmax(axis=1) == truth
    which = np.minimum((top * bins).astype(np.int64), bins - 1)
    counts = np.bincount(which, minlength=bins)
    with np.errstate(invalid="ignore"):
        confidence = np.bincount(which, weights=top, minlength=bins) / counts
        accuracy = np.bincount(which, weights=correct, minlength=bins) / counts
    return Reliability(name, counts, confidence, accuracy)


def coverage_curve(output: ScoredOutput, rows: np.ndarray, correct: np.ndarray, final_p: np.ndarray,
                   summary: RunSummary | None) -> Coverage:
    """Coverage against error over the labeled `rows`, most confident first: by the output's
    `confidence` column when it has one, else by the top (calibrated, if any) probability."""
    if output.confidence is not None:
        conf, source = output.confidence[rows], "the confidence column"
    else:
        conf = final_p.max(axis=1)
        source = "the top calibrated probability" if output.calibrated else "the top probability"
    order = np.argsort(-conf, kind="stable")
    n = len(rows)
    wrong = np.cumsum(~correct[order])
    accepted = np.arange(1, n + 1)
    curve = Coverage(accepted / n, wrong / accepted, source)
    review = (summary.quality.review if summary else None) or {}
    curve.max_error = review.get("max_error")
    curve.reason = review.get("reason")
    if review.get("threshold") is not None:
        curve.threshold = float(review["threshold"])
        taken = conf >= curve.threshold
        curve.threshold_coverage = float(taken.mean())
        curve.threshold_error = float((~correct[taken]).mean()) if taken.any() else None
    return curve


@dataclass
class Prevalence:
    """Each label's share of the predicted labels (ok rows) and, with a truth column, of the true
    labels (labeled rows), with Wilson intervals."""

    labels: list[str]
    predicted: list[Interval | None]
    predicted_rows: int
    truth: list[Interval | None] | None = None
    truth_rows: int = 0


def prevalence(output: ScoredOutput, quality: Quality | None = None) -> Prevalence:
    labels = list(output.labels)
    counts = [sum(1 for label, ok in zip(output.label, output.ok) if ok and label == name) for name in labels]
    total = int(sum(counts))
    result = Prevalence(labels, [wilson(c, total) for c in counts], total)
    if quality is not None and quality.rows:
        true_counts = quality.confusion.sum(axis=1)
        result.truth = [wilson(int(c), quality.rows) for c in true_counts]
        result.truth_rows = quality.rows
    return result
