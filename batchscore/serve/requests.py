"""A batch's input file sorted into what runs and what is answered at once.

The server checks what only it knows — the batch's endpoint, the model it serves, the labels a
chat line is scored over — and answers a line that fails those with a 400 line of its own. The
other lines go to one job per label set (`batchscore run` scores a job over one set of labels),
each job's input a copy of the file with every other line blanked, so that a message from the
reader names the same line number as the uploaded file."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from batchscore.formats.openai_batch import CHAT_URLS, REQUEST_ID, line_request_id
from batchscore.formats.openai_batch import error_line as batch_error_line
from batchscore.row_errors import INPUT, RowError
from batchscore.io.readers import lone_surrogate_field, without_bom

LABELS_KEY = "labels"  # batch metadata key: a JSON list of label texts, in a string value
CALIBRATE_KEY = "calibrate"  # batch metadata key: score.calibrate for the batch's chat/completions lines
CALIBRATION_SETS = ("score.calibrate", "calibrate.")  # --set keys that only chat/completions jobs take
TOKEN_IDS_KEY = "logprob_token_ids"  # a request's own labels, as vLLM takes them: token ids

# token ids -> (the label text of each, None) or (None, why they cannot be labels)
TokenTexts = Callable[[list[int]], tuple[list[str] | None, str | None]]


@dataclass
class JobLines:
    labels: list[str] | None  # None: decision lines, which carry their own options
    lines: set[int] = field(default_factory=set)  # 1-based line numbers of the input file


@dataclass
class SortedInput:
    total: int = 0  # requests (non-blank lines)
    jobs: list[JobLines] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)  # error-file lines written by the server itself
    problems: list[dict] = field(default_factory=list)  # batch-level errors: the batch fails


def metadata_labels(metadata: dict | None) -> list[str] | None:
    """The labels in a batch's metadata (`{"labels": "[\\"Yes\\", \\"No\\"]"}`); raises ValueError."""
    raw = (metadata or {}).get(LABELS_KEY)
    if raw is None:
        return None
    try:
        labels = json.loads(raw)
    except (TypeError, json.JSONDecodeError):
        raise ValueError(f"metadata.{LABELS_KEY}: must be a JSON list of label texts in a string, "
                         f"e.g. '[\"Yes\", \"No\"]'") from None
    if (not isinstance(labels, list) or len(labels) < 2 or len(set(labels)) != len(labels)
            or not all(isinstance(x, str) and x for x in labels)):
        raise ValueError(f"metadata.{LABELS_KEY}: must list two or more distinct non-empty label texts")
    if lone_surrogate_field(labels) is not None:
        raise ValueError(f"metadata.{LABELS_KEY}: {SURROGATE}")
    return labels


SURROGATE = "holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape without its pair), which is not text"


def metadata_calibration(metadata: dict | None, sets: list[str]) -> str | None:
    """The `calibrate` method a batch's metadata asks of its chat/completions lines (None: the
    server's). `none` and `batch` need nothing; a fitted method needs the values the server was
    started with (`--set calibrate.from=...`: a batch file holds no labelled rows). Raises ValueError."""
    method = (metadata or {}).get(CALIBRATE_KEY)
    if method is None:
        return None
    fitted = any(item.split("=", 1)[0].strip() == "calibrate.from" for item in sets)
    allowed = ["none", "batch"] + (["temperature", "vector", "platt"] if fitted else [])
    if method not in allowed:
        raise ValueError(f"metadata.{CALIBRATE_KEY}: {method!r} is not one of {', '.join(allowed)}"
                         + ("" if fitted else " (a fitted method needs a server started with --set calibrate.from=...)"))
    return method


def calibration_set(item: str) -> bool:
    """Whether a `--set KEY=VALUE` is calibration's: given to chat/completions jobs only."""
    return item.split("=", 1)[0].strip().startswith(CALIBRATION_SETS)


def sort_lines(path: Path, shown_as: str, endpoint: str, model: str | list[str], labels: list[str] | None,
               max_requests: int, token_texts: TokenTexts | None = None) -> SortedInput:
    """Read the batch's input file once and sort each request line (see the module doc). `model`:
    the names a line's `body.model` may give (`--served-model-name`, else the model's own). A chat
    line is scored over its own `logprob_token_ids` (read as label texts by `token_texts`), else
    over the batch's `labels`."""
    names = [model] if isinstance(model, str) else list(model)
    out = SortedInput()
    ids: Counter = Counter()
    first_line: dict[str, int] = {}  # custom_id -> the line it first appears on
    doubled: tuple[str, int] | None = None  # the first custom_id seen again, and that line
    jobs: dict[tuple | None, JobLines] = {}
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            raw = without_bom(raw, number)  # as `batchscore run` reads the file (io/readers.py)
            if not raw.strip():
                continue
            out.total += 1
            custom_id, problem, line_labels = _check_line(raw, endpoint, names, labels, token_texts)
            if custom_id is not None:
                ids[custom_id] += 1
                first_line.setdefault(custom_id, number)
                if ids[custom_id] == 2 and doubled is None:
                    doubled = (custom_id, number)
            if problem is not None:
                out.answered.append(error_line(custom_id, f"{shown_as}:{number}: {problem}", number))
                continue
            key = tuple(line_labels) if line_labels is not None else None
            jobs.setdefault(key, JobLines(list(key) if key else None)).lines.add(number)
    if out.total > max_requests:
        out.problems.append({"code": "too_many_requests", "line": None, "param": None,
                             "message": f"the input file has {out.total} requests; this server takes at most "
                                        f"{max_requests} per batch"})
    if doubled is not None:  # as the Batch API: the batch fails, `line` the first repeat
        custom_id, number = doubled
        out.problems.append({"code": "duplicate_custom_id", "line": number, "param": REQUEST_ID,
                             "message": f"{shown_as}:{number}: custom_id {custom_id!r} appears {ids[custom_id]} "
                                        f"times (first on line {first_line[custom_id]}); each must be unique"})
    if out.total == 0:
        out.problems.append({"code": "empty_file", "line": None, "param": None, "message": "the input file has no requests"})
    out.jobs = list(jobs.values())
    return out


def _check_line(raw: bytes, endpoint: str, names: list[str], labels: list[str] | None, token_texts: TokenTexts | None
                ) -> tuple[str | None, str | None, list[str] | None]:
    """(the line's custom_id, why the server answers it at once (None: the job reads it), the
    labels it is scored over (None: a decision line))."""
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"not valid JSON ({exc})", None
    except RecursionError:
        return None, "JSON nested too deeply to read", None
    if not isinstance(value, dict):
        return None, f"expected a JSON object, got {type(value).__name__}", None
    custom_id = line_request_id(value)
    if not isinstance(custom_id, str) or not custom_id:
        return None, "custom_id: missing or not a string", None
    if lone_surrogate_field(custom_id) is not None:  # answered under it (escaped), never run
        return custom_id, f"custom_id: {SURROGATE}", None
    url = value.get("url")
    if url != endpoint:
        return custom_id, f"url: {json.dumps(url)[:80]} is not this batch's endpoint {endpoint!r}", None
    body = value.get("body")
    if not isinstance(body, dict):
        return custom_id, "body: missing or not an object", None
    asked = body.get("model")
    if asked is not None and asked not in names:
        served = ", ".join(map(repr, names))
        return custom_id, (f"body.model: {json.dumps(asked)[:80]} is not a model this server serves ({served}; "
                           "`batchscore serve --served-model-name NAME` adds a name)"), None
    if endpoint not in CHAT_URLS:
        return custom_id, None, None
    ids = body.get(TOKEN_IDS_KEY)
    if ids is not None:
        if (not isinstance(ids, list) or len(ids) < 2 or len(set(map(repr, ids))) != len(ids)
                or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            return custom_id, f"body.{TOKEN_IDS_KEY}: must list two or more distinct token ids", None
        own, problem = token_texts(ids) if token_texts is not None else (None, "token ids cannot be read here")
        return (custom_id, f"body.{TOKEN_IDS_KEY}: {problem}", None) if problem else (custom_id, None, own)
    if labels is None:
        return custom_id, (f"no labels to score: give body.{TOKEN_IDS_KEY}, or create the batch with metadata "
                           f"{{\"{LABELS_KEY}\": \"[\\\"Yes\\\", \\\"No\\\"]\"}}"), None
    return custom_id, None, labels


def error_line(custom_id: str | None, message: str, number: int) -> str:
    """One error-file line, shaped as the job's own error lines (formats/openai_batch.py). ASCII
    JSON: whatever the client sent (a lone surrogate in its custom_id), the line can be written."""
    return batch_error_line(f"line{number}", custom_id, RowError(INPUT, message), ascii_only=True)


def write_job_input(source: Path, target: Path, lines: set[int]) -> None:
    """`source` with every line not in `lines` blank (line numbers stay those of `source`)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with source.open("rb") as src, target.open("wb") as dst:
        for number, raw in enumerate(src, start=1):
            dst.write(raw if number in lines else b"\n")


def safe_name(filename: str | None) -> str:
    """An uploaded file's name as a plain file name (no folders, no odd characters)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(filename or "").name).lstrip(".")
    return name[:100] or "input.jsonl"
