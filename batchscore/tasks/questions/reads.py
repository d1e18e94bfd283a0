"""Decision jobs: every input row (a *record*) becomes one *read* per question.

A record is a System One or OpenAI Decisions request (a line of an `openai_batch` file), a
chat/completions request of the same file (one read over the job's labels), or a row of a table
job with `questions:` (its state from `prompt.state_columns` or `prompt.template`). A read is an
ordinary Request whose options are the question's labels, so the planner and both engines score
it unchanged; all of a record's reads start with the same chat header and state, so the prefix
tree prefills the state once per record, by construction.

Reads are the rows of the run (parts, resume and the rows-in = rows-out check count reads);
`DecisionInput` maps them back to records when the output is assembled (tasks/questions/files.py).
Every record has at least one read: a record that cannot be asked anything has one error read,
so its error is counted and written like any other.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from batchscore.config import JobConfig
from batchscore.errors import DecisionRequestError, DuplicateKeyError, InputError, PromptTemplateError, RowRenderError
from batchscore.formats import iter_batches
from batchscore.formats.openai_batch import ANSWER_COLUMNS, DECISION_URLS, REQUEST_ID
from batchscore.formats.registry import answers_in_lines, requests_in_lines
from batchscore.io.readers import input_base, unique_object
from batchscore.io.storage import as_path
from batchscore.plan.types import Request
from batchscore.plan.validate import prompt_problems, row_maxima
from batchscore.row_errors import with_kinds
from batchscore.task import InputColumns
from batchscore.tasks.questions.requests import (API_OPENAI, API_SYSTEMONE, DecisionRequest, check_question,
                                          parse_openai_decisions, parse_systemone, read_prompt)
from batchscore.prepare.options import OptionEncoder, RowOptionSource, max_length_name
from batchscore.prepare.prompts import PromptRenderer, RenderedPrompt, RequestRenderer
from batchscore.prepare.rows import (PreparedInput, batch_ids, check_columns, check_unique_ids, concat_arrays,
                                     concat_tables, select_kept)
from batchscore.tasks.questions.records import DecisionInput, Record

READS_PER_CALL = 8192  # reads tokenized at once (the tokenizer's encodings of a call are held together)
CHAT = "chat"  # a chat/completions line of an openai_batch file: one read over the job's labels
TABLE = "table"  # a row of a table job with `questions:`


def is_decision_input(config: JobConfig, files: list | None) -> bool:
    """True for `questions:` jobs and for openai_batch files that hold any decision line (`files`
    None: the job file alone, which says nothing of its lines)."""
    if config.questions is not None or config.input.questions_column is not None:
        return True
    if not requests_in_lines(config) or files is None:
        return False
    for path, _ in files:
        with as_path(path).open("rb") as handle:
            for line in handle:
                if any(url.encode() in line for url in DECISION_URLS):
                    return True
    return False


def prepare_decisions(config: JobConfig, files: list, tokenizer=None, max_length: int | None = None,
                      vocab_size: int | None = None, progress: Callable[[int], None] | None = None, sink=None):
    """Read every record of `files` and turn each question into a read (a Request over its labels),
    or a read error. Without a `tokenizer` only records, ids and kept columns are read (what
    assembling an output needs). Returns a PreparedInput whose rows are reads, with `decisions` set.
    With a `sink` (the token store's StoreWriter) each input batch's reads go to it and are not kept
    (`requests` stays empty): the same reads, in the same order. Raises InputError for problems of
    a whole file."""
    batch_file = requests_in_lines(config)  # an OpenAI Batch file: each line one request
    id_column = config.input.id_column
    keep = list(config.output.keep_columns)
    if batch_file:  # the url says each line's kind; a batch output shapes each answer by its request
        answer_columns = ANSWER_COLUMNS if answers_in_lines(config) else ("url",)
        keep += [c for c in answer_columns if c not in keep]
    table = None if batch_file else _TableRecords(config, tokenizer)
    needed = list(dict.fromkeys(([id_column] if id_column else []) + keep + (
        [REQUEST_ID, "url", "messages", "prompt", "decision"] if batch_file else table.columns)))
    uses = _column_uses(config, table)
    encoder = OptionEncoder(tokenizer) if tokenizer is not None else None
    options = RowOptionSource(None, "labels", encoder, max_length, max_length_name(config.engine.max_length, max_length)) \
        if encoder is not None else None
    chat_renderer = RequestRenderer(tokenizer) if tokenizer is not None else None
    records: list[Record] = []
    ids, kept, requests, errors, read_tokens = [], [], [], {}, {}
    reads = 0
    json_columns = (config.input.questions_column,) if config.input.questions_column and not batch_file else ()
    for batch in iter_batches(files, config.input.batch_rows, columns=needed, base=input_base(config.input.path),
                              json_columns=json_columns):
        n = batch.table.num_rows
        if n == 0:
            continue
        check_columns(batch, [c for c in needed if c in uses], uses)  # as a labels job does, before any work
        if table is not None:
            table.check_types(batch)
        ids.append(batch_ids(batch, id_column, len(records)))
        kept.append(select_kept(batch.table, keep))
        rows, map_problems = _python_rows(batch.table.select([c for c in needed if c in batch.table.column_names]))
        pending: list[tuple[int, RenderedPrompt, list[str], str, int]] = []  # (read, prompt, labels, where, record)
        for offset, (row, read_error) in enumerate(zip(rows, batch.row_errors)):
            if len(pending) >= READS_PER_CALL:  # a batch of records holds several reads each
                _tokenized_into(sink, requests, pending, chat_renderer, options, max_length, vocab_size, errors,
                                read_tokens)
                pending = []
            where = batch.where(offset)
            if read_error is None and offset in map_problems:
                read_error = f"{where}: {map_problems[offset]}"
            if batch_file and row.get(REQUEST_ID) is not None:
                where += f": request {row[REQUEST_ID]!r}"
            record = _record(row, read_error, where, batch_file, table, config)
            record.first_read = reads
            records.append(record)
            reads += record.num_reads
            if record.error is not None:
                errors[record.first_read] = record.error
                continue
            if tokenizer is None:
                continue
            if record.kind == CHAT:
                try:
                    pending.append((record.first_read, chat_renderer.prompt(row), list(config.labels), where,
                                    len(records) - 1))
                except (KeyError, PromptTemplateError, RowRenderError) as exc:
                    errors[record.first_read] = f"{where}: {exc}"
                continue
            for k, question in enumerate(record.request.questions):
                read = record.first_read + k
                at = f"{where}: question {question.key!r}"
                try:
                    problem = check_question(tokenizer, record.request, question)
                    if problem:
                        errors[read] = f"{where}: {problem}"
                        continue
                    text, spans = read_prompt(tokenizer, record.request, question)
                except (DecisionRequestError, ValueError, TypeError) as exc:  # a template that refuses the read
                    errors[read] = f"{at}: {exc}"
                    continue
                pending.append((read, RenderedPrompt(text, spans, chat=True), list(question.labels), at,
                                len(records) - 1))
        if pending:
            _tokenized_into(sink, requests, pending, chat_renderer, options, max_length, vocab_size, errors,
                            read_tokens)
        if progress:
            progress(n)
    if not records:
        raise InputError(f"input.path: {config.input.path} holds no rows")
    id_array = concat_arrays(ids)
    if id_column:
        check_unique_ids(id_array, id_column)
    decisions = DecisionInput(records, id_array, concat_tables(kept) if keep else pa.table({}), read_tokens)
    with_kinds(errors)  # every other read error is its record's own input (row_errors.py)
    record_of = np.zeros(reads, dtype=np.int64)  # read -> its record: the progress bar counts records
    for index, record in enumerate(records):
        record_of[record.first_read:record.first_read + record.num_reads] = index
    return PreparedInput(reads, pa.array(np.arange(reads, dtype=np.int64)), pa.table({}), requests, errors,
                         task_input=decisions, record_count=decisions.num_records, record_of=record_of)


def _tokenized_into(sink, requests: list, pending, *args) -> None:
    """Tokenize `pending` reads (`_tokenize_reads`) into the store's writer `sink`, else `requests`."""
    made = _tokenize_reads(pending, *args)
    if sink is not None:  # the store keeps them as arrays (a record's shared state once); no Request survives
        record_of = {read: record for read, _, _, _, record in pending}
        sink.add_requests(made, groups=[record_of[r.row_id] for r in made])
    else:
        requests.extend(made)


def _tokenize_reads(pending, renderer: PromptRenderer, options: RowOptionSource, max_length, vocab_size,
                    errors: dict, read_tokens: dict) -> list[Request]:
    """Tokenize a batch of reads and give each its labels as options (or its error): the batch's
    Requests, in read order."""
    prompts = [p for _, p, _, _, _ in pending]
    tokens, cuts = renderer.encode_cuts(prompts)  # cuts: labels tokenized after the prompt's tail alone
    lengths = np.fromiter((len(t) for t in tokens), dtype=np.int64, count=len(tokens))
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in tokens] or [np.zeros(0, np.int64)])
    for i, problem in prompt_problems(lengths, row_maxima(flat, lengths), max_length, vocab_size=vocab_size,
                                      limit_name=options.limit_name).items():
        read, _, _, where, _ = pending[i]
        errors[read] = problem.at(where)  # typed: too long, or bad ids
        tokens[i] = None
    pieces = [renderer.last_piece(p) if renderer.in_pieces(p) else None for p in prompts]
    requests: list[Request] = []
    results = options.batch(tokens, [p.text for p in prompts], [labels for _, _, labels, _, _ in pending],
                            [where for _, _, _, where, _ in pending], [p.chat is not False for p in prompts], pieces,
                            cuts)
    for (read, _, _, _, _), read_ids, (read_options, problem) in zip(pending, tokens, results):
        if read_ids is None:
            continue
        if problem:
            errors[read] = problem
            continue
        read_tokens[read] = len(read_ids)
        requests.append(Request(read, np.asarray(read_ids, dtype=np.int32), read_options))
    return requests


def _column_uses(config: JobConfig, table: "_TableRecords | None") -> dict[str, str]:
    """Each input column the job names -> the job key that names it (for a missing column's error).
    An openai_batch file's own fields (custom_id, url, ...) are always there and not listed."""
    uses: dict[str, str] = {}
    if table is not None:
        for name in table.columns:
            uses[name] = "input.questions_column" if name == table.questions_column else \
                "prompt.state_columns" if table.state_columns else "prompt.template"
    truths = {column: f"calibrate.truth_columns.{q}" for q, column in config.calibrate.truth_columns.items()}
    for name in config.output.keep_columns:
        uses.setdefault(name, truths.get(name, "output.keep_columns"))
    if config.input.id_column and not (requests_in_lines(config) and config.input.id_column == REQUEST_ID):
        uses[config.input.id_column] = "input.id_column"
    return uses


def _record(row: dict, read_error: str | None, where: str, batch_file: bool, table: "_TableRecords | None",
            config: JobConfig) -> Record:
    """The record of one input row (its reads not yet made)."""
    if read_error:
        return Record(CHAT if batch_file else TABLE, None, read_error, 0, 1)
    if not batch_file:
        try:
            request = table.request(row)
        except DecisionRequestError as exc:
            return Record(TABLE, None, f"{where}: {exc}", 0, 1)
        return Record(TABLE, request, None, 0, len(request.questions))
    url = row.get("url")
    if url in DECISION_URLS:
        api = API_SYSTEMONE if url == "/v1/systemone" else API_OPENAI
        try:
            body = json.loads(row["decision"])
            request = parse_systemone(body) if api == API_SYSTEMONE else parse_openai_decisions(body)
        except DecisionRequestError as exc:
            return Record(api, None, f"{where}: {exc}", 0, 1, url)
        return Record(api, request, None, 0, len(request.questions), url)
    if not config.labels:
        return Record(CHAT, None, f"{where}: a {url or 'chat/completions'} request is scored over the job's "
                                  "labels, and this job has none (set labels: [...])", 0, 1, url)
    return Record(CHAT, None, None, 0, 1, url)


def input_columns(config: JobConfig) -> InputColumns | None:
    """The columns a table job's reads are made from: the id, the state (or the template's
    fields) and the per-row questions, read per JSON line as JSON text (`prepare_decisions`).
    None for an openai_batch file's lines, whose bodies are the requests."""
    if requests_in_lines(config) or not (config.prompt.state_columns or config.prompt.template):
        return None
    inp = config.input
    columns = [inp.id_column] if inp.id_column else []
    columns += _TableRecords(config, None).columns
    return InputColumns(tuple(dict.fromkeys(columns)), (inp.questions_column,) if inp.questions_column else ())


class _TableRecords:
    """The records of a table job: each row's state and questions as a System One request."""

    def __init__(self, config: JobConfig, tokenizer) -> None:
        self.state_columns = config.prompt.state_columns
        self.template = None
        if config.prompt.template:
            from batchscore.prepare.prompts import compile_template

            self.template = compile_template(config.prompt.template, config.prompt.engine)
        self.system = config.prompt.system
        self.questions = config.questions
        self.questions_column = config.input.questions_column
        self._shared: tuple | None = None  # the job's parsed questions, held once for every record

    @property
    def columns(self) -> list[str]:
        """The input columns a record is made of."""
        state = list(self.state_columns) if self.state_columns else list(self.template.columns)
        return state + ([self.questions_column] if self.questions_column else [])

    def check_types(self, batch) -> None:
        """Refuse, before any work, the columns no row could be read from: a binary state column
        (bytes are not text), and a struct or map questions column (Parquet unifies every row's
        objects into one type, so each row would see the other rows' question ids and options)."""
        schema = batch.table.schema
        for name in self.state_columns or ():
            if name in schema.names and _holds_binary(schema.field(name).type):
                raise InputError(f"{batch.file}: prompt.state_columns {name!r} is a binary column "
                                 f"({schema.field(name).type}); a state is text — decode it to a string column")
        column = self.questions_column
        if column and column in schema.names and (pa.types.is_struct(schema.field(column).type)
                                                  or pa.types.is_map(schema.field(column).type)):
            raise InputError(f"{batch.file}: input.questions_column {column!r} is a {schema.field(column).type} "
                             "column: one type for every row's questions, so a row would see the other rows' "
                             "question ids and options; write each row's questions as JSON text (a string column)")

    def request(self, row: dict[str, Any]) -> DecisionRequest:
        if self.state_columns:
            for name in self.state_columns:
                if _nesting(row.get(name)) > MAX_STATE_DEPTH:
                    raise DecisionRequestError(f"field {name!r} is nested more than {MAX_STATE_DEPTH} levels deep; "
                                               "a state that deep cannot be a prompt")
            state: Any = {name: _json_value(row.get(name)) for name in self.state_columns}
        else:
            try:
                state = self.template.render_spans(row)[0]
            except KeyError as exc:
                raise DecisionRequestError(f"field {exc.args[0]!r} is null or missing") from None
            except RowRenderError as exc:
                raise DecisionRequestError(str(exc)) from None
        questions = self.questions or {}
        if self.questions_column:
            own = _row_questions(row.get(self.questions_column), self.questions_column)
            clash = next((qid for qid in own if qid in questions), None)
            if clash is not None:  # the job's question names its columns: a row cannot redefine it
                raise DecisionRequestError(f"field {self.questions_column!r}: question {clash!r} is one of the "
                                           "job's questions; give the row's question another id")
            questions = {**questions, **own}
        body = {"state": state, "questions": questions}
        if self.system:
            body["instructions"] = self.system
        request = parse_systemone(body)
        if self.questions_column:
            return request
        # every record asks the job's questions: one copy of them, not one per record (~3 KB each)
        if self._shared is None or request.questions != self._shared:
            self._shared = request.questions
        return replace(request, questions=self._shared)


MAX_STATE_DEPTH = 100  # lists and objects inside a state value; far below Python's recursion limit


def _nesting(value: Any) -> int:
    """How deep lists and dicts nest in `value` (0: a scalar); stops counting past MAX_STATE_DEPTH.
    Iterative: a JSON line may nest as deep as its parser allows."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, (list, tuple)):
            deepest = max(deepest, depth + 1)
            if deepest > MAX_STATE_DEPTH:
                return deepest
            stack.extend((v, depth + 1) for v in item)
    return deepest


def _python_rows(table: pa.Table) -> tuple[list[dict], dict[int, str]]:
    """The rows as Python values, a map column's value as the object it is (not a list of
    pairs), and {row offset: why} for a row whose map holds a key twice (an object cannot)."""
    try:
        return table.to_pylist(maps_as_pydicts="strict"), {}
    except KeyError:
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pyarrow warns per repeated key; each such row is named below
        rows = table.to_pylist(maps_as_pydicts="lossy")
    problems: dict[int, str] = {}
    for name in table.column_names:
        column = table.column(name)
        try:
            column.to_pylist(maps_as_pydicts="strict")
            continue
        except KeyError:
            pass
        for row in range(len(column)):
            try:
                column.slice(row, 1).to_pylist(maps_as_pydicts="strict")
            except KeyError as exc:  # pyarrow names the key: "... (duplicate key was 'size')."
                key = str(exc.args[0]).rpartition("duplicate key was ")[2].rstrip(".)") or "a key"
                problems.setdefault(row, f"field {name!r}: the map holds {key} twice; an object holds a key once")
    return rows, problems


def _json_value(value: Any) -> Any:
    """A column value as JSON can hold it: a date, time, timestamp, duration or decimal (which
    JSON has no type for) as its text (ISO 8601 for dates and times), inside lists, structs and
    maps too (a map is an object; a key that is no string or number as its text)."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {key if isinstance(key, (str, bool, int, float)) else str(_json_value(key)): _json_value(v)
                for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if hasattr(value, "isoformat"):  # datetime, date, time
        return value.isoformat()
    return str(value)  # Decimal, timedelta, ...


def _holds_binary(kind: pa.DataType) -> bool:
    """Whether a column type holds bytes anywhere inside it. Iterative: a JSON Lines column's
    inferred type nests as deep as its values do."""
    stack = [kind]
    while stack:
        kind = stack.pop()
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind) \
                or pa.types.is_binary_view(kind):
            return True
        if pa.types.is_dictionary(kind):
            stack.append(kind.value_type)
        else:
            stack.extend(kind.field(i).type for i in range(kind.num_fields))
    return False


def _row_questions(value: Any, column: str) -> dict:
    """A row's own questions: a System One map, or JSON text holding one (null: none)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value, object_pairs_hook=unique_object)  # a question defined twice: refused
        except DuplicateKeyError as exc:
            raise DecisionRequestError(f"field {column!r}: key {exc.args[0]!r} appears twice in one JSON object; "
                                       "a JSON reader keeps only the last") from None
        except json.JSONDecodeError as exc:
            raise DecisionRequestError(f"field {column!r}: not JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise DecisionRequestError(f"field {column!r}: a map of question id -> question, got {type(value).__name__}")
    return value
