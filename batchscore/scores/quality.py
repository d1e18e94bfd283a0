"""Numbers people can act on: the calibration and review columns of an output, added once every
row's scores exist (`runner.assemble_output`, right after `scores.score_columns`).

- `score.calibrate`: `p_cal_<label>` (`p_cal_choices`) beside the raw `p_<label>`; `label`
  (`choice`, `choice_index`) then follows the calibrated probabilities — unless the calibration
  made its own evaluation rows worse in log-loss (`worse_warning`): then the answers stay raw.
- `score.confidence`: the `confidence` column (over the calibrated probabilities when calibrated).
- `output.review`: `needs_review`, true below the threshold chosen on the evaluation rows.
- `output.out_of_scope`: `out_of_scope`, true where label_mass is below the floor.

Labeled rows (a non-null `calibrate.truth_column`) are split by `calibrate.seed` into fit rows
(`holdout_fraction` of them, only for a method fitted in this run) and evaluation rows (the rest;
all of them otherwise); the measures and the review threshold use the evaluation rows only.
What was fitted and measured is returned as a `QualityResult` for the run summary, which
`calibrate.from` reads back. The math lives in scores/calibration.py and scores/review.py.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from batchscore.errors import CalibrationError
from batchscore.output import layout
from batchscore.output.raw_scores import RowScores
from batchscore.output.summary import Quality
from batchscore.scores import calibration, review
from batchscore.scores.normalize import score_columns

log = logging.getLogger("batchscore")

CONTENT_FREE = "N/A"  # contextual calibration's content-free value of every template field
SHOWN = 5  # rows named in an error message
BATCH_MOVED_SHARE = 0.2  # batch calibration changing more answers than this share is warned about
PRIOR_SKEW = 2.0  # ...and a raw mean probability this many times above or below uniform (1/K)


QualityResult = Quality  # what calibration and review did: the run summary's quality part


def wanted(config) -> bool:
    """The job asks for any of the columns this module writes."""
    return (config.score.calibrate != "none" or config.score.confidence != "top" or config.output.review is not None
            or config.output.out_of_scope is not None or config.calibrate.truth_column is not None)


def column_names(config) -> list[str]:
    """The columns this module adds for `config` (after the score columns)."""
    if not wanted(config):
        return []
    return layout.quality_column_names(config.labels, config.input.choices_column is not None,
                                       config.score.calibrate != "none", True, config.output.review is not None,
                                       config.output.out_of_scope is not None)


def content_free_rows(config) -> int:
    """1 when the job scores a content-free input beside its rows (contextual calibration without
    `calibrate.from`): its request's row id is the input's row count, one past the last row."""
    return 1 if config.score.calibrate == "contextual" and config.calibrate.from_ is None else 0


def content_free_row(columns: list[str]) -> dict[str, str]:
    """The content-free input: CONTENT_FREE in every template field."""
    return {column: CONTENT_FREE for column in columns}


def split_content_free(scores: RowScores, errors: dict[int, str], num_rows: int,
                       config) -> tuple[RowScores, RowScores | None]:
    """(the input rows' scores, the content-free row's scores or None); the content-free row's
    entry leaves `errors` (changed in place). Raises CalibrationError when it was not scored."""
    if not content_free_rows(config):
        return scores, None
    problem = errors.pop(num_rows, None)
    if problem is None and num_rows in scores.unscored():
        problem = "no result from the engine"
    if problem is not None:
        raise CalibrationError(f"score.calibrate contextual: the content-free input ({CONTENT_FREE!r} in every "
                               f"template field) could not be scored: {problem}")

    def rows(start: int, count: int) -> RowScores:
        return RowScores(**{f.name: None if getattr(scores, f.name) is None else getattr(scores, f.name).slice(start, count)
                            for f in dataclasses.fields(scores)})

    return rows(0, num_rows), rows(num_rows, 1)


def check_calibration_source(config) -> None:
    """Fail before scoring when `calibrate.from` holds no values this job can reuse."""
    if config.calibrate.from_ is not None:
        previous_calibration(config)


def previous_calibration(config) -> dict:
    """The calibration recorded by `calibrate.from`'s completion marker; raises CalibrationError
    when there is none, or it is of another method, labels or normalization."""
    from batchscore.output.parts import marker_problem, recorded_summary

    path = config.calibrate.from_
    summary = recorded_summary(layout.OutputFiles(path))
    if summary is None:
        raise CalibrationError(f"calibrate.from: {path} {marker_problem(layout.OutputFiles(path))}; give the output of a "
                               "finished run of this batchscore")
    recorded = summary.get("calibration") or {}
    if not isinstance(recorded, dict):
        raise CalibrationError(f"calibrate.from: {path}'s completion marker: calibration is {type(recorded).__name__}, "
                               "not a mapping; give the output of a finished run")
    method = config.score.calibrate
    if recorded.get("method") != method or recorded.get("params") is None:
        raise CalibrationError(f"calibrate.from: {path} recorded no fitted values of score.calibrate {method} "
                               f"(it recorded {recorded.get('method') or 'no calibration'})")
    labels = list(config.labels) if config.labels else None
    if recorded.get("labels") != labels or recorded.get("normalize") != config.score.normalize:
        raise CalibrationError(f"calibrate.from: {path} was fitted for labels {recorded.get('labels')} with "
                               f"score.normalize {recorded.get('normalize')}; this job has {labels} with "
                               f"{config.score.normalize}")
    problem = calibration.params_problem(method, recorded["params"], len(labels) if labels else None)
    if problem:
        raise CalibrationError(f"calibrate.from: {path}'s completion marker: the {method} calibration cannot be "
                               f"applied: {problem}")
    if summary.get("model") not in (None, str(config.model)):
        log.warning("calibrate.from: %s was fitted with the model %s; this job uses %s", path, summary.get("model"),
                    config.model)
    return recorded


def add_quality_columns(config, columns: dict[str, pa.Array], ok: np.ndarray, kept: pa.Table, ids: pa.Array,
                        choices: list | None = None,
                        content_free: RowScores | None = None) -> tuple[dict[str, pa.Array], QualityResult]:
    """The output's score columns with the calibration and review columns added (and `label`,
    `choice`, `choice_index` following the calibrated probabilities), and what was done.

    columns: `score_columns`' output; ok: [N] scored rows; kept: the kept input columns (the
    truth column among them); choices: each row's options (per-row choices); content_free: the
    content-free input's raw totals (contextual calibration). Raises CalibrationError.
    """
    if not wanted(config):
        return columns, QualityResult()
    labels = list(config.labels) if config.labels else None
    method = config.score.calibrate
    p, num_options = _probabilities(columns, labels)
    log_p = calibration.log_probs(np.where(padding(num_options, p.shape[1]), np.nan, p))
    mass = _floats(columns[layout.LABEL_MASS])
    truth = _truth(config, kept, ok, ids, labels, choices)
    labeled = np.flatnonzero(ok & (truth >= 0))
    fitting = method in calibration.FITTED and config.calibrate.from_ is None
    fit_rows, eval_rows = split_labeled(labeled, config.calibrate, fitting)
    result = QualityResult()
    info = {"method": method, "labels": labels, "normalize": config.score.normalize, "params": None,
            "source": None, "truth_column": config.calibrate.truth_column, "labeled_rows": int(len(labeled)),
            "fit_rows": int(len(fit_rows)), "eval_rows": int(len(eval_rows)),
            "holdout_fraction": config.calibrate.holdout_fraction if fitting else None,
            "seed": config.calibrate.seed if fitting else None,
            "before": calibration.measures(log_p[eval_rows], truth[eval_rows]) if len(eval_rows) else None,
            "after": None}
    final_p = p
    if method != "none":
        params, info["source"] = _params(config, method, log_p, ok, truth, fit_rows, labels, content_free)
        info["params"] = params
        cal_p, info["after"] = calibrate_rows(method, params, log_p, ok, truth, eval_rows)
        worse = worse_warning(method, info["before"], info["after"])
        info["applied"] = worse is None
        if worse is None:
            final_p = cal_p
        columns = _with_calibrated(columns, cal_p, num_options, ok, labels, choices, follow=worse is None)
        if labels is not None:
            info["label_counts"] = {"raw": _counts(p, ok, labels), "calibrated": _counts(cal_p, ok, labels)}
        if method == "batch" and labels is not None:
            info["warnings"] = batch_warnings(p, cal_p, ok, labels)
        if worse is not None:
            info["warnings"] = [*info.get("warnings", []), worse]
    if method != "none" or config.calibrate.truth_column is not None:
        result.calibration = info
    conf = review.confidence(np.nan_to_num(final_p, nan=0.0), num_options, mass, config.score.confidence)
    columns[layout.CONFIDENCE] = pa.array(conf, mask=~ok, type=pa.float64())
    result.confidence_method = config.score.confidence
    if config.output.review is not None:
        columns[layout.NEEDS_REVIEW], result.review = review_column(config, final_p, num_options, mass, conf, ok, truth,
                                                                    eval_rows, f"calibrate.truth_column ({config.calibrate.truth_column!r})")
    if config.output.out_of_scope is not None:
        columns[layout.OUT_OF_SCOPE], result.out_of_scope = out_of_scope_column(config, mass, ok, eval_rows)
    return columns, result


# ---------------------------------------------------------------------------- pieces


def calibrate_rows(method: str, params: dict, log_p: np.ndarray, ok: np.ndarray, truth: np.ndarray,
                   eval_rows: np.ndarray) -> tuple[np.ndarray, dict | None]:
    """([N, K] calibrated probabilities, NaN in rows not `ok`; the measures after calibration on
    `eval_rows`, None without any)."""
    cal = np.full_like(log_p, -np.inf)
    cal[ok] = calibration.apply(method, log_p[ok], params)
    after = calibration.measures(cal[eval_rows], truth[eval_rows]) if len(eval_rows) else None
    return np.where(ok[:, None], np.exp(cal), np.nan), after


def worse_warning(method: str, before: dict | None, after: dict | None, what: str = "") -> str | None:
    """None when the calibration may be applied; else why not (logged): it made its own evaluation
    rows worse in log-loss (mean −log P(true label)). Such a calibration is not applied to the
    answers — label (choice), confidence and review stay on the raw probabilities — though its
    p_cal columns are still written, so it can be inspected. Without evaluation rows there is
    nothing to judge by, and the calibration is applied."""
    if not before or not after or before.get("nll") is None or after.get("nll") is None:
        return None
    if not after["nll"] > before["nll"]:
        return None
    where = f"{what}: " if what else ""
    text = (f"{where}score.calibrate {method} made its {before['rows']} evaluation rows worse in log-loss "
            f"(before {before['nll']:.4f}, after {after['nll']:.4f}; accuracy {before['accuracy']:.3f} → "
            f"{after['accuracy']:.3f}), so it is not applied: the answers stay on the raw probabilities "
            "(the calibrated ones are still written); label more rows, or try another method")
    log.warning("%s", text)
    return text


def batch_warnings(p: np.ndarray, cal: np.ndarray, ok: np.ndarray, options: list[str], what: str = "") -> list[str]:
    """What to warn about after `batch` calibration of [N, K] raw `p` into `cal` (each logged):
    it changed more than BATCH_MOVED_SHARE of the answers, or a raw mean probability is PRIOR_SKEW
    times off uniform — batch calibration assumes every answer about equally common in the batch."""
    rows = np.flatnonzero(ok)
    if not len(rows):
        return []
    where = f"{what}: " if what else ""
    advice = ("batch calibration assumes every answer is about equally common in the batch; if it is not, fit "
              "temperature, vector or platt on labelled rows instead")
    warnings = []
    moved = np.argmax(np.nan_to_num(p[rows], nan=-np.inf), axis=1) != np.argmax(np.nan_to_num(cal[rows], nan=-np.inf),
                                                                               axis=1)
    if moved.mean() > BATCH_MOVED_SHARE:
        warnings.append(f"{where}score.calibrate batch changed the answer of {int(moved.sum())} of {len(rows)} rows "
                        f"({moved.mean():.0%}); {advice}")
    prior, uniform = np.nanmean(p[rows], axis=0), 1.0 / p.shape[1]
    skewed = [f"{option} {value:.2f}" for option, value in zip(options, prior)
              if value > PRIOR_SKEW * uniform or value < uniform / PRIOR_SKEW]
    if skewed:
        warnings.append(f"{where}the mean raw probability is far from uniform ({uniform:.2f}) for {', '.join(skewed)}; "
                        f"{advice}")
    for warning in warnings:
        log.warning("%s", warning)
    return warnings


def _floats(array: pa.Array) -> np.ndarray:
    return np.asarray(array.to_numpy(zero_copy_only=False), dtype=np.float64)


def padding(num_options: np.ndarray, width: int) -> np.ndarray:
    return np.arange(width)[None, :] >= num_options[:, None]


def _probabilities(columns: dict[str, pa.Array], labels: list[str] | None) -> tuple[np.ndarray, np.ndarray]:
    """([N, K] each row's normalized probabilities, 0 for padding and NaN for error rows; [N] options per row)."""
    if labels is not None:
        p = np.column_stack([_floats(columns[layout.label_column(label)]) for label in labels])
        return p, np.full(len(p), len(labels))
    lists = columns[layout.P_CHOICES]
    lengths = np.asarray(pc.list_value_length(lists).fill_null(0), dtype=np.int64)
    n, width = len(lengths), max(int(lengths.max(initial=0)), 1)
    p = np.zeros((n, width))
    flat = np.asarray(pc.list_flatten(lists).to_numpy(zero_copy_only=False), dtype=np.float64)
    rows = np.repeat(np.arange(n), lengths)
    p[rows, np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)] = flat
    p[lengths == 0] = np.nan
    return p, lengths


def _truth(config, kept: pa.Table, ok: np.ndarray, ids: pa.Array, labels: list[str] | None,
           choices: list | None) -> np.ndarray:
    """[N] each row's true option index, -1 where unknown (no truth column, a null, an error row).
    Raises CalibrationError naming the rows whose true label is not one of their options."""
    truth = np.full(len(ok), -1, dtype=np.int64)
    name = config.calibrate.truth_column
    if name is None:
        return truth
    values = kept.column(name).to_pylist()
    index = {label.strip(): i for i, label in enumerate(labels)} if labels is not None else None
    bad = []
    for row in np.flatnonzero(ok):
        value = values[row]
        if value is None or (isinstance(value, float) and value != value):  # null or NaN: unlabeled (jobs.md)
            continue
        text = str(value).strip()
        lookup = index if index is not None else {option.strip(): i for i, option in enumerate(choices[row])}
        if text in lookup:
            truth[row] = lookup[text]
        else:
            bad.append(row)
    if bad:
        shown = ", ".join(f"row {ids[int(r)].as_py()!r}: {values[r]!r}" for r in bad[:SHOWN])
        more = f" and {len(bad) - SHOWN} more" if len(bad) > SHOWN else ""
        allowed = f"one of the labels {labels}" if labels is not None else "one of the row's own options"
        raise CalibrationError(f"calibrate.truth_column {name!r}: {len(bad)} row(s) hold a value that is not "
                               f"{allowed} ({shown}{more}); make them one, or null to leave a row unlabeled")
    return truth


def split_labeled(labeled: np.ndarray, settings, fitting: bool) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, evaluation rows) of the labeled rows: split by the seed when fitting now."""
    if not fitting:
        return np.array([], dtype=np.int64), labeled
    order = np.random.default_rng(settings.seed).permutation(labeled)
    count = int(round(settings.holdout_fraction * len(order)))
    if len(order) >= 2:
        count = min(max(count, 1), len(order) - 1)  # at least one row on each side
    return np.sort(order[:count]), np.sort(order[count:])


def _params(config, method: str, log_p: np.ndarray, ok: np.ndarray, truth: np.ndarray, fit_rows: np.ndarray,
            labels: list[str] | None, content_free: RowScores | None) -> tuple[dict, str]:
    """(the method's values, where they came from)."""
    if config.calibrate.from_ is not None:
        return previous_calibration(config)["params"], f"calibrate.from {config.calibrate.from_}"
    if method == "batch":
        return {"bias": calibration.batch_bias(log_p[ok]).tolist()}, f"the mean over {int(ok.sum())} scored rows"
    if method == "contextual":
        cf = score_columns(labels=labels, choices=None, scores=content_free, ok=np.ones(1, dtype=bool),
                           normalize=config.score.normalize)
        cf_log_p = calibration.log_probs(np.array([_floats(cf[layout.label_column(label)])[0] for label in labels]))
        return {"log_p_content_free": cf_log_p.tolist()}, f"the content-free input ({CONTENT_FREE!r} in every field)"
    if not len(fit_rows):
        labeled = int((ok & (truth >= 0)).sum())
        why = (f"calibrate.truth_column {config.calibrate.truth_column!r} is null in every scored row; label some rows"
               if not labeled else
               f"{labeled} scored row{'s are' if labeled > 1 else ' is'} labeled in {config.calibrate.truth_column!r}, "
               f"and calibrate.holdout_fraction {config.calibrate.holdout_fraction:g} keeps {'them' if labeled > 1 else 'it'}"
               " all for evaluation; label more rows (at least 2: one fits, one evaluates)")
        raise CalibrationError(f"score.calibrate {method}: no labeled row to fit on — {why}, or reuse fitted values "
                               "with calibrate.from")
    return (calibration.fit(method, log_p[fit_rows], truth[fit_rows]),
            f"fitted on {len(fit_rows)} labeled rows" + calibration.one_class_warning(truth[fit_rows], method))


def _with_calibrated(columns: dict[str, pa.Array], p: np.ndarray, num_options: np.ndarray, ok: np.ndarray,
                     labels: list[str] | None, choices: list | None, follow: bool = True) -> dict[str, pa.Array]:
    """The columns with the calibrated probabilities added and, when `follow`, the chosen label
    (or choice) following them (the first of equal probabilities, as `score_columns` chooses)."""
    columns = dict(columns)
    mask = ~ok
    best = np.argmax(np.where(padding(num_options, p.shape[1]), -np.inf, np.nan_to_num(p, nan=-np.inf)), axis=1)
    if labels is not None:
        for i, label in enumerate(labels):
            columns[layout.calibrated_column(label)] = pa.array(p[:, i], mask=mask, type=pa.float64())
        if follow:
            columns[layout.LABEL] = pa.array([labels[b] if good else None for b, good in zip(best, ok)],
                                             type=pa.string())
        return columns
    offsets = pa.array(np.concatenate(([0], np.cumsum(num_options))).astype(np.int32))
    flat = p[~padding(num_options, p.shape[1])]
    lists = pa.ListArray.from_arrays(offsets, pa.array(flat, type=pa.float64()))
    columns[layout.P_CAL_CHOICES] = pc.if_else(pa.array(ok), lists, pa.scalar(None, lists.type))
    if not follow:
        return columns
    columns[layout.CHOICE] = pa.array([choices[i][b] if good else None for i, (b, good) in enumerate(zip(best, ok))],
                                      type=pa.string())
    columns[layout.CHOICE_INDEX] = pa.array(best, mask=mask, type=pa.int64())
    return columns


def _counts(p: np.ndarray, ok: np.ndarray, labels: list[str]) -> dict[str, int]:
    best = np.argmax(np.nan_to_num(p[ok], nan=-np.inf), axis=1)
    return {label: int(np.sum(best == i)) for i, label in enumerate(labels)}


def review_column(config, p: np.ndarray, num_options: np.ndarray, mass: np.ndarray, conf: np.ndarray, ok: np.ndarray,
                  truth: np.ndarray, eval_rows: np.ndarray, truth_source: str, what: str = "") -> tuple[pa.Array, dict]:
    """(the needs_review column, the review summary); raises CalibrationError without labeled rows
    (naming `truth_source`, where the true labels were read). `what` names the question in the log
    lines (a questions job reviews each on its own: one line each, never the same line twice)."""
    settings = config.output.review
    if not len(eval_rows):
        raise CalibrationError(f"output.review: needs evaluation rows with a true label in {truth_source}; "
                               f"none of the {int(ok.sum())} scored rows has one")
    padded = np.where(padding(num_options, p.shape[1]), -np.inf, np.nan_to_num(p, nan=-np.inf))
    correct = np.argmax(padded[eval_rows], axis=1) == truth[eval_rows]

    def accepted(values: np.ndarray, chosen: review.Threshold) -> np.ndarray:
        return ok & (values >= chosen.threshold) if chosen.threshold is not None else np.zeros(len(ok), dtype=bool)

    chosen = review.choose_threshold(conf[eval_rows], correct, settings.max_error, settings.confidence)
    accept = accepted(conf, chosen)
    by_definition = {}
    for name in review.CONFIDENCE_METHODS:  # each definition at its own threshold, for the same budget
        values = review.confidence(np.nan_to_num(p, nan=0.0), num_options, mass, name)
        other = review.choose_threshold(values[eval_rows], correct, settings.max_error, settings.confidence)
        by_definition[name] = {"threshold": other.threshold, "coverage": other.coverage,
                               "accepted_rows": int(accepted(values, other).sum())}
    summary = {"max_error": settings.max_error, "confidence": settings.confidence,
               "confidence_method": config.score.confidence, **chosen.to_dict(),
               "accepted_rows": int(accept.sum()), "review_rows": int((ok & ~accept).sum()),
               "by_confidence": by_definition}
    where = f"{what}: " if what else ""
    log.info("%sreview: threshold %s accepts %d of %d scored rows (coverage %.1f%% of %d evaluation rows)", where,
             "none" if chosen.threshold is None else f"{chosen.threshold:.4g}", summary["accepted_rows"],
             int(ok.sum()), 100 * chosen.coverage, chosen.rows)
    if chosen.reason:
        log.warning("%soutput.review found no threshold, so every row needs review: %s", where, chosen.reason)
    return pa.array(~accept, mask=~ok, type=pa.bool_()), summary


def out_of_scope_column(config, mass: np.ndarray, ok: np.ndarray, eval_rows: np.ndarray) -> tuple[pa.Array, dict]:
    """(the out_of_scope column, its summary)."""
    floor = config.output.out_of_scope.min_label_mass
    auto = floor == "auto"
    basis = eval_rows if len(eval_rows) else np.flatnonzero(ok)
    if auto:
        floor = review.label_mass_floor(mass[basis])
    below = ok & (mass < floor)
    summary = {"min_label_mass": None if np.isnan(floor) else float(floor), "auto": auto,
               "basis": ("evaluation rows" if len(eval_rows) else "scored rows") if auto else None,
               "rows": int(below.sum())}
    return pa.array(below, mask=~ok, type=pa.bool_()), summary
