"""A batch's result lines: gathered from its jobs' output and error files, the lines of
requests a cancel kept from running (as the Batch API writes them), and the batch's usage."""

from __future__ import annotations

import json
from pathlib import Path

from batchscore.formats.openai_batch import NOT_SCORED_CODE, line_request_id
from batchscore.formats.openai_batch import cancelled_line as batch_cancelled_line

CANCELLED = {"code": "batch_cancelled", "message": "The batch was cancelled before this request ran."}


def batch_usage(ok_lines: list[str]) -> dict:
    """The batch's token usage, in the Batch API's shape: the sum of its answered lines' usage
    (a chat/completions line's `prompt_tokens`, each prompt once whatever its labels, and one
    completion token; a decision line's `input_tokens` and one output token per answer), cached
    tokens the part of each prompt another prompt of its job shares (formats/openai_batch.py)."""
    given = cached = output = 0
    for line in ok_lines:
        usage = json.loads(line)["response"]["body"].get("usage") or {}
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        given += int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0)
        cached += int(details.get("cached_tokens") or 0)
        output += int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0)
    return {"input_tokens": given, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": given + output}


def uploaded_name(work: Path) -> str:
    """The input file's name as uploaded: messages name it, not the batch's copy."""
    return (work / "filename").read_text(encoding="utf-8")


def job_lines(work: Path, jobs: int, only: Path | None = None, shown_model: str | None = None
              ) -> tuple[list[str], list[str]]:
    """(output lines, error lines) of the batch's jobs (or of the job folder `only`), error
    messages naming the uploaded file as the user named it, not the job's copy of it, and each
    answer's `model` the name the model is served as (`shown_model`, when it has one)."""
    name = uploaded_name(work)
    ok_lines, error_lines = [], []
    for folder in [only] if only is not None else [work / f"job{k}" for k in range(jobs)]:
        ok = lines(folder / "output.jsonl")
        ok_lines += ok if shown_model is None else [_shown_as(line, shown_model) for line in ok]
        copy_name = json.dumps(str(folder / "input" / name))[1:-1]  # as it is written inside a JSON string
        error_lines += [line.replace(copy_name, name) for line in lines(folder / "output.errors.jsonl")]
    return ok_lines, error_lines


def _shown_as(line: str, model: str) -> str:
    value = json.loads(line)
    body = (value.get("response") or {}).get("body")
    if not isinstance(body, dict) or body.get("model") == model:
        return line
    body["model"] = model
    return json.dumps(value, ensure_ascii=False)


def cancelled_line(custom_id: str | None, number: int) -> str:
    """A request that never ran, as the Batch API writes one of a cancelled batch."""
    return batch_cancelled_line(custom_id, number, CANCELLED)


def cancelled_if_not_run(line: str) -> str:
    """An error line of a stopped job: a row no part held never ran (cancelled: its error's code
    says it was never scored, row_errors.NOT_SCORED); others failed."""
    value = json.loads(line)
    error = ((value.get("response") or {}).get("body") or {}).get("error") or {}
    if error.get("code") != NOT_SCORED_CODE:
        return line
    return json.dumps({**value, "response": None, "error": CANCELLED}, ensure_ascii=False)


def custom_ids(source: Path, numbers: set[int]) -> list[tuple[int, str]]:
    """(line number, custom_id) of the input lines `numbers` (lines the server already checked)."""
    found = []
    with source.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if number in numbers:
                found.append((number, line_request_id(json.loads(raw))))
    return found


def lines(path: Path) -> list[str]:
    """The non-blank lines of a JSON Lines file ([] when the job wrote none)."""
    if not path.exists():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
