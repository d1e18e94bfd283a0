"""Everything before scoring: find the input files, resolve engine and model, read the rows and
turn them into Requests (or per-row errors), and plan them.

`prepare_job` is the one way `run`, `plan`, `merge` and the benchmarks get from a JobConfig to
requests: input files are discovered once, `config.json` read once, the tokenizer loaded once.
Every input row gets a `row_id` (its position across all input files, in reading order); rows
that cannot be scored keep their row id and an error message, so nothing is lost.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from batchscore.config import CalibrateConfig, JobConfig
from batchscore.engines.factory import ResolvedEngine, kv_block_size, resolve_engine
from batchscore.engines.registry import get_kind
from batchscore.engines.shape import context_length, read_model_config
from batchscore.errors import BatchscoreError, InputError, OutputError, RowRenderError
from batchscore.output.write_paths import check_job_write_paths
from batchscore.output.identity import input_identities, model_identity, software_versions
from batchscore.output.layout import OutputFiles
from batchscore.scores.quality import content_free_rows
from batchscore.formats import discover_files, iter_batches, suffix_formats
from batchscore.io.readers import InputBatch, input_base
from batchscore.io.storage import as_path, is_url, use_storage_options
from batchscore.prepare.input_columns import assembly_columns, input_columns, line_reader
from batchscore.prepare.options import RowOptionSource, max_length_name
from batchscore.models import resolve_model
from batchscore.plan import Plan, PlanOptions, build_plan, prompt_problem
from batchscore.plan.validate import token_ids_problem
from batchscore.plan.types import Request
from batchscore.prepare.prompts import PromptRenderer, RequestRenderer
from batchscore.task import Task, get_task, task_for
from batchscore.prepare.rows import (PreparedInput, RowLocations, batch_ids, check_columns, check_unique_ids,
                                     concat_arrays, concat_tables, select_kept)

log = logging.getLogger("batchscore")


@dataclass
class JobSource:
    """Where a job's rows and model are, and what its output depends on (no rows read yet)."""

    config: JobConfig
    engine: ResolvedEngine  # kind, device, dtype, compile: resolved once, here
    files: list[tuple[Path, str]]  # (input file, format), discovered once
    model_dir: Path | None  # None when not needed (merge)
    identity: dict  # config, input, model, software, engine: see output/identity.py
    assembly_input: list = dataclasses.field(default_factory=list)  # the truth and kept columns, by content

    @property
    def kind(self) -> str:
        return self.engine.kind


@dataclass
class PreparedJob:
    """A job after reading (and tokenizing) its input: everything but the plan and the scores."""

    source: JobSource
    label_ids: list[int] | None  # one-token labels shared by every row; None: each request's own options
    input: PreparedInput
    content_free: Request | None = None  # score.calibrate contextual: scored beside the rows, never an output row
    task_name: str = "labels"  # the job's task (task.py), set by prepare_job

    @property
    def task(self) -> Task:
        return get_task(self.task_name)

    @property
    def config(self) -> JobConfig:
        return self.source.config

    @property
    def kind(self) -> str:
        return self.source.kind

    @property
    def files(self) -> list[tuple[Path, str]]:
        return self.source.files

    @property
    def model_dir(self) -> Path | None:
        return self.source.model_dir

    def plan(self) -> Plan:
        extra = [self.content_free] if self.content_free is not None else []
        return build_plan(self.input.requests + extra, plan_options(self.config, self.kind))


def locate_job(config: JobConfig, *, with_model: bool = True, for_output: bool = True) -> JobSource:
    """Check the output path, find the input files, resolve engine and model, fingerprint what the
    output depends on (cheap: no rows are read). With `for_output` False (planning only) the
    output is neither checked nor fingerprinted for. Raises InputError / OutputError / ModelError."""
    use_job_storage(config)
    if for_output:
        if not config.output.path:
            raise InputError("output.path is not set (set it in the job file or pass --output)")
        check_output_path(config.output.path)
    files = [] if config.input.synthetic else discover_files(config.input.path, config.input.format,
                                                             config.input.filter)
    if for_output:
        _check_output_outside_input(config, [f for f, _ in files])
        check_job_write_paths(config, [f for f, _ in files],  # the job file, output.error_path
                              read_suffixes=tuple(suffix_formats()))
    model_dir = Path(resolve_model(config.model, download=config.model_download)) if with_model else None
    engine = resolve_engine(config.engine, compile_decision=for_output,
                            model_config=read_model_config(model_dir) if model_dir else None)
    if not for_output:
        return JobSource(config, engine, files, model_dir, {})
    columns = input_columns(config, files)
    scoring_input, assembly_input = input_identities(files, None if columns is None else list(columns.scoring),
                                                     assembly_columns(config, files), line_reader(config, columns))
    identity = {
        "config": scoring_config(config),
        "input": scoring_input,
        "model_path": str(model_dir.resolve()) if model_dir else None,
        "model": model_identity(model_dir),
        "software": software_versions(engine.kind),
        "engine": engine.identity(),
    }
    return JobSource(config, engine, files, model_dir, identity, assembly_input)


def use_job_storage(config: JobConfig) -> None:
    """The job's input/output.storage_options, for the paths below its input and output."""
    use_storage_options((config.input.path, config.input.storage_options),
                        (config.output.path, config.output.storage_options),
                        (OutputFiles.for_job(config).errors, config.output.storage_options))


def scoring_config(config: JobConfig) -> dict:
    """The job keys the output's raw scores depend on: not where the output goes or how often parts
    are written, not how workers run (their number is part of a parts folder's identity), not the
    post-processing (`assembly_config`: it is re-derived from the raw scores, run/rederive.py)."""
    data = config.to_dict()
    truths = {config.calibrate.truth_column, *config.calibrate.truth_columns.values()}
    data["output"] = {"keep_columns": [c for c in data["output"]["keep_columns"] if c not in truths]}
    if config.output_format != "parquet":  # parquet: the identity outputs had before the key existed
        data["output"].update(format=config.output_format, error_path=OutputFiles.for_job(config).errors)
    data.pop("executor")
    data["input"].pop("storage_options")  # where the bytes come from (and credentials), not what they are
    data.pop("model")  # by content, in the identity's model part
    data.pop("model_download")  # how the weights were found, not which
    if not data["input"]["filter"]:
        del data["input"]["filter"]  # no filter: the identity outputs had before the key existed
    if data["prompt"]["engine"] == "format":
        del data["prompt"]["engine"]  # the default: outputs and parts from before the key stay valid
    if data["input"]["choices_column"] is None:
        del data["input"]["choices_column"]  # the same for the option keys at their defaults
    for section, key in (("input", "questions_column"), ("prompt", "state_columns")):
        if data[section][key] is None:
            del data[section][key]  # the decision keys at their defaults: identities from before them hold
    if data["questions"] is None:
        del data["questions"]
    if not data["engine"].get("batch_invariant"):
        data["engine"].pop("batch_invariant", None)  # the default: identities from before the key hold
    del data["score"]["confidence"]
    if not content_free_rows(config):  # contextual calibration scores a content-free input: the rest is assembly
        del data["score"]["calibrate"]
    if data["score"] == {"normalize": "sum"}:
        del data["score"]
    del data["calibrate"]
    if config.output.logprobs:
        data["output"]["logprobs"] = True
    if config.output.top_token:
        data["output"]["top_token"] = True
    return data


def assembly_config(config: JobConfig) -> dict:
    """The job keys that act on the raw scores after scoring (calibration, confidence, review,
    out-of-scope); {} at their defaults. Changing only these re-derives the output without scoring."""
    data = {}
    if config.score.calibrate != "none":
        data["calibrate"] = config.score.calibrate
    if config.score.confidence != "top":
        data["confidence"] = config.score.confidence
    if config.calibrate != CalibrateConfig():
        data["calibrate_section"] = dataclasses.asdict(config.calibrate)
    for key in ("review", "out_of_scope"):
        if getattr(config.output, key) is not None:
            data[key] = dataclasses.asdict(getattr(config.output, key))
    return data


def prepare_job(config: JobConfig, *, tokenize: bool = True, source: JobSource | None = None,
                progress: Callable[[int], None] | None = None) -> PreparedJob:
    """Locate the job (unless `source` is given) and read and (unless `tokenize` is False)
    tokenize its input; no model weights are loaded. Without tokenizing only the id and kept
    columns are read (what assembling an output needs). Raises InputError / ModelError / LabelError."""
    source = source or locate_job(config, with_model=tokenize)
    task = task_for(config, source.files)
    job = task.prepare(config, source, tokenize, progress)
    job.task_name = task.name
    return job


def check_output_path(output_path: str) -> None:
    """Refuse an output path that cannot be written, before any work: a folder, a file in a
    read-only folder. Raises OutputError. An object-store output is checked by its first write
    (the lock's lease)."""
    if is_url(output_path):
        as_path(output_path)  # its store's package is installed
        return
    out = Path(output_path).expanduser()
    if out.is_dir():
        raise OutputError(f"output.path {output_path} is a folder; give a file path, e.g. {out / 'scores.parquet'}")
    folder = next((p for p in [out.parent, *out.parent.parents] if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise OutputError(f"output.path {output_path}: {folder} is a file, not a folder")
    if folder is not None and not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"output.path {output_path}: the folder {folder} is not writable")


def plan_job(config: JobConfig) -> Plan:
    """Plan `config`'s input exactly as `run` would (same reading, checks and plan options)."""
    return prepare_job(config, source=locate_job(config, for_output=False)).plan()


def plan_options(config: JobConfig, engine_kind: str) -> PlanOptions:
    block = config.plan.block_size or kv_block_size(engine_kind)
    return PlanOptions(min_prefix_tokens=config.plan.min_prefix_tokens, block_size=block,
                       order=config.plan.order, enlarge=config.plan.enlarge)


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def prompt_limits(config: JobConfig, kind: str, model_dir, tokenizer) -> tuple[int, int]:
    """(longest prompt scored, vocabulary size) for this model, engine and job."""
    model_config = read_model_config(model_dir)
    context = context_length(model_config)
    context -= get_kind(kind).output_tokens  # vLLM counts the one output token against max_model_len
    max_length = min(config.engine.max_length or context, context)
    return max_length, int(model_config.get("vocab_size") or len(tokenizer))


def make_renderer(config: JobConfig, tokenizer) -> PromptRenderer | None:
    """The prompt renderer, or None when the input already carries token ids."""
    if config.input.token_ids_column is not None or config.input.synthetic is not None:
        return None
    if config.input.format == "openai_batch":
        return RequestRenderer(tokenizer)
    return PromptRenderer(tokenizer, config.prompt.template, system=config.prompt.system, chat=config.prompt.chat,
                          engine=config.prompt.engine)


def _check_output_outside_input(config: JobConfig, files: list[Path]) -> None:
    """Refuse an output that is an input file or would be read as input by the next run."""
    if is_url(config.output.path) or is_url(config.input.path):
        out, source = str(config.output.path), str(config.input.path or "")
        if out in {str(f) for f in files}:
            raise InputError(f"output.path {out} is one of the input files; choose another path")
        if any(ch in source for ch in "*?[") and fnmatch.fnmatch(out, source) or out.startswith(source.rstrip("/") + "/"):
            raise InputError(f"output.path {out} is inside the input {source}; the next run would read it as "
                             "input — write it elsewhere")
        return
    out = Path(config.output.path).expanduser().resolve()
    if any(path.resolve() == out for path in files):
        raise InputError(f"output.path {config.output.path} is one of the input files; choose another path")
    source = config.input.path
    if source is None:
        return
    source_path = Path(source).expanduser().resolve()
    inside_folder = source_path.is_dir() and source_path in out.parents
    matches_glob = any(ch in source for ch in "*?[") and fnmatch.fnmatch(str(out), str(Path(source).expanduser().resolve()))
    if inside_folder or matches_glob:
        raise InputError(f"output.path {config.output.path} is inside the input {source}; the next run "
                         "would read it as input — write it elsewhere")


def prepare_input(config: JobConfig, files: list[tuple[Path, str]], renderer=None, max_length: int | None = None,
                  vocab_size: int | None = None, tokenize: bool = True,
                  progress: Callable[[int], None] | None = None,
                  options: RowOptionSource | None = None) -> PreparedInput:
    """Read every input row of `files` and turn it into a Request or a per-row error.

    `renderer` (a PromptRenderer) is needed unless the input carries token ids or `tokenize` is
    False (then only ids, kept columns and choices are read, and no requests made). `options`
    gives each request its options (labels or the row's choices; None: requests get none).
    Raises InputError for
    problems that concern a whole file (missing, empty, a template field that is not a column);
    everything row-level becomes an entry in `errors`.
    """
    if config.input.synthetic is not None:
        return _prepare_synthetic(config, options)
    id_column = config.input.id_column
    choices_column = config.input.choices_column
    keep_columns = list(config.output.keep_columns)
    if config.input.format == "openai_batch" and config.output_format == "openai_batch" and "url" not in keep_columns:
        keep_columns.append("url")  # chat or text completion, per request (formats/openai_batch.py)
    token_column = config.input.token_ids_column if tokenize else None
    prompt_columns = [token_column] if token_column else renderer.columns if renderer and tokenize else []
    needed = list(dict.fromkeys(([id_column] if id_column else []) + keep_columns + prompt_columns
                                + ([choices_column] if choices_column else [])))

    ids, kept_tables, choice_arrays, requests, errors = [], [], [], [], {}
    locations = RowLocations()
    row_id = 0
    saw_rows = False
    # token lists are read per JSONL line: one line's NaN or string must not retype every row's list
    for batch in iter_batches(files, config.input.batch_rows, columns=needed, base=input_base(config.input.path),
                              json_columns=(token_column,) if token_column else ()):
        n = batch.table.num_rows
        if n == 0:
            continue
        saw_rows = True
        check_columns(batch, needed)
        locations.add(row_id, batch)
        ids.append(batch_ids(batch, id_column, row_id))
        kept_tables.append(select_kept(batch.table, keep_columns))
        if choices_column:
            choice_arrays.append(select_kept(batch.table, [choices_column]).column(0).combine_chunks())
        prompts = None
        if not tokenize:
            rows_tokens = []
        elif token_column:
            rows_tokens = _token_rows(batch, token_column, errors, row_id)
        else:
            rows_tokens, prompts = _rendered_rows(batch, renderer, errors, row_id)
        for offset, tokens in enumerate(rows_tokens):
            rid = row_id + offset
            if tokens is None:
                continue
            problem = prompt_problem(len(tokens), max_length, largest_token=int(np.max(tokens)) if len(tokens) else None,
                                     vocab_size=vocab_size, limit_name=max_length_name(config.engine.max_length,
                                                                                       max_length))
            if problem:
                errors[rid] = f"{batch.file}:{batch.first_line + offset}: {problem}"
                rows_tokens[offset] = None
        row_options = _row_options(options, batch, rows_tokens, prompts, renderer, choices_column, errors, row_id)
        for offset, tokens in enumerate(rows_tokens):
            if tokens is not None and row_id + offset not in errors:
                requests.append(Request(row_id + offset, tokens, row_options[offset]))
        row_id += n
        if progress:
            progress(n)
    if not saw_rows:
        raise InputError(f"input.path: {config.input.path} holds no rows")
    id_array = concat_arrays(ids)
    if id_column:
        check_unique_ids(id_array, id_column)
    kept = concat_tables(kept_tables) if keep_columns else pa.table({})
    choices = concat_arrays(choice_arrays) if choices_column else None
    return PreparedInput(row_id, id_array, kept, requests, errors, choices, locations=locations)


def _row_options(options: RowOptionSource | None, batch: InputBatch, rows_tokens: list, prompts: list | None,
                 renderer, choices_column: str | None, errors: dict[int, str], first_row_id: int) -> list:
    """Each row's OptionTokens (None without `options` or for rows with errors); option problems
    become row errors. `prompts`: the rows' RenderedPrompts (None: pre-tokenized prompts)."""
    if options is None or not rows_tokens:
        return [None] * len(rows_tokens)
    choices = None
    if choices_column:
        choices = batch.table.column(choices_column).to_pylist() if choices_column in batch.table.column_names \
            else [None] * batch.table.num_rows
    texts = chat = pieces = None
    if prompts is not None:
        texts = [p.text if p is not None else None for p in prompts]
        chat = [renderer.chat if p is None or p.chat is None else p.chat for p in prompts]
        pieces = [renderer.last_piece(p) if p is not None and renderer.in_pieces(p) else None for p in prompts]
    where = [f"{batch.file}:{batch.first_line + offset}" for offset in range(len(rows_tokens))]
    result = []
    for offset, (row_options, problem) in enumerate(options.batch(rows_tokens, texts, choices, where, chat, pieces)):
        if problem:
            errors[first_row_id + offset] = problem
        result.append(row_options)
    return result


def _prepare_synthetic(config: JobConfig, options: RowOptionSource | None = None) -> PreparedInput:
    from batchscore.prepare.synthetic import WORKLOADS

    sequences = [np.asarray(s, dtype=np.int32) for s in
                 WORKLOADS[config.input.synthetic.workload](**config.input.synthetic.params)]
    errors: dict[int, str] = {}
    row_options = [None] * len(sequences)
    if options is not None:
        where = [f"{config.input.synthetic.workload} row {i}" for i in range(len(sequences))]
        results = options.batch(sequences, None, [None] * len(sequences), where)
        row_options = [o for o, _ in results]
        errors = {i: problem for i, (_, problem) in enumerate(results) if problem}
    requests = [Request(i, s, o) for i, (s, o) in enumerate(zip(sequences, row_options)) if i not in errors]
    n = len(sequences)
    return PreparedInput(n, pa.array(np.arange(n, dtype=np.int64)), pa.table({}), requests, errors)


def _rendered_rows(batch: InputBatch, renderer, errors: dict[int, str], first_row_id: int) -> tuple[list, list]:
    """(each row's prompt token ids, each row's RenderedPrompt); None for rows with errors."""
    columns = [c for c in renderer.columns if c in batch.table.column_names]
    rows = batch.table.select(columns).to_pylist()
    texts, positions = [], []
    for offset, (row, read_error) in enumerate(zip(rows, batch.row_errors)):
        rid = first_row_id + offset
        if read_error:
            errors[rid] = read_error
            continue
        try:
            texts.append(renderer.prompt(row))
            positions.append(offset)
        except KeyError as exc:
            errors[rid] = f"{batch.file}:{batch.first_line + offset}: field {exc.args[0]!r} is null or missing"
        except RowRenderError as exc:  # prompt.engine jinja: any other failure of this row's template
            errors[rid] = f"{batch.file}:{batch.first_line + offset}: {exc}"
        except BatchscoreError:  # about the job, not this row (a model without a chat template)
            raise
        except Exception as exc:  # noqa: BLE001 — e.g. a chat template refusing this row's messages
            errors[rid] = f"{batch.file}:{batch.first_line + offset}: cannot render the prompt ({type(exc).__name__}: {exc})"
    result: list = [None] * len(rows)
    rendered: list = [None] * len(rows)
    for offset, prompt, tokens in zip(positions, texts, renderer.encode(texts)):
        result[offset] = tokens
        rendered[offset] = prompt
    return result, rendered


def _json_list(text: str):
    """The list a JSON text holds (NaN and Infinity included, as JSON readers allow), else the text."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, list) else text


def _token_rows(batch: InputBatch, column: str, errors: dict[int, str], first_row_id: int) -> list:
    values = batch.table.column(column).to_pylist() if column in batch.table.column_names else [None] * batch.table.num_rows
    result: list = []
    for offset, (value, read_error) in enumerate(zip(values, batch.row_errors)):
        rid = first_row_id + offset
        if isinstance(value, str):  # a JSONL line's own list, kept as its JSON text (iter_batches)
            value = _json_list(value)
        tokens, problem = (None, read_error) if read_error else (None, "is null") if value is None \
            else (None, "must be a list of integer token ids") if not isinstance(value, (list, tuple)) \
            else token_ids_problem(value)
        if problem:
            sep = " " if problem.startswith(("is ", "must ")) else ": "
            errors[rid] = problem if read_error else f"{batch.file}:{batch.first_line + offset}: field {column!r}{sep}{problem}"
        result.append(tokens)
    return result
