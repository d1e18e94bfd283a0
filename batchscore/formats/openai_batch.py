"""Output formats: the results table as Parquet, JSON Lines, or OpenAI Batch API output files.

`openai_batch` writes what the Batch API returns for a batch (one line per request, matched by
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
import os
import time

import pyarrow as pa

from batchscore.io.atomic import atomic_write
from batchscore.output import layout
from batchscore.output.table import write_parquet_atomic

# The smallest log probability written (OpenAI writes -9999.0 for "practically never").
MIN_LOGPROB = -9999.0


def write_output(table: pa.Table, path: str | os.PathLike, fmt: str, *, id_name: str, labels: list[str],
                 model: str = "", error_path: str | os.PathLike | None = None) -> None:
    """Write the results table (output/table.py) as `fmt`: parquet | jsonl | openai_batch
    (`error_path`: its failed rows' file, `OutputFiles.errors`)."""
    if fmt == "parquet":
        write_parquet_atomic(table, path)
    elif fmt == "jsonl":
        _write_lines(path, (json.dumps(row, ensure_ascii=False, default=str) for row in table.to_pylist()))
    elif fmt == "openai_batch":
        ok, failed = openai_batch_lines(table, id_name, labels, model)
        _write_lines(error_path, failed)
        _write_lines(path, ok)
    else:
        raise ValueError(f"unknown output format {fmt!r}")


def _write_lines(path, lines) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as handle:
            for line in lines:
                handle.write(line)
                handle.write("\n")

    atomic_write(path, write)


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
            body = _completion(key, created, model, column[layout.LABEL][i], probs, column[layout.LABEL_MASS][i],
                               completions=str(urls[i] or "").endswith("/v1/completions"))
            if approx is not None:
                body[layout.APPROX_KEEP] = approx[i]  # speculative prefill: the scores are approximate
            response = {"status_code": 200, "request_id": key, "body": body}
            ok.append(json.dumps({"id": f"batch_req_{key}", "custom_id": custom_id, "response": response,
                                  "error": None}, ensure_ascii=False))
        else:
            failed.append(json.dumps({"id": f"batch_req_{key}", "custom_id": custom_id,
                                      "response": _error_response(key, column[layout.ERROR][i] or "not scored"),
                                      "error": None}, ensure_ascii=False))
    return ok, failed


def _logprob(p: float, mass: float) -> float:
    """log P(label) before normalizing over the labels: the model's own log probability."""
    value = p * mass
    return max(math.log(value), MIN_LOGPROB) if value > 0 else MIN_LOGPROB


def _completion(key: str, created: int, model: str, label: str, probs: dict[str, float], mass: float,
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


def _error_response(key: str, message: str) -> dict:
    """A failed request as the Batch API's error file holds it: the HTTP status and an error body."""
    if "longer than the maximum" in message:
        status, kind, code = 400, "invalid_request_error", "context_length_exceeded"
    elif message.startswith("not scored"):
        status, kind, code = 500, "server_error", "not_scored"
    else:
        status, kind, code = 400, "invalid_request_error", "invalid_request"
    return {"status_code": status, "request_id": key,
            "body": {"error": {"message": message, "type": kind, "param": None, "code": code}}}

