"""The questions task: typed questions asked of each record (a `questions:` job, per-row
questions in `input.questions_column`, or the System One / OpenAI Decisions lines of an
openai_batch file), one read per question, answers written per record."""

from __future__ import annotations

import logging

import numpy as np

from batchscore.errors import LabelError, ReportError
from batchscore.faults import fault_point
from batchscore.scores.job_checks import common_quality_problems
from batchscore.prepare.read import load_tokenizer, prompt_limits
from batchscore.prepare.source import PreparedJob
from batchscore.output.table import provenance
from batchscore.output.token_usage import job_usage
from batchscore.task import Task, TaskPage, register
from batchscore.tasks.questions import checks
from batchscore.tasks.questions.columns import question_keys
from batchscore.output.identity import identity_hash
from batchscore.tasks.questions.files import run_metadata, write_decision_output
from batchscore.tasks.questions.kept_reads import read_reads, write_reads
from batchscore.tasks.questions.quality import check_calibration_source
from batchscore.tasks.questions.reads import input_columns, is_decision_input, prepare_decisions
from batchscore.tasks.questions.report_table import is_answered_line, lines_left_out, lines_table, with_row_answers
from batchscore.tasks.questions.requests import check_question, parse_systemone

log = logging.getLogger("batchscore")


def _quality_problems(config, asked: list[str]) -> list[str]:
    return checks.quality_problems(config, asked) + common_quality_problems(config)


def _prepare(config, source, tokenize: bool, progress, sink=None) -> PreparedJob:
    """A questions job's reads (reads.py). The labels of a `questions:` job are checked once, up
    front: a label this model cannot read refuses the job (LabelError). With a `sink` (a StoreWriter)
    the reads stream into it a batch at a time (`input.requests` stays empty)."""
    tokenizer = max_length = vocab_size = None
    if tokenize:
        tokenizer = load_tokenizer(source.model_dir)
        max_length, vocab_size = prompt_limits(config, source.kind, source.model_dir, tokenizer)
        if config.questions:
            request = parse_systemone({"state": "", "questions": config.questions})
            problems = [p for q in request.questions if (p := check_question(tokenizer, request, q))]
            if problems:
                raise LabelError(f"questions: {'; '.join(problems)} (model {config.model})")
    prepared = prepare_decisions(config, source.files, tokenizer, max_length, vocab_size, progress, sink)
    log.info("read %d records: %d reads (%d not scorable)%s", prepared.num_records, prepared.num_rows,
             len(prepared.errors), " into the token store" if sink is not None else "")
    return PreparedJob(source, None, prepared)


def prepare_into(source, sink, progress=None) -> PreparedJob:
    """The job's reads tokenized into the token store's writer `sink` (store/build.py), a batch at
    a time: the same reads, options and errors as `_prepare`, no Request kept past its batch."""
    return _prepare(source.config, source, True, progress, sink)


def _assemble(job, scores, errors: dict[int, str], content_free, files, approx_keep):
    """Reads gathered back into records: one response body or table row per record."""
    fault_point("assemble")
    lines = job.source.output_format.response_lines
    failed, quality = write_decision_output(job.config, job.input.task_input, scores, errors, files,
                                            str(job.config.model), job_usage(job) if lines else None, provenance(job))
    if not lines:  # a table re-derives: its reads' raw scores beside it
        write_reads(files.reads, identity_hash(job.source.identity), scores, errors)
    fault_point("output")
    return failed, quality


def _rederive(job, files):
    """The output written again from the read scores kept beside it, with this job's
    post-processing (None: no reads of this job kept there)."""
    kept = read_reads(files.reads, identity_hash(job.source.identity), job.input.num_rows)
    if kept is None:
        return None
    scores, errors = kept
    return write_decision_output(job.config, job.input.task_input, scores, errors, files, str(job.config.model),
                                 None, provenance(job))


def _summary(prepared) -> dict:
    """The rows are reads: the run summary counts them and says how answers were read."""
    return {"reads": prepared.num_rows, "decisions": run_metadata(prepared.task_input)}


def _row_name(prepared, row: int) -> str:
    """A read is named by its record's id and the question it answers."""
    decisions = prepared.task_input
    for index, record in enumerate(decisions.records):
        if record.first_read <= row < record.first_read + record.num_reads:
            question = record.request.questions[row - record.first_read].key if record.request else "?"
            return f"read {row} (record {decisions.ids[index].as_py()!r}, question {question!r})"
    return f"read {row}"


def _owns_output(columns: list[str]) -> bool:
    return bool(question_keys(columns))  # `<id>.status` and the answer columns of a question


def _report(path, table, summary, note: str, *, previous=None, truth=None) -> str:
    from batchscore.tasks.questions.report import render_questions

    if previous is not None or truth is not None:
        raise ReportError("the report of a questions output has no drift or truth section yet: "
                          "leave out --previous and --truth (per-question calibration is read from the run summary)")
    return render_questions(path, table, summary, note)


def _record_reads(config, files) -> np.ndarray:
    """[records] the reads (store rows) each input record becomes, read from `files` without
    tokenizing (a serve batch's progress counts request lines, serve/progress.py)."""
    records = prepare_decisions(config, files).task_input.records
    return np.array([r.num_reads for r in records], dtype=np.int64)


QUESTIONS = register(Task(
    name="questions",
    claims=is_decision_input,
    job_problems=checks.job_problems,
    output_columns=checks.output_columns,
    quality_problems=_quality_problems,
    check_calibration_source=check_calibration_source,
    prepare=_prepare,
    assemble=_assemble,
    summary=_summary,
    row_name=_row_name,
    page=TaskPage(owns=_owns_output, render=_report, table=with_row_answers, owns_line=is_answered_line,
                  lines_table=lines_table, lines_left_out=lines_left_out),
    audit_by_sum=True,
    read_into=prepare_into,
    rederive=_rederive,
    input_columns=input_columns,
    record_reads=_record_reads,
))
