"""Reading a job's rows into requests: every input row becomes a Request (its prompt rendered and
tokenized, or its token ids read) or a per-row error, and the model limits a prompt is checked
against. The tasks read their rows through here (tasks/labels.py, tasks/questions/); nothing here
decides which task or format a job has (run/open.py does, once).

Every input row gets a `row_id` (its position across all input files, in reading order); rows
that cannot be scored keep their row id and an error message, so nothing is lost.
"""

from __future__ import annotations

import json
from itertools import chain
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from batchscore.config import JobConfig
from batchscore.engines.registry import get_kind
from batchscore.engines.shape import context_length, read_model_config
from batchscore.errors import BatchscoreError, InputError, RowRenderError
from batchscore.formats import iter_batches
from batchscore.formats.openai_batch import ANSWER_COLUMNS
from batchscore.formats.registry import answers_in_lines, requests_in_lines
from batchscore.io.readers import InputBatch, input_base
from batchscore.plan.validate import prompt_problems, row_maxima
from batchscore.plan.types import Request
from batchscore.plan.validate import token_ids_problem
from batchscore.prepare.options import RowOptionSource, max_length_name
from batchscore.prepare.prompts import PromptRenderer, RequestRenderer
from batchscore.row_errors import TOO_LONG, RowError, with_kinds
from batchscore.prepare.token_columns import flat_token_batch
from batchscore.prepare.rows import (PreparedInput, RowLocations, batch_ids, check_columns, check_unique_ids,
                                     concat_arrays, concat_tables, select_kept)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")  # not the tokenizer's: not part of its key
_TOKENIZERS: dict[tuple, object] = {}  # (thread, folder, its tokenizer files' sizes and times) -> tokenizer


def load_tokenizer(model_dir):
    """The model folder's tokenizer, loaded once per thread and per version of its files: a process
    that runs many jobs (the Python API, the tests, `serve`'s partial results) pays the ~0.3 s load
    once. Per thread because a fast tokenizer is not safe to share between threads (its Rust state is
    borrowed per call); batchscore never changes a tokenizer's settings, so sharing it is safe
    otherwise."""
    import threading

    from transformers import AutoTokenizer

    folder = Path(model_dir)
    files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.iterdir())
                  if f.is_file() and f.suffix not in _WEIGHT_SUFFIXES) if folder.is_dir() else ()
    key = (threading.get_ident(), str(folder.resolve()) if folder.exists() else str(model_dir), files)
    tokenizer = _TOKENIZERS.get(key)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if len(_TOKENIZERS) >= 8:  # a long-lived process that saw many models keeps the latest few
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        _TOKENIZERS[key] = tokenizer
    return tokenizer


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
    if requests_in_lines(config):  # each line's body is its prompt (OpenAI Batch)
        return RequestRenderer(tokenizer)
    return PromptRenderer(tokenizer, config.prompt.template, system=config.prompt.system, chat=config.prompt.chat,
                          engine=config.prompt.engine)



def prepare_input(config: JobConfig, files: list[tuple[Path, str]], renderer=None, max_length: int | None = None,
                  vocab_size: int | None = None, tokenize: bool = True,
                  progress: Callable[[int], None] | None = None,
                  options: RowOptionSource | None = None, sink=None, only: set | dict | None = None) -> PreparedInput:
    """Read every input row of `files` and turn it into a Request or a per-row error.

    `renderer` (a PromptRenderer) is needed unless the input carries token ids or `tokenize` is
    False (then only ids, kept columns and choices are read, and no requests made). `options`
    gives each request its options (labels or the row's choices; None: requests get none).
    Raises InputError for
    problems that concern a whole file (missing, empty, a template field that is not a column);
    everything row-level becomes an entry in `errors`.

    With a `sink` (the token store's StoreWriter) each batch's requests go to it and are not kept
    (`requests` stays empty), and token id columns are read a batch at a time as arrays
    (prepare/token_columns.py) where a batch allows it.

    `only` (a set of `files`' paths, or a dict path -> None or a Parquet file's (first, end) row
    groups): read those rows alone, as they read within the whole input (its schema, its
    partition columns, each file's row numbers); row ids count from 0 (store/segments.py).
    """
    if config.input.synthetic is not None:
        return _prepare_synthetic(config, options)
    id_column = config.input.id_column
    choices_column = config.input.choices_column
    keep_columns = list(config.output.keep_columns)
    if requests_in_lines(config) and answers_in_lines(config):
        keep_columns += [c for c in ANSWER_COLUMNS if c not in keep_columns]  # each answer shaped by its request
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
                              json_columns=(token_column,) if token_column else (), only=only):
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
        prompts = cuts = None
        flat = None
        if sink is not None and token_column:
            flat = flat_token_batch(batch, token_column, row_id, max_length, vocab_size,
                                    max_length_name(config.engine.max_length, max_length), options)
        if flat is not None:
            errors.update(flat.errors)
            sink.add_flat(flat.row_ids, flat.tokens, flat.lengths, flat.option_sets, flat.options)
            rows_tokens = []
        elif not tokenize:
            rows_tokens = []
        elif token_column:
            rows_tokens = _token_rows(batch, token_column, errors, row_id)
        else:
            rows_tokens, prompts, cuts = _rendered_rows(batch, renderer, errors, row_id, max_length,
                                                        max_length_name(config.engine.max_length, max_length))
        arrays = _PromptTokens(rows_tokens)
        for index, problem in prompt_problems(arrays.lengths, arrays.maxima, max_length, vocab_size=vocab_size,
                                              limit_name=max_length_name(config.engine.max_length,
                                                                         max_length)).items():
            offset = arrays.rows[index]
            errors[row_id + offset] = problem.at(batch.where(offset))  # typed: too long, or bad ids
            rows_tokens[offset] = None
        row_options = _row_options(options, batch, rows_tokens, prompts, renderer, choices_column, errors, row_id,
                                   cuts)
        keep = [offset for offset, tokens in enumerate(rows_tokens) if tokens is not None and row_id + offset not in errors]
        if sink is not None:  # the store keeps them as arrays; no object per row survives the batch
            sink.add_flat(row_id + np.asarray(keep, dtype=np.int64), *arrays.select(keep),
                          *_option_sets(row_options, keep))
        else:
            requests.extend(Request(row_id + offset, rows_tokens[offset], row_options[offset]) for offset in keep)
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
    with_kinds(errors)  # every other row error is the row's own input (row_errors.py)
    return PreparedInput(row_id, id_array, kept, requests, errors, choices, locations=locations)


class _PromptTokens:
    """A batch's prompt token lists (None: the row has an error) as one flat array, to check
    lengths and ids and to write the store without a numpy array per row."""

    def __init__(self, rows_tokens: list) -> None:
        self.rows = [offset for offset, tokens in enumerate(rows_tokens) if tokens is not None]
        self.lengths = np.fromiter((len(rows_tokens[o]) for o in self.rows), dtype=np.int64, count=len(self.rows))
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)))
        total = int(self.starts[-1])
        if all(isinstance(rows_tokens[o], list) for o in self.rows):
            self.tokens = np.fromiter(chain.from_iterable(rows_tokens[o] for o in self.rows), dtype=np.int64,
                                      count=total)
        else:
            self.tokens = np.concatenate([np.asarray(rows_tokens[o], dtype=np.int64).reshape(-1) for o in self.rows]
                                         or [np.zeros(0, np.int64)])
        self.maxima = row_maxima(self.tokens, self.lengths)  # prompt_problems checks them against the vocabulary
        self._at = {offset: index for index, offset in enumerate(self.rows)}

    def select(self, keep: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(the flat tokens, the lengths) of the rows `keep` (offsets in the batch, in order)."""
        if keep == self.rows:
            return self.tokens.astype(np.int32), self.lengths
        index = np.asarray([self._at[o] for o in keep], dtype=np.int64)
        mask = np.zeros(len(self.rows), dtype=bool)
        mask[index] = True
        return self.tokens[np.repeat(mask, self.lengths)].astype(np.int32), self.lengths[index]


def _option_sets(row_options: list, keep: list[int]) -> tuple[np.ndarray, list]:
    """(each kept row's index into the distinct OptionTokens, -1 for none; those OptionTokens)."""
    distinct: dict[int, int] = {}
    objects = []
    sets = np.full(len(keep), -1, dtype=np.int32)
    for i, offset in enumerate(keep):
        options = row_options[offset]
        if options is not None:
            index = distinct.get(id(options))
            if index is None:
                index = distinct[id(options)] = len(objects)
                objects.append(options)
            sets[i] = index
    return sets, objects


def _row_options(options: RowOptionSource | None, batch: InputBatch, rows_tokens: list, prompts: list | None,
                 renderer, choices_column: str | None, errors: dict[int, str], first_row_id: int,
                 cuts: list | None = None) -> list:
    """Each row's OptionTokens (None without `options` or for rows with errors); option problems
    become row errors. `prompts`: the rows' RenderedPrompts (None: pre-tokenized prompts);
    `cuts`: their cuts (PromptRenderer.encode_cuts)."""
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
    where = [batch.where(offset) for offset in range(len(rows_tokens))]
    result = []
    for offset, (row_options, problem) in enumerate(options.batch(rows_tokens, texts, choices, where, chat, pieces,
                                                                  cuts)):
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


def _rendered_rows(batch: InputBatch, renderer, errors: dict[int, str], first_row_id: int,
                   max_length: int | None = None, limit_name: str = "the model's context") -> tuple[list, list, list]:
    """(each row's prompt token ids, each row's RenderedPrompt, each row's cut for its options:
    PromptRenderer.encode_cuts); None for rows with errors. A prompt whose text is longer than
    `max_length` tokens could ever hold (`max_length` × the longest token's characters) is that row's
    error without being tokenized: a 30 MB field costs its reading, not gigabytes of token lists."""
    most_chars = max_length * renderer.longest_token_chars if max_length is not None else None
    columns = [c for c in renderer.columns if c in batch.table.column_names]
    table = batch.table.select(columns)
    whole = renderer.render_table(table) or [None] * table.num_rows  # None: rendered one row at a time
    rows = None
    texts, positions = [], []
    for offset, (ready, read_error) in enumerate(zip(whole, batch.row_errors)):
        rid = first_row_id + offset
        if read_error:
            errors[rid] = read_error
            continue
        if ready is None:
            rows = rows or table.to_pylist()
        try:
            prompt = ready if ready is not None else renderer.prompt(rows[offset])
            length = len(getattr(prompt, "text", prompt))
            if most_chars is not None and length > most_chars:
                errors[rid] = RowError(TOO_LONG, f"prompt is longer than the maximum {max_length} tokens "
                                                 f"({limit_name}): its text holds {length:,} characters and no "
                                                 f"token of this model is longer than {renderer.longest_token_chars} characters"
                                                 ).at(batch.where(offset))
                continue
            texts.append(prompt)
            positions.append(offset)
        except KeyError as exc:
            errors[rid] = f"{batch.where(offset)}: field {exc.args[0]!r} is null or missing"
        except RowRenderError as exc:  # prompt.engine jinja: any other failure of this row's template
            errors[rid] = f"{batch.where(offset)}: {exc}"
        except BatchscoreError:  # about the job, not this row (a model without a chat template)
            raise
        except Exception as exc:  # noqa: BLE001 — e.g. a chat template refusing this row's messages
            errors[rid] = f"{batch.where(offset)}: cannot render the prompt ({type(exc).__name__}: {exc})"
    result: list = [None] * table.num_rows
    rendered: list = [None] * table.num_rows
    cuts: list = [None] * table.num_rows
    for offset, prompt, tokens, cut in zip(positions, texts, *renderer.encode_cuts(texts)):
        result[offset] = tokens
        rendered[offset] = prompt
        cuts[offset] = cut
    return result, rendered, cuts


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
            errors[rid] = problem if read_error else f"{batch.where(offset)}: field {column!r}{sep}{problem}"
        result.append(tokens)
    return result
