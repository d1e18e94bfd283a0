"""A questions output read back for its report page: decision batch lines and per-row answers
(`input.questions_column`'s JSON `answers` column) spread into the questions table layout, so
the page reads every questions output alike."""

from __future__ import annotations

import json

from batchscore.formats.openai_batch import REQUEST_ID, line_request_id
from batchscore.output import layout
from batchscore.tasks.questions.columns import (ARGMAX_IS_LABEL, CHOICE, CONFIDENCE, ERROR, EVERY_QUESTION, LABEL_MASS,
                                                NOT_ASKED, P, P_YES, SCORE, STATUS, by_option_text, column,
                                                is_question_column, dotted, key_of, question_keys, separator_of)
from batchscore.tasks.questions.files import ANSWERS


def answers_table(records: list[tuple[object, dict | None, str | None]], id_name: str = REQUEST_ID):
    """The questions table layout (`<id>.…` columns, answers.py) of answered decision
    records, so the questions page reads decision batch lines and per-row questions alike.
    records: (id, answers keyed by question id (System One) or a list with `name`s (OpenAI
    Decisions), the record's error or None). A question a record was not asked has status
    NOT_ASKED; one answered with {"error": …} is that question's error."""
    import pyarrow as pa

    columns: dict[str, list] = {}
    rows = len(records)

    def put(key: str, part: str, index: int, value, option: object = None) -> None:
        columns.setdefault(column(key, part, option), [None] * rows)[index] = value

    for index, (_, answers, _) in enumerate(records):
        for key, answer in _answers_by_key(answers).items():
            put(key, STATUS, index, layout.STATUS_OK)
            if not isinstance(answer, dict) or "error" in answer:
                put(key, STATUS, index, layout.STATUS_ERROR)
                put(key, ERROR, index, str(answer.get("error") if isinstance(answer, dict) else answer))
                continue
            kind = answer.get("type")
            if kind == "choice":
                put(key, CHOICE, index, answer.get("choice"))
            elif kind in ("noul", "predicate"):
                put(key, P_YES, index, answer.get("noul", answer.get("probability")))
            else:
                put(key, SCORE, index, answer.get("score"))
            for option, p in _probabilities(answer):
                put(key, P, index, p, option)
            put(key, CONFIDENCE, index, answer.get("confidence"))
            put(key, LABEL_MASS, index, answer.get("x_label_mass"))
            put(key, ARGMAX_IS_LABEL, index, answer.get("x_argmax_is_label"))
    keys = [key for name in columns if (key := key_of(name, STATUS)) is not None]  # in order of first appearance
    for key in keys:
        for part in EVERY_QUESTION:
            columns.setdefault(column(key, part), [None] * rows)
        asked = [key in _answers_by_key(answers) for _, answers, _ in records]
        # a record that failed whole (its error) leaves the question null, as in a questions table
        columns[column(key, STATUS)] = [status if was_asked else None if error else NOT_ASKED for status, was_asked,
                                        (_, _, error) in zip(columns[column(key, STATUS)], asked, records)]
    table = {id_name: [None if r[0] is None else str(r[0]) for r in records]}
    for key in keys:
        table.update((name, values) for name, values in columns.items() if is_question_column(name, key))
    failed = [error is not None or any(table[column(k, STATUS)][i] == layout.STATUS_ERROR for k in keys)
              for i, (_, _, error) in enumerate(records)]
    table[layout.STATUS] = [layout.STATUS_ERROR if f else layout.STATUS_OK for f in failed]
    table[layout.ERROR] = [error for _, _, error in records]
    return pa.table({name: pa.array(values) for name, values in table.items()})


def _answers_by_key(answers) -> dict[str, object]:
    if isinstance(answers, dict):
        return {str(k): v for k, v in answers.items()}
    if isinstance(answers, list):
        return {str(a.get("name", i)) if isinstance(a, dict) else str(i): a for i, a in enumerate(answers)}
    return {}


def _probabilities(answer: dict) -> list[tuple[str, float]]:
    """(option, probability) pairs: a System One map, or OpenAI's list of {value, probability}."""
    probs = answer.get("probabilities")
    if isinstance(probs, dict):
        return [(str(k), v) for k, v in probs.items()]
    if isinstance(probs, list):
        return [(str(p.get("value")), p.get("probability")) for p in probs if isinstance(p, dict)]
    return []


def answers_of(line: dict):
    """A decision line's answers (System One map or OpenAI Decisions list), else None."""
    response = line.get("response") or {}
    body = response.get("body") or {}
    answers = body.get("answers") if response.get("status_code") == 200 and isinstance(body, dict) else None
    return answers if isinstance(answers, (dict, list)) else None


def is_answered_line(line: dict) -> bool:
    return answers_of(line) is not None


def lines_table(lines: list[dict], failed: list[tuple[object, str]]):
    """Answered decision lines, and the batch's failed lines ((custom_id, error)), as the page's table."""
    return answers_table([(line_request_id(line), answers_of(line), None) for line in lines]
                         + [(custom_id, None, error) for custom_id, error in failed])


def lines_left_out(count: int) -> str:
    return (f"{count:,} decision line(s) with answered questions are not label rows and are left out "
            "of this page (their answers are in the output)")


def with_row_answers(table):
    """A table of per-row questions (`input.questions_column`: each row's answers as JSON in the
    `answers` column, and no fixed question columns) in the questions layout, and question columns
    joined by another `output.column_separator` named as inside batchscore (`<id>.<part>`); other
    tables as they are."""
    metadata = table.schema.metadata
    sep = separator_of(table.column_names, metadata)
    if sep != ".":
        table = table.rename_columns(list(dotted(table.column_names, sep).values()))
    table = table.rename_columns(by_option_text(table.column_names, metadata))  # output.column_names: slug
    names = table.column_names
    if ANSWERS not in names or question_keys(names) or layout.STATUS not in names:
        return table
    records = []
    for row_id, text, error in zip(table.column(names[0]).to_pylist(), table.column(ANSWERS).to_pylist(),
                                   table.column(layout.ERROR).to_pylist() if layout.ERROR in names
                                   else [None] * table.num_rows):
        if text is None:  # the record failed as a whole
            records.append((row_id, None, error or "failed"))
            continue
        try:
            answers = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            answers = None
        if not isinstance(answers, dict):
            return table  # not answers that batchscore wrote: leave the table to the labels reader's checks
        records.append((row_id, answers, None if answers else error))
    return answers_table(records, id_name=names[0])
