"""A decision job's output: reads gathered back into records, written once every part exists.

Each read's raw label totals (engines return nothing else) become its question's answer through
`tasks/questions/answers.py`; a record's answers become one OpenAI Batch output line (the System One or
OpenAI Decisions response body; chat/completions lines keep their completion shape) or one table
row (`<id>.…` columns per question). A record any of whose reads failed is an error line (status
400, naming line, request and question) in a batch file — never a truncated answer; in a table
its failed questions say so in `<id>.status` / `<id>.error`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pyarrow as pa

from batchscore.config import JobConfig
from batchscore.formats.lines import write_lines
from batchscore.formats import write_output
from batchscore.formats.openai_batch import completion_body, error_line, line_key, response_line
from batchscore.formats.registry import answers_in_lines
from batchscore.output import layout
from batchscore.tasks.questions.quality import add_question_quality, column_types
from batchscore.tasks.questions.answers import (CONFIDENCE_METHOD, QuestionAnswer, openai_body, read_answer,
                                         row_values, systemone_answer, systemone_body, table_column_types)
from batchscore.output.layout import OutputFiles
from batchscore.scores.quality import QualityResult
from batchscore.output.raw_scores import RowScores
from batchscore.row_errors import FAILED, RowError, no_result
from batchscore.output.table import with_metadata
from batchscore.tasks.questions.columns import QUESTION_LABELS_KEY, joined, option_slugs, slugged
from batchscore.tasks.questions.requests import API_SYSTEMONE, LAYOUT, WIDE_LAYOUT, parse_systemone
from batchscore.tasks.questions.records import DecisionInput, Record

ANSWERS = "answers"  # table jobs with input.questions_column: each row's System One answers, as JSON


def run_metadata(decisions: DecisionInput) -> dict[str, str]:
    """What the run summary and the Parquet schema record about how answers were read."""
    wide = any(q.layout == WIDE_LAYOUT for r in decisions.records if r.request for q in r.request.questions)
    data = {"layout": WIDE_LAYOUT if wide else LAYOUT, "confidence_method": CONFIDENCE_METHOD}
    levels = {}  # a score answer is a 0-based level index: which level each index names
    for record in decisions.records:
        for question in (record.request.questions if record.request else ()):
            if question.type == "score" and question.levels:
                levels.setdefault(str(question.key), list(question.levels))
    if levels:
        data["score_levels"] = json.dumps(levels)
    return data


def record_answers(record: Record, logp: list, errors: dict[int, str], tops: list | None = None
                   ) -> list[QuestionAnswer | str]:
    """Each question's answer, or its read's error message, in question order. `tops`: each read's
    top vocabulary log-probability (argmax_is_label; not for two-letter labels, whose first token
    alone is not a label)."""
    answers: list[QuestionAnswer | str] = []
    for k, question in enumerate(record.request.questions):
        read = record.first_read + k
        if read in errors:
            answers.append(errors[read])
            continue
        try:
            top = tops[read] if tops is not None and question.layout != WIDE_LAYOUT else None
            answers.append(read_answer(question, logp[read], None if top is None or top != top else top))
        except (ValueError, TypeError) as exc:
            answers.append(RowError(FAILED, f"not scored: {exc}"))
    return answers


def write_decision_output(config: JobConfig, decisions: DecisionInput, scores: RowScores, errors: dict[int, str],
                          files: OutputFiles, model: str, usage: dict[int, tuple[int, int]] | None = None,
                          provenance: dict[str, str] | None = None) -> tuple[dict[int, str], QualityResult]:
    """Write the output of a decision job (and, for a batch file, its error file) atomically.
    Returns (record -> error for the records that are errors (the run's failed rows), what
    calibration and review did (tasks/questions/quality.py)). `provenance`: what a table's schema
    records about the run (output/table.provenance)."""
    logp = scores.logp.to_pylist()
    tops = scores.top_logp.to_pylist() if scores.top_logp is not None else None
    if answers_in_lines(config):  # one Batch API line per record
        return _write_batch(decisions, logp, tops, errors, files, model, list(config.labels),
                            usage if usage is not None else {}), QualityResult()  # usage: read -> its prompt's (tokens, cached tokens)
    return _write_table(config, decisions, logp, tops, errors, files, provenance or {})


def _write_batch(decisions: DecisionInput, logp: list, tops: list | None, errors: dict[int, str], files: OutputFiles,
                 model: str, labels: list[str], usage: dict[int, tuple[int, int]]) -> dict[int, str]:
    created = int(time.time())
    ids = decisions.ids.to_pylist()
    replies = decisions.kept.column("reply").to_pylist() if "reply" in decisions.kept.column_names else [None] * len(ids)
    ok_lines, failed_lines, failed = [], [], {}
    for index, record in enumerate(decisions.records):
        request_id = None if ids[index] is None else str(ids[index])
        key = line_key(index, request_id)
        body, problem = _record_body(record, logp, tops, errors, decisions.read_tokens, model, key,
                                     created, labels, usage, json.loads(replies[index]) if replies[index] else None)
        if problem is not None:
            failed[index] = problem
            failed_lines.append(error_line(key, request_id, problem))
            continue
        ok_lines.append(response_line(key, request_id, body))
    write_lines(files.errors, failed_lines)
    write_lines(files.output, ok_lines)
    return failed


def _record_body(record: Record, logp: list, tops: list | None, errors: dict[int, str], read_tokens: dict[int, int], model: str,
                 key: str, created: int, labels: list[str], usage: dict[int, tuple[int, int]] | None = None,
                 reply: dict | None = None) -> tuple[dict | None, str | None]:
    """(the response body, None) or (None, why the record failed). `usage`: read -> its prompt's
    (tokens, cached tokens); `reply`: what a chat/completions line asks its answer to show."""
    usage = usage if usage is not None else {}
    if record.error is not None:
        return None, record.error
    if record.request is None:  # a chat/completions line: one read over the job's labels
        read = record.first_read
        if read in errors:
            return None, errors[read]
        totals = np.asarray(logp[read], dtype=np.float64) if logp[read] is not None else None
        if totals is None or not np.isfinite(totals).any():
            return None, no_result()
        top = totals.max()
        weights = np.exp(totals - top)
        probs = weights / weights.sum()
        mass = float(np.exp(totals).sum())
        return completion_body(key, created, model, labels[int(np.argmax(probs))],
                           dict(zip(labels, map(float, probs))), mass,
                           completions=str(record.url or "").endswith("/v1/completions"), usage=usage.get(read),
                           reply=reply), None
    answers = record_answers(record, logp, errors, tops)
    problems = [a for a in answers if not isinstance(a, QuestionAnswer)]
    if problems:
        return None, problems[0]
    reads = range(record.first_read, record.first_read + record.num_reads)
    tokens = sum(read_tokens.get(r, 0) for r in reads)
    cached = sum(usage.get(r, (0, 0))[1] for r in reads)  # the state each question's read shares
    if record.kind == API_SYSTEMONE:
        return systemone_body(record.request, answers, model=record.request.model or model,
                              input_tokens=tokens, output_tokens=len(answers)), None
    return openai_body(record.request, answers, model=record.request.model or model,
                       input_tokens=tokens, output_tokens=len(answers), cached_tokens=cached), None


def _write_table(config: JobConfig, decisions: DecisionInput, logp: list, tops: list | None, errors: dict[int, str],
                 files: OutputFiles, provenance: dict[str, str]) -> tuple[dict[int, str], QualityResult]:
    """One row per record: id, kept columns, each top-level question's columns, their calibration
    and review columns, the per-row answers (with input.questions_column), then the record's status
    and error."""
    # the job's questions name the columns, whatever the rows hold (every row may have failed)
    fixed = parse_systemone({"state": "", "questions": config.questions}).questions if config.questions else ()
    kinds = table_column_types(fixed)
    values: dict[str, list] = {name: [] for name in kinds}
    answers_json: list[str | None] = []
    fixed_answers: list[list | None] = []  # per record, its answers to the job's questions
    status, error, failed = [], [], {}
    for index, record in enumerate(decisions.records):
        if record.request is None:
            message = record.error or errors.get(record.first_read, "not scored")
            failed[index] = message
            for name in values:
                values[name].append(None)
            answers_json.append(None)
            fixed_answers.append(None)
            status.append(layout.STATUS_ERROR)
            error.append(message)
            continue
        answers = record_answers(record, logp, errors, tops)
        by_key = dict(zip((q.key for q in record.request.questions), answers))
        fixed_answers.append([by_key[q.key] for q in fixed])
        row = row_values(fixed, fixed_answers[-1])
        for name in values:
            values[name].append(row.get(name))
        answers_json.append(json.dumps(_answers_map(record, answers), ensure_ascii=False))
        problems = [a for a in answers if not isinstance(a, QuestionAnswer)]
        if problems:
            failed[index] = problems[0]
        status.append(layout.STATUS_ERROR if problems else layout.STATUS_OK)
        error.append(problems[0] if problems else None)
    id_name = config.input.id_column or layout.DEFAULT_ID
    columns: dict[str, pa.Array] = {id_name: decisions.ids}
    for name in decisions.kept.column_names:
        if name != id_name:
            columns[name] = decisions.kept.column(name)
    judged, follow, quality = add_question_quality(config, fixed, fixed_answers, decisions.kept, decisions.ids)
    values.update(follow)  # <id>.choice follows the calibrated probabilities
    values.update(judged)
    kinds = {**kinds, **column_types(config, fixed)}
    arrow_types = {"float64": pa.float64(), "bool": pa.bool_(), "string": pa.string()}
    for name, kind in kinds.items():
        columns[name] = pa.array(values[name], type=arrow_types[kind])
    if config.input.questions_column:
        columns[ANSWERS] = pa.array(answers_json, type=pa.string())
    columns[layout.STATUS] = pa.array(status, type=pa.string())
    columns[layout.ERROR] = pa.array(error, type=pa.string())
    sep = config.output.column_separator  # `<id>.<part>` inside batchscore; joined by the job's separator here
    slugs = option_slugs(fixed) if config.output.column_names == "slug" else {}  # options named by their slugs
    keys = [str(q.key) for q in fixed]
    table = pa.table({joined(slugged(name, slugs), keys, sep): values for name, values in columns.items()})
    metadata = {f"batchscore.{k}": v for k, v in run_metadata(decisions).items()}
    if slugs:
        metadata[QUESTION_LABELS_KEY] = json.dumps({k: {s: o for o, s in by.items()} for k, by in slugs.items()},
                                                   ensure_ascii=False)
    table = with_metadata(table, {**metadata, **provenance, layout.SEPARATOR_KEY: sep})
    write_output(table, files.output, config.output_format, id_name=config.input.id_column or layout.DEFAULT_ID,
                 labels=list(config.labels), model=str(config.model), error_path=files.errors)
    return failed, quality


def _answers_map(record: Record, answers: list) -> dict[str, Any]:
    """A record's answers as System One's `answers` map (errors as {"error": message})."""
    return {str(q.key): (systemone_answer(q, a) if isinstance(a, QuestionAnswer) else {"error": str(a)})
            for q, a in zip(record.request.questions, answers)}
