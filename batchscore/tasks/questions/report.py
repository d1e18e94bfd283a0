"""The report of a questions job's output (`questions:` in the job, `<id>.…` columns per question).

One section per question, numbers first: how many records it answered and how many failed, the
answers' distribution, how sure the model was, the signs of a prompt the model did not follow
(label mass under one half: most of its probability went to tokens that are no answer; the top
token not an answer at all), the records routed to review or marked out of scope, and the
calibration the run summary recorded. Columns are found by name (tasks/questions/answers.py writes
them): a question is an `<id>` with `<id>.status`, `.error`, `.label_mass` and `.argmax_is_label`
(`columns.question_keys`). Answers follow calibration where the output has `<id>.p_cal.…` columns.
"""

from __future__ import annotations

import json

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from batchscore.output.summary import RunSummary
from batchscore.tasks.questions.columns import (ARGMAX_IS_LABEL, CHOICE, CONFIDENCE, ERROR, LABEL_MASS, NEEDS_REVIEW,
                                                NOT_ASKED, OUT_OF_SCOPE, P, P_CAL, P_YES, SCORE, STATUS,
                                                is_question_column, missing_question_columns, question_keys)
from batchscore.tasks.questions.columns import column as question_column
from batchscore.report.page import PLAIN_TEXT, document, escape, figure, img, num, pct, section, table

LOW_MASS = 0.5  # label mass under this: the model mostly answered something else
BINS = np.linspace(0.0, 1.0, 11)


@dataclass
class QuestionReport:
    """What one question's columns say."""

    key: str
    kind: str  # choice | yes/no | score
    records: int
    answered: int
    answers: dict[str, int]  # the answer (choice option, yes/no, most probable score level) -> records
    sureness: np.ndarray  # per answered record: confidence (choice, score) or P(yes) (yes/no)
    low_mass: int
    top_not_answer: int
    needs_review: int | None = None
    out_of_scope: int | None = None
    errors: dict[str, int] = field(default_factory=dict)  # this question's own error message -> records
    missing: list[str] = field(default_factory=list)  # columns every question has that this one lacks
    whole: int = 0  # records that failed as a whole (no question read): counted once, in the summary

    @property
    def failed(self) -> int:
        """Records whose read of this question failed (not those that failed as a whole)."""
        return self.records - self.answered - self.whole


def read_questions(table, raw: Sequence[str] = ()) -> list[QuestionReport]:
    """Each question's report from the output table. `raw`: the questions whose calibration was
    not applied (it made their evaluation records worse): their answers are read from the raw
    probabilities, not their `<id>.p_cal.…` columns."""
    keys = question_keys(table.column_names)
    names = {n for n in table.column_names if not any(is_question_column(n, key, P_CAL) for key in raw)}
    wanted = [n for n in table.column_names if n == "error" or any(is_question_column(n, key) for key in keys)]
    values = {name: table.column(name).to_pylist() for name in wanted}  # not the kept input columns
    reports = []
    for key in keys:
        missing = missing_question_columns(table.column_names, key)
        for name in missing:  # read as null: the question is reported with what it has, and what it lacks said
            values[name] = [None] * table.num_rows
        asked = [s != NOT_ASKED for s in values[question_column(key, STATUS)]]  # per-row questions: only its own records
        own = values if all(asked) else {name: [v for v, a in zip(column, asked) if a] for name, column in
                                         values.items() if name == "error" or is_question_column(name, key)}
        reports.append(_question(key, names | set(missing), own, sum(asked), missing))
    return reports


def _question(key: str, names: set[str], values: dict[str, list], rows: int,
              missing: list[str] | None = None) -> QuestionReport:
    status = values[question_column(key, STATUS)]
    ok = np.array([s == "ok" for s in status], dtype=bool)
    mass = np.array([np.nan if v is None else v for v in values[question_column(key, LABEL_MASS)]], dtype=float)
    answers: dict[str, int] = {}
    if question_column(key, CHOICE) in names:  # follows calibration already
        kind, picked = "choice", values[question_column(key, CHOICE)]
    elif question_column(key, P_YES) in names:  # noul (options yes, no) or predicate (false, true)
        words = ("true", "false") if question_column(key, P_CAL, "true") in names else ("yes", "no")
        calibrated = question_column(key, P_CAL, words[0])
        column = calibrated if calibrated in names else question_column(key, P_YES)
        kind = "yes/no"
        picked = [None if p is None else (words[0] if p >= 0.5 else words[1]) for p in values[column]]
    elif not any((is_question_column(n, key, P) or is_question_column(n, key, P_CAL)) or n == question_column(key, SCORE) for n in names):
        # no answer column at all: a yes/no question (the only kind without `.p.` columns) lacking its p_yes
        missing = [*(missing or []), question_column(key, P_YES)]
        kind, picked = "yes/no", [None] * rows
    elif question_column(key, SCORE) not in names and not any(is_question_column(n, key, P) and n.rsplit(".", 1)[1].isdigit()
                                                 for n in names):
        missing = [*(missing or []), question_column(key, CHOICE)]  # a choice question (its `.p.<option>` columns) lacking it
        kind, picked = "choice", [None] * rows
    else:
        kind = "score"
        part = P_CAL if any(is_question_column(n, key, P_CAL) for n in names) else P
        levels = sorted((n for n in names if is_question_column(n, key, part) and n.rsplit(".", 1)[1].isdigit()),
                        key=lambda n: int(n.rsplit(".", 1)[1]))
        p = np.array([[np.nan if v is None else v for v in values[n]] for n in levels], dtype=float).T
        picked = [None if not len(row) or np.isnan(row).any() else str(int(np.argmax(row))) for row in
                  p.reshape(rows, len(levels))]
    for answer, good in zip(picked, ok):
        if good and answer is not None:
            answers[answer] = answers.get(answer, 0) + 1
    sure_column = question_column(key, P_YES) if kind == "yes/no" else question_column(key, CONFIDENCE)
    sureness = np.array([v for v, good in zip(values.get(sure_column, [None] * rows), ok) if good and v is not None],
                        dtype=float)
    errors: dict[str, int] = {}
    whole = 0
    for message, own, good in zip(values[question_column(key, ERROR)], status, ok):
        if own is None:  # the record failed as a whole (its questions' columns null): not this question's
            whole += 1
        elif not good:
            text = str(message)
            errors[text] = errors.get(text, 0) + 1
    counted = {flag: int(sum(1 for v, good in zip(values[question_column(key, flag)], ok) if good and v))
               for flag in (NEEDS_REVIEW, OUT_OF_SCOPE) if question_column(key, flag) in names}
    return QuestionReport(
        key=key, kind=kind, records=rows, answered=int(ok.sum()), answers=answers, sureness=sureness,
        low_mass=int(np.sum(ok & (mass < LOW_MASS))),
        top_not_answer=int(sum(1 for v, good in zip(values[question_column(key, ARGMAX_IS_LABEL)], ok) if good and v is False)),
        needs_review=counted.get(NEEDS_REVIEW), out_of_scope=counted.get(OUT_OF_SCOPE), errors=errors,
        missing=list(missing or []), whole=whole)


def render_questions(path: Path, output, summary: RunSummary | None, metrics_note: str) -> str:
    """The whole HTML document for a questions output (`output`: its table)."""
    from matplotlib import rc_context

    calibration = ((summary.quality.calibration if summary else None) or {}).get("questions") or {}
    questions = read_questions(output, [key for key, info in calibration.items()
                                        if isinstance(info, dict) and info.get("applied") is False])
    levels = _score_levels(output, summary)
    with rc_context(PLAIN_TEXT):
        sections = [_overview(output, questions, calibration, metrics_note)]
        reviews = ((summary.quality.review if summary else None) or {}).get("questions") or {}
        sections += [_question_section(q, calibration.get(q.key), levels.get(q.key), reviews.get(q.key))
                     for q in questions]
    return document(path, [("summary", "summary")] + [(f"q-{q.key}", q.key) for q in questions], sections)


def _overview(output, questions: list[QuestionReport], calibration: dict, metrics_note: str) -> str:
    statuses = output.column("status").to_pylist() if "status" in output.column_names else []
    failed = sum(1 for s in statuses if s != "ok")
    whole = whole_failures(output, questions)
    rows = []
    for q in questions:
        top = max(q.answers.items(), key=lambda item: item[1], default=None)
        rows.append((q.key, q.kind, f"{q.answered:,}", f"{q.failed:,}",
                     "–" if top is None else f"{top[0]} ({pct(top[1] / q.answered)})",
                     "–" if q.kind == "yes/no" or not len(q.sureness) else num(float(np.mean(q.sureness))),
                     f"{q.low_mass:,}", f"{q.top_not_answer:,}",
                     "–" if q.needs_review is None else f"{q.needs_review:,}",
                     "–" if q.out_of_scope is None else f"{q.out_of_scope:,}",
                     _ece(calibration.get(q.key))))
    head = table(["", ""], [("records", f"{output.num_rows:,}"),
                            ("records that failed as a whole (no question read)", f"{sum(whole.values()):,}"),
                            ("records with a failed question", f"{failed - sum(whole.values()):,}"),
                            ("questions", ", ".join(q.key for q in questions)), ("run summary", metrics_note)],
                 header=False)
    whole_errors = [table(["error of a record that failed as a whole", "records"],
                          sorted(((m, f"{n:,}") for m, n in whole.items()), key=lambda r: r[0])[:10])] if whole else []
    return section("summary", "Summary", head, *whole_errors, table(
        ["question", "kind", "answered", "failed", "most common answer", "mean confidence",
         f"label mass < {LOW_MASS}", "top token not an answer", "needs review", "out of scope",
         "ECE before → after calibration"], rows,
        note=f"Label mass under {LOW_MASS} or a top token that is no answer: the model mostly wanted to say "
             "something else — read the prompt and the question's instructions for these records. "
             "Needs review and out of scope: the output's own columns (output.review, output.out_of_scope)."))


def whole_failures(output, questions: list[QuestionReport]) -> dict[str, int]:
    """The records that failed as a whole — the record's error set and no question read (every
    question's status null) — by error message. Each is counted here once, under no question."""
    if "error" not in output.column_names or not questions:
        return {}
    statuses = [output.column(question_column(q.key, STATUS)).to_pylist() for q in questions
                if question_column(q.key, STATUS) in output.column_names]
    counts: dict[str, int] = {}
    for row, message in enumerate(output.column("error").to_pylist()):
        if message is not None and all(column[row] is None for column in statuses):
            counts[str(message)] = counts.get(str(message), 0) + 1
    return counts


def _score_levels(output, summary: RunSummary | None) -> dict[str, list[str]]:
    """Each score question's level names by 0-based index: from the run summary, else the output's
    Parquet metadata (tasks/questions/files.run_metadata)."""
    text = ((summary.questions.decisions if summary else None) or {}).get("score_levels")
    if text is None:
        text = ((output.schema.metadata or {}).get(b"batchscore.score_levels") or b"").decode() or None
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {}


def _ece(info: dict | None) -> str:
    if not info or not info.get("before"):
        return "–"
    after = info.get("after") or {}
    return f"{num(info['before'].get('ece'), 4)} → {num(after.get('ece'), 4)}"


def review_text(review: dict | None, needs_review: int | None) -> str | None:
    """What output.review did for one question, as the labels report says it: the threshold and
    what it accepts, or why there is none (every record then needs review)."""
    if not review:
        return None
    if review.get("reviewed") is False:
        return f"not reviewed: {review.get('reason') or 'no truth column'}"
    budget = f"error budget {pct(review['max_error'])}" if review.get("max_error") is not None else "the error budget"
    if review.get("threshold") is None:
        return (f"output.review found no threshold whose accepted records stay within the {budget}, so every "
                f"record needs review ({needs_review or 0:,})" + (f": {review['reason']}" if review.get("reason") else ""))
    return (f"output.review's threshold {review['threshold']:.4g} accepts {review.get('accepted_rows', 0):,} records "
            f"and sends {review.get('review_rows', needs_review or 0):,} to review ({budget}, chosen on "
            f"{review.get('rows', 0):,} evaluation records)")


def _question_section(q: QuestionReport, calibration: dict | None, levels: list[str] | None = None,
                      review: dict | None = None) -> str:
    answers = (sorted(q.answers, key=int) if q.kind == "score"  # levels in order, others most common first
               else sorted(q.answers, key=lambda a: (-q.answers[a], a)))

    def named(answer: str) -> str:  # a score answer is a 0-based level index
        return f"{answer} = {levels[int(answer)]}" if levels and int(answer) < len(levels) else answer

    rows = [(named(a) if q.kind == "score" else a, f"{q.answers[a]:,}",
             pct(q.answers[a] / q.answered if q.answered else 0.0)) for a in answers]
    read = q.records - q.whole  # the records this question was read for
    rows.append(("(failed)", f"{q.failed:,}", pct(q.failed / read if read else 0.0)))
    fig, (left, right) = figure(9, 2.6, 1, 2)
    left.bar(answers + ["(failed)"], [q.answers[a] for a in answers] + [q.failed],
             color=["#1f77b4"] * len(answers) + ["#bbbbbb"])
    left.set_ylabel("records")
    left.set_title("answers" + (" (most probable level)" if q.kind == "score" else ""), fontsize=9)
    right.hist(q.sureness, bins=BINS, color="#2ca02c")
    right.set_xlabel("P(yes)" if q.kind == "yes/no" else "confidence (TypeSafe)")
    right.set_title("P(yes) per answered record" if q.kind == "yes/no" else "confidence per answered record",
                    fontsize=9)
    note = (f"Score answers are 0-based level indexes: {question_column(q.key, SCORE)} is the expected index and "
            f"{question_column(q.key, P, 0)} the first level's probability." if q.kind == "score" else None)
    parts = [table(["answer", "records", "share"], rows, note=note), img(fig, f"answers and confidence of {q.key}")]
    if q.missing:
        parts.insert(0, table(["", ""], [("missing columns", ", ".join(q.missing) + " (read as empty: this output was "
                                          "changed or not written by batchscore)")], header=False))
    if q.errors:
        parts.append(table(["error", "records"], sorted(((m, f"{n:,}") for m, n in q.errors.items()),
                                                         key=lambda r: r[0])[:10]))
    said = review_text(review, q.needs_review)
    if said:
        parts.append(f'<p class="note">{escape(said)}</p>')
    if calibration and calibration.get("applied") is False:
        raw = ("the calibration made the held-out records worse in log-loss, so it was not applied: the answers "
               "above are the raw ones (the p_cal columns are written for inspection)")
        parts.append(f'<p class="note">{escape(raw)}</p>')
    if calibration and calibration.get("before"):
        measures = [m for m in ("ece", "brier", "nll", "accuracy") if m in calibration["before"]]
        after = calibration.get("after") or {}
        parts.append(table(["", *measures], [("before", *(num(calibration["before"][m], 4) for m in measures)),
                                              ("after", *(num(after.get(m), 4) for m in measures))],
                           note=f"calibration {calibration.get('source') or ''} on {calibration.get('eval_rows', 0):,}"
                                f" held-out records with true answers ({calibration.get('truth_column')})"))
    return section(f"q-{q.key}", f"{q.key} ({q.kind})", *parts)


__all__ = ["QuestionReport", "read_questions", "render_questions"]
