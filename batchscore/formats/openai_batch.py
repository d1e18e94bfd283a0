"""The OpenAI Batch API wire format: request files in, output and error files out.

Reading: one request per line (`custom_id`, `url`, `body`), a chat/completions request's
messages or prompt checked and kept as a row of `OPENAI_BATCH_SCHEMA`; a decision request's
body is kept whole for its task to read.

Writing: what the Batch API returns for a batch (one line per request, matched by
`custom_id`): requests that were scored go to the output file, as a chat completion (or a
text completion for `/v1/completions` requests) that "generated" the most probable label, with
every label's log probability in `logprobs` (as `logprobs: true, top_logprobs: N` would) and
batchscore's normalized `scores` and `label_mass` beside them; requests that failed go to the
error file with a 4xx/5xx response whose body holds an OpenAI error object. Each custom_id
appears exactly once across the two files. Every file is written atomically (io/atomic.py), the
error file before the output.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping
from typing import Iterator

import pyarrow as pa

from batchscore.formats.lines import write_lines
from batchscore.formats.registry import WireFormat, register
from batchscore.io.readers import jsonl_batches
from batchscore.output import layout
from batchscore.row_errors import FAILED, INPUT, NOT_SCORED, TOO_LONG, RowError, kind_of

NAME = "openai_batch"
REQUEST_ID = "custom_id"  # the field a request line carries its id in (the job's row id)

# A calibrated job's answers (score.calibrate): each label's calibrated probability beside the raw `scores`.
CALIBRATED_SCORES = "calibrated_scores"

# The smallest log probability written (OpenAI writes -9999.0 for "practically never").
MIN_LOGPROB = -9999.0


# One request per line: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
# "body": {"model": ..., "messages": [...]}} or, for /v1/completions, "body": {"prompt": ...}.
OPENAI_BATCH_SCHEMA = pa.schema([
    ("custom_id", pa.string()), ("method", pa.string()), ("url", pa.string()), ("model", pa.string()),
    ("messages", pa.string()),  # JSON text: [{"role": ..., "content": "..."}], contents as plain text
    ("prompt", pa.string()),
    ("decision", pa.string()),  # JSON text: the body of a /v1/systemone or /v1/decisions request
    ("reply", pa.string()),  # JSON text: what a chat/completions answer shows as asked ({"logprobs": false, ...})
])

CHAT_URLS = ("/v1/chat/completions", "/v1/completions")
FIELD_NAMES = {"messages": "body.messages", "prompt": "body.prompt", "model": "body.model"}  # in messages
DECISION_URLS = ("/v1/systemone", "/v1/decisions")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # the Chat Completions API's message roles
# the request columns a job keeps beside its results: each answer is shaped by its own request
ANSWER_COLUMNS = ("url", "reply")


def openai_request(value: dict) -> tuple[dict, str | None]:
    """One OpenAI Batch request line as a row of OPENAI_BATCH_SCHEMA, and the problem that keeps
    it from being scored (None if it can be). The row keeps its custom_id even when it fails,
    so its error is reported under that id."""
    custom_id = value.get("custom_id")
    row = {"custom_id": custom_id if isinstance(custom_id, str) else None,
           "method": _text_or_none(value.get("method")), "url": _text_or_none(value.get("url"))}
    if not isinstance(custom_id, str) or not custom_id:
        return row, "custom_id: missing or not a string"
    body = value.get("body")
    if not isinstance(body, dict):
        return row, "body: missing or not an object"
    row["model"] = _text_or_none(body.get("model"))
    url = value.get("url")
    if url is not None and url not in CHAT_URLS + DECISION_URLS:
        return row, (f"url: {_short_text(url)} is not a url batchscore answers "
                     f"({', '.join(CHAT_URLS + DECISION_URLS)})")
    if url in DECISION_URLS:  # its questions are read in tasks/questions/requests.py
        row["decision"] = json.dumps(body)  # ASCII: a lone surrogate stays an escape until it is read
        return row, None
    if body.get("messages") is not None:
        messages, problem = _chat_messages(body["messages"])
        if problem:
            return row, f"body.messages: {problem}"
        row["messages"] = json.dumps(messages, ensure_ascii=False)
    elif body.get("prompt") is not None:
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return row, "body.prompt: must be one string (a request scores one prompt)"
        row["prompt"] = prompt
    else:
        return row, "body: has neither messages (chat completions) nor prompt (completions)"
    reply, problem = _reply(body, completions=body.get("messages") is None)
    if problem:
        return row, problem
    row["reply"] = json.dumps(reply) if reply else None
    return row, None


# Options that would change what is generated: a scored request's answer is one of its labels, so
# each is refused by name unless it asks what scoring gives anyway (n: 1, response_format text).
_REFUSED = {"stream": "streaming: a batch line is answered whole",
            "tools": "tool calls: the answer is one of the labels", "functions": "function calls: the answer is one "
            "of the labels", "logit_bias": "logit_bias: the labels' probabilities are the model's own",
            "echo": "echo: the prompt is not returned", "suffix": "suffix: the answer is read right after the prompt"}


def _reply(body: dict, completions: bool) -> tuple[dict, str | None]:
    """What a chat/completions request asks its answer to show ({} : everything, as `logprobs:
    true` with every label), or the option that cannot be honoured, named."""
    for name, why in _REFUSED.items():
        if body.get(name) not in (None, False, [], {}):
            return {}, f"body.{name}: not supported ({why}); leave it out"
    if body.get("tool_choice") not in (None, "none"):
        return {}, "body.tool_choice: not supported (tool calls: the answer is one of the labels); leave it out"
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            return {}, f"body.{name}: {_short_text(body[name])}: one answer per request; give 1 or leave it out"
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        return {}, (f"body.response_format: {_short_text(kind)} is not supported: the answer is one of the labels "
                    "as plain text; give {\"type\": \"text\"} or leave it out")
    logprobs, top = body.get("logprobs"), body.get("top_logprobs")
    if completions:  # /v1/completions: `logprobs: N` is the number of top entries
        if logprobs is None:
            return {}, None
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 5:
            return {}, f"body.logprobs: {_short_text(logprobs)}: an integer from 0 to 5, or leave it out"
        return {"top_logprobs": logprobs}, None
    if logprobs is not None and not isinstance(logprobs, bool):
        return {}, f"body.logprobs: {_short_text(logprobs)}: true or false"
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20:
            return {}, f"body.top_logprobs: {_short_text(top)}: an integer from 0 to 20"
        if logprobs is not True:
            return {}, "body.top_logprobs: needs body.logprobs: true"
        return {"top_logprobs": top}, None
    return ({"logprobs": False}, None) if logprobs is False else ({}, None)


def _short_text(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _chat_messages(messages) -> tuple[list[dict], str | None]:
    if not isinstance(messages, list) or not messages:
        return [], "must be a non-empty list of {role, content} objects"
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return [], f"message {i} has no role"
        if message["role"] not in CHAT_ROLES:  # a role is rendered into the prompt: text there forges turns
            return [], (f"message {i}: role {_short_text(message['role'])} is not one of the API's roles "
                        f"({', '.join(CHAT_ROLES)})")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                return [], f"message {i}: only text content parts can be scored"
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            return [], f"message {i} has no text content"
        result.append({"role": message["role"], "content": content})
    return result, None


def _text_or_none(value):
    return value if isinstance(value, str) else None


LINES_CHUNK = 65_536  # rows turned into lines at a time: the whole table's Python values never held at once


def openai_batch_lines(table: pa.Table, id_name: str, labels: list[str], model: str,
                       created: int | None = None, usage: Mapping[int, tuple[int, int]] | None = None,
                       row_errors: dict | None = None) -> tuple[list[str], list[str]]:
    """(output lines, error lines) of the OpenAI Batch API for the results table. `usage`: row ->
    (prompt tokens, cached tokens) (output/token_usage.py), for each answer's `usage`; `row_errors`:
    row -> its RowError (the table's row i is row i), whose kind picks a failed line's status."""
    ok, failed = [], []
    for chunk_ok, chunk_failed in _line_chunks(table, id_name, labels, model, created, usage, row_errors):
        ok += chunk_ok
        failed += chunk_failed
    return ok, failed


def _line_chunks(table: pa.Table, id_name: str, labels: list[str], model: str, created: int | None,
                 usage: Mapping[int, tuple[int, int]] | None, row_errors: dict | None,
                 chunk: int = LINES_CHUNK, answers: bool = True) -> Iterator[tuple[list[str], list[str]]]:
    """`openai_batch_lines`, LINES_CHUNK rows at a time: (output lines, error lines) per chunk
    (`answers` False: the error lines only, the answers' bodies not built)."""
    created = int(time.time()) if created is None else created
    usage = usage if usage is not None else {}
    for start in range(0, table.num_rows, chunk):
        yield _chunk_lines(table.slice(start, chunk), start, id_name, labels, model, created, usage, row_errors or {},
                           answers)


def _chunk_lines(table: pa.Table, start: int, id_name: str, labels: list[str], model: str, created: int,
                 usage: Mapping, row_errors: dict, answers: bool = True) -> tuple[list[str], list[str]]:
    column = {name: table.column(name).to_pylist() for name in
              [id_name, layout.LABEL, layout.LABEL_MASS, layout.STATUS, layout.ERROR,
               *map(layout.label_column, labels)]}
    urls, replies = (table.column(name).to_pylist() if name in table.column_names else [None] * table.num_rows
                     for name in ANSWER_COLUMNS)
    calibrated = {label: table.column(layout.calibrated_column(label)).to_pylist() for label in labels
                  if layout.calibrated_column(label) in table.column_names}  # score.calibrate: the label follows
    approx = table.column(layout.APPROX_KEEP).to_pylist() if layout.APPROX_KEEP in table.column_names else None
    ok, failed = [], []
    for i in range(table.num_rows):
        row = start + i
        custom_id = column[id_name][i]
        custom_id = None if custom_id is None else str(custom_id)
        key = line_key(row, custom_id)
        if column[layout.STATUS][i] == layout.STATUS_OK:
            if not answers:
                continue
            probs = {label: column[layout.label_column(label)][i] for label in labels}
            body = completion_body(key, created, model, column[layout.LABEL][i], probs,
                                   column[layout.LABEL_MASS][i], completions=str(urls[i] or "").endswith("/v1/completions"),
                                   usage=usage.get(row), reply=json.loads(replies[i]) if replies[i] else None)
            if calibrated:
                body[CALIBRATED_SCORES] = {label: values[i] for label, values in calibrated.items()}
            if approx is not None:
                body[layout.APPROX_KEEP] = approx[i]  # speculative prefill: the scores are approximate
            ok.append(response_line(key, custom_id, body))
        else:
            failed.append(error_line(key, custom_id, row_errors.get(row)
                                     or RowError(NOT_SCORED, column[layout.ERROR][i] or "not scored")))
    return ok, failed


# The Batch API's output lines, built here for every writer (the labels table above, the questions
# task's records, serve's cancelled requests).
def line_key(index: int, custom_id: str | None) -> str:
    """A line's request key (its `batch_req_<key>` id): stable for the same position and custom_id."""
    return hashlib.sha256(f"{index}:{custom_id}".encode()).hexdigest()[:24]


def response_line(key: str, custom_id: str | None, body: dict) -> str:
    """An answered request's output line."""
    response = {"status_code": 200, "request_id": key, "body": body}
    return json.dumps({"id": f"batch_req_{key}", REQUEST_ID: custom_id, "response": response, "error": None},
                      ensure_ascii=False)


def error_line(key: str, custom_id: str | None, error: str, *, ascii_only: bool = False) -> str:
    """A failed request's error-file line (`error`: its RowError; the kind picks the status).
    `ascii_only`: escaped JSON, writable whatever the client sent (a lone surrogate in its id)."""
    return json.dumps({"id": f"batch_req_{key}", REQUEST_ID: custom_id, "response": error_response(key, error),
                       "error": None}, ensure_ascii=ascii_only)


def cancelled_line(custom_id: str | None, number: int, error: dict) -> str:
    """A request that never ran (the batch was cancelled first), as the Batch API writes it."""
    return json.dumps({"id": f"batch_req_line{number}", REQUEST_ID: custom_id, "response": None, "error": error},
                      ensure_ascii=False)


def line_request_id(line: dict):
    """The request id (custom_id) of a parsed input or output line."""
    return line.get(REQUEST_ID)


def _logprob(p: float, mass: float) -> float:
    """log P(label) before normalizing over the labels: the model's own log probability."""
    value = p * mass
    return max(math.log(value), MIN_LOGPROB) if value > 0 else MIN_LOGPROB


def completion_body(key: str, created: int, model: str, label: str, probs: dict[str, float], mass: float,
                    completions: bool, usage: tuple[int, int] | None = None, reply: dict | None = None) -> dict:
    """A chat completion (or text completion) whose answer is `label`, the most probable label:
    finished (`finish_reason` "stop": the label is the whole answer), every label's log probability
    in `logprobs` unless the request asked otherwise (`reply`: `{"logprobs": false}` or
    `{"top_logprobs": N}`, the N most probable labels), and `usage` when the prompt's tokens are
    known (`(prompt, cached)`: the label counts as one completion token, one answer)."""
    reply = reply or {}
    logprobs = {name: _logprob(p, mass) for name, p in probs.items()}
    ranked = sorted(logprobs, key=logprobs.get, reverse=True)[:reply.get("top_logprobs")]
    extra = {layout.BATCH_SCORES: probs, layout.LABEL_MASS: mass}
    if usage is not None:
        prompt, cached = usage
        extra["usage"] = {"prompt_tokens": prompt, "completion_tokens": 1, "total_tokens": prompt + 1,
                          "prompt_tokens_details": {"cached_tokens": cached}}
    if completions:  # /v1/completions
        choice = {"index": 0, "text": label, "finish_reason": "stop",
                  "logprobs": {"tokens": [label], "token_logprobs": [logprobs[label]], "text_offset": [0],
                               "top_logprobs": [{name: logprobs[name] for name in ranked}]}}
        return {"id": f"cmpl-{key}", "object": "text_completion", "created": created, "model": model,
                "choices": [choice], **extra}

    def entry(name: str) -> dict:
        return {"token": name, "logprob": logprobs[name], "bytes": list(name.encode("utf-8"))}

    choice = {"index": 0, "message": {"role": "assistant", "content": label, "refusal": None},
              "logprobs": {"content": [{**entry(label), "top_logprobs": [entry(n) for n in ranked]}], "refusal": None}
              if reply.get("logprobs", True) else None,
              "finish_reason": "stop"}
    return {"id": f"chatcmpl-{key}", "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], **extra}


# A failed request's HTTP status, error type and code, by its row error's kind (row_errors.py).
ERROR_STATUS = {
    TOO_LONG: (400, "invalid_request_error", "context_length_exceeded"),
    NOT_SCORED: (500, "server_error", "not_scored"),  # never scored: serve/ answers such a request as cancelled
    FAILED: (500, "server_error", "scoring_failed"),
    INPUT: (400, "invalid_request_error", "invalid_request"),
}
NOT_SCORED_CODE = ERROR_STATUS[NOT_SCORED][2]


def error_response(key: str, error: str) -> dict:
    """A failed request as the Batch API's error file holds it: the HTTP status and an error body,
    chosen by the error's kind (`error`: a RowError; a plain message is the request's own input)."""
    status, kind, code = ERROR_STATUS[kind_of(error, INPUT)]
    return {"status_code": status, "request_id": key,
            "body": {"error": {"message": str(error), "type": kind, "param": None, "code": code}}}


def read_requests(path, batch_rows: int, columns, json_columns):
    return jsonl_batches(path, batch_rows, openai_request, OPENAI_BATCH_SCHEMA, columns, field_names=FIELD_NAMES,
                         unique_keys=True)  # a body is read whole: a key twice would merge two definitions


def write_batch(table: pa.Table, path, *, id_name: str, labels: list[str], model: str = "", error_path=None,
                usage=None, row_errors=None, **_) -> None:
    """The output file and the error file (`error_path`), the error file first; each answer's
    `usage` as given (row -> (prompt tokens, cached tokens); none without it)."""
    created = int(time.time())  # one `created` for both files, written a chunk of rows at a time
    write_lines(error_path, (line for _, failed in _line_chunks(table, id_name, labels, model, created, usage,
                                                                 row_errors, answers=False) for line in failed))
    write_lines(path, (line for ok, _ in _line_chunks(table, id_name, labels, model, created, usage, row_errors)
                       for line in ok))


def job_problems(config) -> list[str]:
    """An openai_batch input: each request's body.messages (through the model's chat template) or
    body.prompt is its prompt, and its custom_id its id. An openai_batch output: fixed labels'
    probabilities normalized by their sum, one response line per request."""
    problems = []
    if config.input.format == NAME and config.input.synthetic is None:
        if config.prompt.template or config.prompt.system:
            problems.append("prompt.template / prompt.system: not used with input.format openai_batch (each "
                            "request's body.messages or body.prompt is its prompt); remove them")
        if config.input.token_ids_column is not None:
            problems.append("input.token_ids_column: not used with input.format openai_batch")
        if config.input.id_column not in (None, REQUEST_ID):
            problems.append(f"input.id_column: an openai_batch input is keyed by {REQUEST_ID}, "
                            f"got {config.input.id_column!r}")
    if config.output_format == NAME and (config.input.choices_column or config.score.normalize != "sum"):
        problems.append("output.format openai_batch: writes fixed labels' probabilities normalized by their sum; "
                        "write parquet or jsonl for input.choices_column or score.normalize token | byte")
    return problems


# A line's body is its request (no truth or kept column a job names): the file is fingerprinted whole.
OPENAI_BATCH = register(WireFormat(NAME, read=read_requests, write=write_batch, error_file=True,
                                   named_columns=False, request_id=REQUEST_ID, response_lines=True,
                                   job_problems=job_problems))
