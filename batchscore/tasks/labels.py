"""The labels task: each row scored over the job's labels (or its own choices), one output row per
input row with a probability per label (`output/layout.py` names its columns)."""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from batchscore.config import JobConfig
from batchscore.errors import LabelError
from batchscore.faults import fault_point
from batchscore.formats import write_output
from batchscore.formats.registry import answers_in_lines, requests_in_lines
from batchscore.scores.job_checks import common_quality_problems
from batchscore.output.layout import DEFAULT_ID, GREEDY_CHOICES, TOP_COLUMNS, calibrated_column, label_column, output_columns
from batchscore.output.token_usage import job_usage
from batchscore.output.table import ok_rows, provenance, scores_table, with_metadata
from batchscore.plan.types import Request
from batchscore.prepare.read import load_tokenizer, make_renderer, prepare_input, prompt_limits
from batchscore.prepare.source import JobSource, PreparedJob
from batchscore.prepare.options import (OptionEncoder, RowOptionSource, choices_for_output, label_problems,
                                        max_length_name)
from batchscore.prepare.prompts import PromptRenderer, compile_template
from batchscore.scores import quality
from batchscore.scores.calibration import FITTED, PER_ROW_CHOICES
from batchscore.scores.normalize import greedy_column, score_columns, top_columns
from batchscore.scores.quality import (add_quality_columns, check_calibration_source, content_free_row,
                                       content_free_rows)
from batchscore.task import InputColumns, Task, register

log = logging.getLogger("batchscore")


def job_problems(config: JobConfig) -> list[str]:
    """The labels (checked against score.normalize); an openai_batch input without labels may
    still hold decision lines, which the questions task claims once its lines are read."""
    if not requests_in_lines(config) or config.labels:
        return label_problems(config.labels, config.input.choices_column, config.score.normalize)
    return []


def job_output_columns(config: JobConfig) -> tuple[set[str], list[str]]:
    """The label, top-token and quality columns a labels job writes (names can clash only
    through the labels, which job_problems checks)."""
    generated = set(output_columns(config.labels, config.input.choices_column is not None, config.output.logprobs))
    generated |= set(TOP_COLUMNS) if config.output.top_token else set()
    generated |= {GREEDY_CHOICES} if config.output.greedy else set()
    generated |= set(quality.column_names(config))
    return generated, []


# what an OpenAI Batch answer can carry: calibrated probabilities (`calibrated_scores`), the label following them
BATCH_ANSWER_KEYS = ("score.calibrate", "calibrate.from")


def quality_problems(config: JobConfig, asked: list[str]) -> list[str]:
    """Calibration and review of labels or per-row choices: the methods that apply, the truth
    column they learn from, and no calibrated column named as a raw one."""
    problems: list[str] = []
    method, cal = config.score.calibrate, config.calibrate
    review = config.output.review
    if cal.truth_columns:
        problems.append("calibrate.truth_columns: for questions jobs (one truth column per question id); use "
                        "calibrate.truth_column with labels or input.choices_column")
    table_only = [key for key in asked if key not in BATCH_ANSWER_KEYS]
    if table_only and answers_in_lines(config):
        problems.append(f"{table_only[0]}: the review and truth columns are written to parquet or jsonl outputs, not "
                        "output.format openai_batch (a batch answer takes score.calibrate: batch, or a fitted method "
                        "with calibrate.from; fit it on labelled rows in a table job, docs/operations.md)")
    choices = config.input.choices_column is not None
    if choices and method not in PER_ROW_CHOICES:
        problems.append(f"score.calibrate {method}: applies to fixed labels, not to per-row choices "
                        f"(input.choices_column); use one of {', '.join(PER_ROW_CHOICES)}")
    if method == "platt" and not choices and len(config.labels) != 2:
        problems.append(f"score.calibrate platt: binary labels only (two labels); got {len(config.labels)} — "
                        "use temperature or vector")
    inp = config.input
    if method == "contextual" and (inp.token_ids_column or inp.synthetic or requests_in_lines(config)):
        problems.append("score.calibrate contextual: needs prompt.template (the content-free input is the template "
                        "with 'N/A' in every field); use batch for pre-tokenized or openai_batch inputs")
    if method in FITTED and cal.truth_column is None and cal.from_ is None:
        problems.append(f"score.calibrate {method}: fitted on labeled rows — set calibrate.truth_column (an input "
                        "column of true labels; null where unknown), or calibrate.from (a previous output's fitted values)")
    if review is not None and cal.truth_column is None:
        problems.append("output.review: needs calibrate.truth_column (true labels for some rows: the threshold is "
                        "chosen where the accepted rows' error is known)")
    problems.extend(common_quality_problems(config))
    truth = cal.truth_column
    if truth is not None:
        clash = set(output_columns(config.labels, choices, config.output.logprobs)) | set(quality.column_names(config))
        if truth in clash:
            problems.append(f"calibrate.truth_column: {truth!r} is also a column batchscore writes; rename the input column")
    if method != "none" and not choices:
        raw = {label_column(label) for label in config.labels}
        same = [calibrated_column(label) for label in config.labels if calibrated_column(label) in raw]
        if same:
            problems.append(f"labels: {same[0]!r} would be both a label's p_ column and a calibrated p_cal_ column; "
                            "rename the label")
    return problems


def input_columns(config: JobConfig) -> InputColumns | None:
    """The columns a row's request is made from, as `prepare_input` reads them: the id, the token
    ids (read per JSON line as JSON text) or else the template's fields, and the row's choices.
    None for an openai_batch file, whose lines are the requests."""
    inp = config.input
    if requests_in_lines(config) or not (inp.token_ids_column or config.prompt.template):
        return None
    columns = [inp.id_column] if inp.id_column else []
    columns += [inp.token_ids_column] if inp.token_ids_column else \
        compile_template(config.prompt.template, config.prompt.engine).columns
    columns += [inp.choices_column] if inp.choices_column else []
    return InputColumns(tuple(dict.fromkeys(columns)), (inp.token_ids_column,) if inp.token_ids_column else ())


def prepare(config: JobConfig, source: JobSource, tokenize: bool,
            progress: Callable[[int], None] | None) -> PreparedJob:
    """Read (and unless `tokenize` is False, render and tokenize) every row over the labels."""
    if not config.labels and not config.input.choices_column:  # an openai_batch file without decision lines
        raise LabelError("labels: this openai_batch file has no /v1/systemone or /v1/decisions lines, so every "
                         "request is scored over the job's labels; give at least two, e.g. labels: [Yes, No]")
    label_ids, renderer, max_length, vocab_size, options = None, None, None, None, None
    if tokenize:
        renderer, options, max_length, vocab_size = tokenizing(config, source)
    prepared = prepare_input(config, source.files, renderer, max_length=max_length, vocab_size=vocab_size,
                             tokenize=tokenize, progress=progress, options=options)
    content_free = None
    if options is not None and content_free_rows(config):
        content_free = content_free_request(renderer, options, prepared.num_rows)
    if options is not None:
        options.encoder.boundary.log_once(len(prepared.requests))
        every = prepared.requests + ([content_free] if content_free is not None else [])
        label_ids = options.single_token_ids(every)
        if label_ids is not None:  # one-token labels everywhere: today's one-position path
            for request in every:
                request.options = None
        refuse_speculative_per_row(config, label_ids, len(prepared.requests))
    log.info("read %d rows (%d not scorable)", prepared.num_rows, len(prepared.errors))
    return PreparedJob(source, label_ids, prepared, content_free)


def tokenizing(config: JobConfig, source: JobSource) -> tuple[PromptRenderer, RowOptionSource, int | None, int]:
    """What reading a labels job with tokens needs: (the prompt renderer, each row's options as
    token ids, the longest prompt scored, the vocabulary size), from the job's model folder."""
    tokenizer = load_tokenizer(source.model_dir)
    max_length, vocab_size = prompt_limits(config, source.kind, source.model_dir, tokenizer)
    renderer = make_renderer(config, tokenizer)
    options = RowOptionSource(config.labels, config.input.choices_column, OptionEncoder(tokenizer), max_length,
                              max_length_name(config.engine.max_length, max_length), vocab_size)
    return renderer, options, max_length, vocab_size


def content_free_request(renderer: PromptRenderer, options: RowOptionSource, row_id: int) -> Request:
    """Contextual calibration's content-free input: the template with 'N/A' in every field, one
    more request of the plan (a leaf beside the rows that share its prefix). Its row id is one
    past the input's rows, so no output row is ever it; assembly divides its probabilities out."""
    prompt = renderer.prompt(content_free_row(renderer.columns))
    tokens = renderer.encode([prompt])[0]
    chat = renderer.chat if prompt.chat is None else prompt.chat
    piece = renderer.last_piece(prompt) if renderer.in_pieces(prompt) else None
    [(row_options, problem)] = options.batch([tokens], [prompt.text], [None], ["the content-free input"], [chat], [piece])
    if problem:
        raise LabelError(f"score.calibrate contextual: {problem}")
    return Request(row_id, tokens, row_options)


def assemble(job: PreparedJob, scores, errors: dict[int, str], content_free, files, approx_keep: float | None):
    """One output row per input row: the normalized scores, calibration and review columns,
    written in the output's format."""
    config, prepared = job.config, job.input
    id_name = config.input.id_column or DEFAULT_ID
    ok = ok_rows(prepared.num_rows, errors)
    firsts = first_tokens_reader(job)(0, prepared.num_rows) if config.output.top_token else None
    columns = row_columns(job, scores, ok, 0, firsts)
    columns, result = add_quality_columns(config, columns, ok, prepared.kept, prepared.ids,
                                          choices_for_output(prepared.choices, ok), content_free)
    table = scores_table(prepared.ids, id_name, prepared.kept, columns, errors, approx_keep=approx_keep)
    table = with_metadata(table, provenance(job))  # model, job hash, version, run time: not the data
    if table.num_rows != prepared.num_rows:  # the invariant: every input row exactly once
        raise RuntimeError(f"the output would hold {table.num_rows} rows for {prepared.num_rows} input rows")
    fault_point("assemble")
    write_output(table, files.output, config.output_format, id_name=id_name, labels=config.labels,
                 model=str(config.model), error_path=files.errors, row_errors=errors,
                 usage=job_usage(job) if answers_in_lines(config) else None)
    fault_point("output")
    return errors, result


def read_into(source: JobSource, writer, progress=None) -> PreparedJob:
    """`prepare` with a token store's writer (store/tokens.StoreWriter) as prepare_input's sink:
    the same rows, errors, options, content-free row and one-token label ids, no request list."""
    config = source.config
    if not config.labels and not config.input.choices_column:
        return source.task.prepare(config, source, True, progress)  # the reader's own refusal
    renderer, options, max_length, vocab_size = tokenizing(config, source)
    prepared = prepare_input(config, source.files, renderer, max_length=max_length, vocab_size=vocab_size,
                             progress=progress, options=options, sink=writer)
    content_free = None
    if content_free_rows(config):
        content_free = content_free_request(renderer, options, prepared.num_rows)
        writer.add_requests([content_free])
    options.encoder.boundary.log_once(writer.num_rows)
    label_ids = writer.shared_single_token_ids() if options.labels is not None else None
    if label_ids is not None and content_free is not None:
        content_free.options = None
    refuse_speculative_per_row(config, label_ids, writer.num_rows)
    log.info("read %d rows (%d not scorable) into the token store", prepared.num_rows, len(prepared.errors))
    return PreparedJob(source, label_ids, prepared, content_free)


def refuse_speculative_per_row(config: JobConfig, label_ids: list[int] | None, rows: int) -> None:
    """Speculative prefill scores one-token labels shared by every row: with rows read and no such
    labels (`label_ids` None), the job is refused (LabelError). The one rule every reading (in
    this process, into the token store, as Ray segments) applies."""
    if label_ids is None and config.engine.speculative is not None and rows:
        raise LabelError("engine.speculative: speculative prefill scores one-token labels shared by every row; "
                         "these labels are scored per row (a multi-token label, or one whose tokens depend on "
                         "the prompt's end) — drop engine.speculative or use one-token labels")


def read_segment(config: JobConfig, source, files: list, only: dict, writer) -> int:
    """Read one segment of the input (`only`: file -> None or its row groups, read within `files`,
    the whole input) into a segment store's `writer`, row ids from 0, as `read_into` reads the
    whole input (store/segments.py, a Ray task). `source`: its model folder and engine kind.
    Returns the segment's input rows."""
    renderer, options, max_length, vocab_size = tokenizing(config, source)
    prepared = prepare_input(config, files, renderer, max_length=max_length, vocab_size=vocab_size,
                             options=options, sink=writer, only=only)
    writer.add_errors(sorted(prepared.errors.items()))
    return prepared.num_rows


def close_segments(config: JobConfig, writer) -> dict:
    """What the store joined from segments records beside its rows (its manifest's extra keys),
    after the checks a reading of the whole input makes."""
    label_ids = writer.shared_single_token_ids() if config.labels else None
    refuse_speculative_per_row(config, label_ids, writer.num_rows)
    return {"label_ids": label_ids, "content_free": False}


def row_columns(job: PreparedJob, scores, ok, start: int, firsts) -> dict:
    """The columns rows [start, start + len(ok)) need only their own results for: the normalized
    scores (each row's choices named), `output.top_token`'s (firsts: each row's options' first
    token ids) and `output.greedy`'s. The whole-table assembly and the windowed one
    (run/assemble.py) both build them here."""
    config, prepared = job.config, job.input
    choices = None if prepared.choices is None else prepared.choices.slice(start, len(ok))
    columns = score_columns(labels=config.labels or None, choices=choices_for_output(choices, ok),
                            scores=scores, ok=ok, normalize=config.score.normalize, logprobs=config.output.logprobs)
    if config.output.top_token:
        columns.update(top_columns(scores, ok, firsts, load_tokenizer(job.model_dir).decode))
    if config.output.greedy:
        columns[GREEDY_CHOICES] = greedy_column(scores, ok)
    return columns


def window_columns(job: PreparedJob) -> Callable[..., dict]:
    """The windowed assembly's columns of rows [start, end) (run/assemble.py): `row_columns`, the
    options' first tokens read from the token store when `output.top_token` asks for them."""
    firsts = first_tokens_reader(job) if job.config.output.top_token else None
    return lambda scores, ok, start, end: row_columns(job, scores, ok, start, firsts(start, end) if firsts else None)


def first_tokens_reader(job: PreparedJob) -> Callable[[int, int], list[set[int] | None]]:
    """rows [start, end) -> each row's options' first token ids (None: a row not tokenized):
    `output.top_token`'s `argmax_is_label`, read from the job's token store (no request per row);
    without one (a shard set's merge that finds no store of the set: it reads no prompts), from the
    job's requests, which are then none (each row None)."""
    tokens = job.tokens
    if tokens is None:
        every = _request_first_tokens(job)
        return lambda start, end: every[start:end]
    label_ids = job.label_ids if job.label_ids is not None else tokens.label_ids
    shared = set(label_ids) if label_ids is not None else None
    num_rows = job.input.num_rows
    row_ids = np.asarray(tokens.row_ids)
    inside = row_ids < num_rows  # not the content-free row
    position = np.full(num_rows, -1, dtype=np.int64)
    position[row_ids[inside]] = np.flatnonzero(inside)
    sets = np.asarray(tokens.option_set) if shared is None else None
    firsts = [] if shared is not None else [{int(o.option(i)[0]) for i in range(o.count)} for o in tokens.option_sets()]

    def read(start: int, end: int) -> list[set[int] | None]:
        at = position[start:end]
        if sets is None:
            return [shared if p >= 0 else None for p in at.tolist()]
        return [None if p < 0 else shared if sets[p] < 0 else firsts[sets[p]] for p in at.tolist()]

    return read


def _request_first_tokens(job: PreparedJob) -> list[set[int] | None]:
    """Each input row's options' first token ids (None for a row not tokenized)."""
    shared = set(job.label_ids) if job.label_ids is not None else None
    firsts: list[set[int] | None] = [None] * job.input.num_rows
    for request in job.input.requests:
        if request.row_id < job.input.num_rows:
            options = request.options
            firsts[request.row_id] = shared if options is None else {int(options.option(i)[0])
                                                                     for i in range(options.count)}
    return firsts


def _no_summary(prepared) -> dict:
    return {}


def row_name(prepared, row: int) -> str:
    return f"row {row} (id {prepared.ids[row].as_py()!r})"


def _claims_nothing(config, files) -> bool:
    return False


LABELS = register(Task(
    name="labels",
    claims=_claims_nothing,
    job_problems=job_problems,
    output_columns=job_output_columns,
    quality_problems=quality_problems,
    check_calibration_source=check_calibration_source,
    prepare=prepare,
    assemble=assemble,
    summary=_no_summary,
    row_name=row_name,
    top_token=True,
    incremental=True,
    read_into=read_into,
    window_columns=window_columns,
    read_segment=read_segment,
    close_segments=close_segments,
    default=True,
    input_columns=input_columns,
))
