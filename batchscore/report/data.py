"""Reading a batchscore output (and the `--metrics` JSON of its run) for the report."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchscore.errors import ReportError
from batchscore.io.storage import as_path, file_size
from batchscore.output import layout
from batchscore.output.layout import RESULT_COLUMNS, OutputFiles


@dataclass
class ScoredOutput:
    """One output Parquet file as plain lists and arrays (row order kept)."""

    path: Path
    id_column: str
    ids: list
    labels: list[str]  # from the p_<label> columns, in column order
    probs: dict[str, np.ndarray]  # label -> [N] P(label), NaN for error rows
    label: list[str | None]
    label_mass: np.ndarray  # [N], NaN for error rows
    ok: np.ndarray  # [N] bool, status == "ok"
    error: list[str | None]
    kept: dict[str, list] = field(default_factory=dict)  # output.keep_columns (a truth column among them)
    calibrated: dict[str, np.ndarray] = field(default_factory=dict)  # label -> [N] p_cal_<label> (score.calibrate)
    confidence: np.ndarray | None = None  # [N] the confidence column (score.confidence), NaN for error rows
    notes: list[str] = field(default_factory=list)  # lines of the file that are not label rows, said on the page

    @property
    def rows(self) -> int:
        return len(self.ids)


def load_output(path: str | os.PathLike, id_column: str | None = None, table=None) -> ScoredOutput:
    """Read an output file: Parquet, JSON Lines, or an OpenAI Batch output (with the failed rows
    from its error file next to it, `<stem>.errors.jsonl`, if there). The labels are the `p_*`
    columns just before `label` (the writer's layout); the id column is `id_column` or the first
    column; the other columns are keep columns. Raises ReportError for a missing file or one that
    is not a batchscore output. `table`: the file's table when the caller has read it already."""
    path = as_path(path)
    if table is None:
        if file_size(path) is None:
            raise ReportError(f"output not found: {path}")
        table = _read_table(path)
    names = table.column_names
    if layout.P_CHOICES in names and layout.LABEL not in names:
        raise ReportError(f"{path}: an output of per-row choices (input.choices_column); the report covers "
                          "fixed labels only")
    missing = [c for c in RESULT_COLUMNS if c not in names]
    if missing:
        raise ReportError(f"{path}: not a batchscore output, it has no column(s) {missing} "
                          f"(columns: {names})")
    label_at = names.index(layout.LABEL)
    first_p = label_at
    while first_p > 0 and layout.label_of_column(names[first_p - 1]) is not None:
        first_p -= 1
    label_columns = names[first_p:label_at]
    if not label_columns:
        raise ReportError(f"{path}: not a batchscore output, no p_<label> columns before 'label'")
    if id_column is None:
        id_column = names[0]
    elif id_column not in names:
        raise ReportError(f"--id-column {id_column!r} is not a column of {path} (columns: {names})")
    ids = table.column(id_column).to_pylist()
    present = [i for i in ids if i is not None]  # a line that could not be read has no id
    if len(set(present)) != len(present):
        raise ReportError(f"{path}: id column {id_column!r} has duplicate values; pass --id-column")

    def floats(name: str) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in table.column(name).to_pylist()], dtype=np.float64)

    labels = [layout.label_of_column(c) for c in label_columns]
    calibrated = {label: floats(layout.calibrated_column(label)) for label in labels
                  if layout.calibrated_column(label) in names}
    quality = {layout.calibrated_column(label) for label in calibrated} | (
        {layout.CONFIDENCE, layout.NEEDS_REVIEW, layout.OUT_OF_SCOPE} & set(names))  # written by batchscore, not kept
    result = set(RESULT_COLUMNS) | set(label_columns) | {id_column} | quality
    return ScoredOutput(
        path=path,
        id_column=id_column,
        ids=ids,
        labels=labels,
        probs={layout.label_of_column(c): floats(c) for c in label_columns},
        label=[None if v is None else str(v).strip() for v in table.column(layout.LABEL).to_pylist()],
        label_mass=floats(layout.LABEL_MASS),
        ok=np.array([s == layout.STATUS_OK for s in table.column(layout.STATUS).to_pylist()], dtype=bool),
        error=table.column(layout.ERROR).to_pylist(),
        kept={name: table.column(name).to_pylist() for name in names if name not in result},
        calibrated=calibrated,
        confidence=floats(layout.CONFIDENCE) if layout.CONFIDENCE in names else None,
        notes=[v.decode() for k, v in (table.schema.metadata or {}).items() if k == _NOTE_KEY],
    )


QUESTION_COLUMNS = (".status", ".error", ".label_mass", ".argmax_is_label")  # every question has these
_VALUE_SUFFIXES = (".choice", ".p_yes", ".score", ".confidence")  # and one of these (or `.p.<option>` columns)
_NOTE_KEY = b"batchscore.report_note"  # a table built here for the report: what it left out
NOT_ASKED = "not asked"  # `<id>.status` of a record whose own questions did not include this one


def question_keys(names: list[str]) -> list[str]:
    """The question ids of a questions output, in column order ([] for another output). A
    question is an `<id>.status` column with at least one more of its columns; one missing some of
    QUESTION_COLUMNS is still a question (`missing_question_columns` says which), so it is reported,
    not dropped. A kept input column such as `order.status` alone makes no question."""
    present = set(names)
    keys = []
    for name in names:
        if not name.endswith(".status") or name == "status":
            continue
        key = name[: -len(".status")]
        own = [f"{key}{s}" for s in QUESTION_COLUMNS[1:] + _VALUE_SUFFIXES]
        if any(c in present for c in own) or any(n.startswith(f"{key}.p.") for n in names):
            keys.append(key)
    return keys


def missing_question_columns(names: list[str], key: str) -> list[str]:
    """The columns every question has (QUESTION_COLUMNS) that question `key` lacks."""
    present = set(names)
    return [f"{key}{s}" for s in QUESTION_COLUMNS if f"{key}{s}" not in present]


def answers_table(records: list[tuple[object, dict | None, str | None]], id_name: str = "custom_id"):
    """The questions table layout (`<id>.…` columns, output/decisions.py) of answered decision
    records, so the questions page reads decision batch lines and per-row questions alike.
    records: (id, answers keyed by question id (System One) or a list with `name`s (OpenAI
    Decisions), the record's error or None). A question a record was not asked has status
    NOT_ASKED; one answered with {"error": …} is that question's error."""
    import pyarrow as pa

    columns: dict[str, list] = {}
    rows = len(records)

    def put(name: str, index: int, value) -> None:
        columns.setdefault(name, [None] * rows)[index] = value

    for index, (_, answers, _) in enumerate(records):
        for key, answer in _answers_by_key(answers).items():
            put(f"{key}.status", index, "ok")
            if not isinstance(answer, dict) or "error" in answer:
                put(f"{key}.status", index, "error")
                put(f"{key}.error", index, str(answer.get("error") if isinstance(answer, dict) else answer))
                continue
            kind = answer.get("type")
            if kind == "choice":
                put(f"{key}.choice", index, answer.get("choice"))
            elif kind in ("noul", "predicate"):
                put(f"{key}.p_yes", index, answer.get("noul", answer.get("probability")))
            else:
                put(f"{key}.score", index, answer.get("score"))
            for option, p in _probabilities(answer):
                put(f"{key}.p.{option}", index, p)
            put(f"{key}.confidence", index, answer.get("confidence"))
            put(f"{key}.label_mass", index, answer.get("x_label_mass"))
            put(f"{key}.argmax_is_label", index, answer.get("x_argmax_is_label"))
    keys = [n[: -len(".status")] for n in columns if n.endswith(".status")]  # in order of first appearance
    for key in keys:
        for suffix in QUESTION_COLUMNS:
            columns.setdefault(f"{key}{suffix}", [None] * rows)
        asked = [key in _answers_by_key(answers) for _, answers, _ in records]
        # a record that failed whole (its error) leaves the question null, as in a questions table
        columns[f"{key}.status"] = [status if was_asked else None if error else NOT_ASKED
                                    for status, was_asked, (_, _, error) in zip(columns[f"{key}.status"], asked, records)]
    table = {id_name: [None if r[0] is None else str(r[0]) for r in records]}
    for key in keys:
        table.update((name, values) for name, values in columns.items() if name.startswith(f"{key}."))
    failed = [error is not None or any(table[f"{k}.status"][i] == "error" for k in keys)
              for i, (_, _, error) in enumerate(records)]
    table["status"] = ["error" if f else "ok" for f in failed]
    table["error"] = [error for _, _, error in records]
    return pa.table({name: pa.array(values) for name, values in table.items()})


def _answers_by_key(answers) -> dict[str, object]:
    if isinstance(answers, dict):
        return {str(k): v for k, v in answers.items()}
    if isinstance(answers, list):
        return {str(a.get("name", i)) if isinstance(a, dict) else str(i): a for i, a in enumerate(answers)}
    return {}


def _probabilities(answer: dict) -> list[tuple[str, float]]:
    """(option, probability) pairs: a System One map, or OpenAI's list of {value, probability}."""
    probs = answer.get("probabilities")
    if isinstance(probs, dict):
        return [(str(k), v) for k, v in probs.items()]
    if isinstance(probs, list):
        return [(str(p.get("value")), p.get("probability")) for p in probs if isinstance(p, dict)]
    return []


def read_output_table(path: str | os.PathLike):
    """The output's table (Parquet, JSON Lines or an OpenAI Batch output with its error file).
    Raises ReportError for a missing or unreadable file."""
    path = as_path(path)
    if file_size(path) is None:
        raise ReportError(f"output not found: {path}")
    return _read_table(path)


def _read_table(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with path.open("rb") as handle:
        parquet = handle.read(4) == b"PAR1"
    try:
        if parquet:
            with path.open("rb") as handle:
                return _with_row_answers(pq.read_table(handle))
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ReportError(f"{path}: not a readable Parquet or JSON Lines file ({exc})") from None
    if rows and isinstance(rows[0], dict) and {"custom_id", "response"} <= set(rows[0]):
        return _openai_batch_table(path, rows)
    try:
        return _with_row_answers(pa.Table.from_pylist(rows))
    except (pa.ArrowException, TypeError) as exc:
        raise ReportError(f"{path}: JSON lines that do not form one table ({exc})") from None


def _openai_batch_table(path: Path, rows: list[dict]):
    """An OpenAI Batch output (formats/openai_batch.py) and its error file as the writer's table layout."""
    import pyarrow as pa

    errors_file = path.with_name(layout.default_error_path(path.name))
    failed = [json.loads(line) for line in errors_file.read_text(encoding="utf-8").splitlines()
              if line.strip()] if file_size(errors_file) is not None else []
    decisions = [r for r in rows if _answers_of(r) is not None]  # decision lines: answered questions
    rows = [r for r in rows if _answers_of(r) is None]
    labels = list(next((((r.get("response") or {}).get("body") or {}).get(layout.BATCH_SCORES, {}) for r in rows), {}))
    if not labels and decisions:  # decision lines alone: the questions page reads them
        return answers_table([(r.get("custom_id"), _answers_of(r), None) for r in decisions]
                             + [(r.get("custom_id"), None, _error_of(r)) for r in failed])
    if not labels:
        raise ReportError(f"{path}: an OpenAI Batch output without batchscore's scores (not written by batchscore)")
    columns: dict[str, list] = {"custom_id": [], **{layout.label_column(label): [] for label in labels},
                                **{name: [] for name in RESULT_COLUMNS}}
    for row in rows + failed:
        body = (row.get("response") or {}).get("body") or {}
        ok = (row.get("response") or {}).get("status_code") == 200 and layout.BATCH_SCORES in body
        columns["custom_id"].append(row.get("custom_id"))
        for label in labels:
            columns[layout.label_column(label)].append(body[layout.BATCH_SCORES].get(label) if ok else None)
        choice = (body.get("choices") or [{}])[0] if ok else {}
        columns[layout.LABEL].append((choice.get("message") or {}).get("content", choice.get("text")) if ok else None)
        columns[layout.LABEL_MASS].append(body.get(layout.LABEL_MASS) if ok else None)
        columns[layout.STATUS].append(layout.STATUS_OK if ok else layout.STATUS_ERROR)
        columns[layout.ERROR].append(None if ok else _error_of(row))
    table = pa.table(columns)
    if decisions:  # answered, not failed: said on the page, not counted as errors of the label rows
        note = (f"{len(decisions):,} decision line(s) with answered questions are not label rows and are left out "
                "of this page (their answers are in the output)")
        table = table.replace_schema_metadata({_NOTE_KEY: note.encode()})
    return table


def _answers_of(row: dict):
    """A decision line's answers (System One map or OpenAI Decisions list), else None."""
    response = row.get("response") or {}
    body = response.get("body") or {}
    answers = body.get("answers") if response.get("status_code") == 200 and isinstance(body, dict) else None
    return answers if isinstance(answers, (dict, list)) else None


def _error_of(row: dict) -> str:
    body = (row.get("response") or {}).get("body") or {}
    return (body.get("error") or {}).get("message") or (row.get("error") or {}).get("message") or "failed"


def _with_row_answers(table):
    """A table of per-row questions (`input.questions_column`: each row's answers as JSON in the
    `answers` column, and no fixed question columns) in the questions layout; other tables as they are."""
    from batchscore.output.decision_files import ANSWERS

    names = table.column_names
    if ANSWERS not in names or question_keys(names) or layout.STATUS not in names:
        return table
    records = []
    for row_id, text, error in zip(table.column(names[0]).to_pylist(), table.column(ANSWERS).to_pylist(),
                                   table.column(layout.ERROR).to_pylist() if layout.ERROR in names
                                   else [None] * table.num_rows):
        if text is None:  # the record failed as a whole
            records.append((row_id, None, error or "failed"))
            continue
        try:
            answers = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            answers = None
        if not isinstance(answers, dict):
            return table  # not answers that batchscore wrote: leave the table to the labels reader's checks
        records.append((row_id, answers, None if answers else error))
    return answers_table(records, id_name=names[0])


def metrics_candidates(output: str | os.PathLike) -> list[Path]:
    """Where a run's `--metrics` JSON is looked for next to its output: `<stem>.json`,
    `<output>.metrics.json`, `<stem>.metrics.json` and `metrics.json` (the Airflow DAG's name)."""
    output = as_path(output)
    stem = output.with_suffix("")
    return [stem.with_name(stem.name + ".json"), output.with_name(output.name + ".metrics.json"),
            stem.with_name(stem.name + ".metrics.json"), output.with_name("metrics.json")]


def find_metrics(output: str | os.PathLike) -> tuple[dict | None, Path | None]:
    """The summary of `output`'s run: the one its completion marker recorded (when the output is
    unchanged since), else the first metrics JSON candidate that names this output's file."""
    from batchscore.output.parts import recorded_summary

    files = OutputFiles(output)
    recorded = recorded_summary(files)
    if recorded is not None:
        return recorded, files.marker
    name = as_path(output).name
    for candidate in metrics_candidates(output):
        try:
            data = json.loads(candidate.read_text())
        except (OSError, ValueError):
            continue
        # Only a summary of this output's run: a folder may hold other runs' JSON files.
        if isinstance(data, dict) and Path(str(data.get("output_path", ""))).name == name:
            return data, candidate
    return None, None


def load_metrics(path: str | os.PathLike) -> dict:
    """Read a `--metrics` JSON given explicitly; raises ReportError when it is not one."""
    path = as_path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(f"--metrics {path}: cannot read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ReportError(f"--metrics {path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or "rows" not in data or "seconds" not in data:
        raise ReportError(f"--metrics {path}: not a batchscore run summary (no 'rows' and 'seconds')")
    return data
