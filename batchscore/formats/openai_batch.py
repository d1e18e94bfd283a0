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

import pyarrow as pa

from batchscore.formats.lines import write_lines
from batchscore.formats.registry import WireFormat, register
from batchscore.io.readers import jsonl_batches
from batchscore.output import layout

# The smallest log probability written (OpenAI writes -9999.0 for "practically never").
MIN_LOGPROB = -9999.0


# One request per line: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
# "body": {"model": ..., "messages": [...]}} or, for /v1/completions, "body": {"prompt": ...}.
OPENAI_BATCH_SCHEMA = pa.schema([
    ("custom_id", pa.string()), ("method", pa.string()), ("url", pa.string()), ("model", pa.string()),
    ("messages", pa.string()),  # JSON text: [{"role": ..., "content": "..."}], contents as plain text
    ("prompt", pa.string()),
    ("decision", pa.string()),  # JSON text: the body of a /v1/systemone or /v1/decisions request
])

CHAT_URLS = ("/v1/chat/completions", "/v1/completions")
FIELD_NAMES = {"messages": "body.messages", "prompt": "body.prompt", "model": "body.model"}  # in messages
DECISION_URLS = ("/v1/systemone", "/v1/decisions")


# the request columns a job keeps beside its results: each answer is shaped by its own request
ANSWER_COLUMNS = ("url", "reply")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # the Chat Completions API's message roles
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
    return row, None


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


def openai_batch_lines(table: pa.Table, id_name: str, labels: list[str], model: str,
                       created: int | None = None) -> tuple[list[str], list[str]]:
    """(output lines, error lines) of the OpenAI Batch API for the results table."""
    created = int(time.time()) if created is None else created
    column = {name: table.column(name).to_pylist() for name in
              [id_name, layout.LABEL, layout.LABEL_MASS, layout.STATUS, layout.ERROR,
               *map(layout.label_column, labels)]}
    urls = table.column("url").to_pylist() if "url" in table.column_names else [None] * table.num_rows
    approx = table.column(layout.APPROX_KEEP).to_pylist() if layout.APPROX_KEEP in table.column_names else None
    ok, failed = [], []
    for i in range(table.num_rows):
        custom_id = column[id_name][i]
        custom_id = None if custom_id is None else str(custom_id)
        key = hashlib.sha256(f"{i}:{custom_id}".encode()).hexdigest()[:24]
        if column[layout.STATUS][i] == layout.STATUS_OK:
            probs = {label: column[layout.label_column(label)][i] for label in labels}
            body = completion_body(key, created, model, column[layout.LABEL][i], probs, column[layout.LABEL_MASS][i],
                               completions=str(urls[i] or "").endswith("/v1/completions"))
            if approx is not None:
                body[layout.APPROX_KEEP] = approx[i]  # speculative prefill: the scores are approximate
            response = {"status_code": 200, "request_id": key, "body": body}
            ok.append(json.dumps({"id": f"batch_req_{key}", "custom_id": custom_id, "response": response,
                                  "error": None}, ensure_ascii=False))
        else:
            failed.append(json.dumps({"id": f"batch_req_{key}", "custom_id": custom_id,
                                      "response": error_response(key, column[layout.ERROR][i] or "not scored"),
                                      "error": None}, ensure_ascii=False))
    return ok, failed


def _logprob(p: float, mass: float) -> float:
    """log P(label) before normalizing over the labels: the model's own log probability."""
        if message["role"] not in CHAT_ROLES:  # a role is rendered into the prompt: text there forges turns
            return [], (f"message {i}: role {_short_text(message['role'])} is not one of the API's roles "
                        f"({', '.join(CHAT_ROLES)})")
    value = p * mass
    return max(math.log(value), MIN_LOGPROB) if value > 0 else MIN_LOGPROB


def completion_body(key: str, created: int, model: str, label: str, probs: dict[str, float], mass: float,
                completions: bool) -> dict:
    logprobs = {name: _logprob(p, mass) for name, p in probs.items()}
    ranked = sorted(logprobs, key=logprobs.get, reverse=True)
    extra = {layout.BATCH_SCORES: probs, layout.LABEL_MASS: mass}
    if completions:  # /v1/completions
        choice = {"index": 0, "text": label, "finish_reason": "length",
                  "logprobs": {"tokens": [label], "token_logprobs": [logprobs[label]], "text_offset": [0],
                               "top_logprobs": [{name: logprobs[name] for name in ranked}]}}
        return {"id": f"cmpl-{key}", "object": "text_completion", "created": created, "model": model,
                "choices": [choice], **extra}

    def entry(name: str) -> dict:
        return {"token": name, "logprob": logprobs[name], "bytes": list(name.encode("utf-8"))}

    choice = {"index": 0, "message": {"role": "assistant", "content": label, "refusal": None},
              "logprobs": {"content": [{**entry(label), "top_logprobs": [entry(n) for n in ranked]}], "refusal": None},
              "finish_reason": "length"}
    return {"id": f"chatcmpl-{key}", "object": "chat.completion", "created": created, "model": model,
            "choices": [choice], **extra}


def error_response(key: str, message: str) -> dict:
    """A failed request as the Batch API's error file holds it: the HTTP status and an error body."""
    if "longer than the maximum" in message:
        status, kind, code = 400, "invalid_request_error", "context_length_exceeded"
    elif message.startswith("not scored"):
        status, kind, code = 500, "server_error", "not_scored"
    else:
        status, kind, code = 400, "invalid_request_error", "invalid_request"
    return {"status_code": status, "request_id": key,
            "body": {"error": {"message": message, "type": kind, "param": None, "code": code}}}


def read_requests(path, batch_rows: int, columns, json_columns):
    return jsonl_batches(path, batch_rows, openai_request, OPENAI_BATCH_SCHEMA, columns, field_names=FIELD_NAMES,
                         unique_keys=True)  # a body is read whole: a key twice would merge two definitions


def write_batch(table: pa.Table, path, *, id_name: str, labels: list[str], model: str = "", error_path=None,
                **_) -> None:
    """The output file and the error file (`error_path`), the error file first."""
    ok, failed = openai_batch_lines(table, id_name, labels, model)
    write_lines(error_path, failed)
    write_lines(path, ok)


# A line's body is its request (no truth or kept column a job names): the file is fingerprinted whole.
OPENAI_BATCH = register(WireFormat("openai_batch", read=read_requests, write=write_batch, error_file=True,
                                   named_columns=False))
