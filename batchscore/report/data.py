"""Reading a batchscore output (and the `--metrics` JSON of its run) for the report."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from batchscore.errors import ReportError
from batchscore.io.storage import as_path, file_size
from batchscore.output import column_names, layout, partitioned
from batchscore.output.layout import RESULT_COLUMNS, OutputFiles
from batchscore.task import pages


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
        if file_size(path) is None and not partitioned.is_partitioned(path):
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
    # the run's own diagnostics (logp_<label>, output.top_token's columns, approx_keep) are not kept input columns
    diagnostics = {layout.logp_column(label) for label in labels} | set(layout.TOP_COLUMNS) | {layout.APPROX_KEEP}
    result = set(RESULT_COLUMNS) | set(label_columns) | {id_column} | quality | (diagnostics & set(names))
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


_NOTE_KEY = b"batchscore.report_note"  # a table built here for the report: what it left out


def read_output_table(path: str | os.PathLike):
    """The output's table (Parquet, JSON Lines or an OpenAI Batch output with its error file).
    Raises ReportError for a missing or unreadable file."""
    path = as_path(path)
    if file_size(path) is None and not partitioned.is_partitioned(path):
        raise ReportError(f"output not found: {path}")
    return _read_table(path)


def _read_table(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from batchscore.formats.registry import format_of_path, get_format

    # a format that reads its outputs back (Parquet, a registered CSV format); a folder: partitioned Parquet
    wire = get_format("parquet") if partitioned.is_partitioned(path) else format_of_path(path)
    if wire is not None and wire.read_output is not None:
        try:
            return _in_page_layout(wire.read_output(path))
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ReportError(f"{path}: not a readable {wire.name} file ({exc})") from None
    with path.open("rb") as handle:
        parquet = handle.read(4) == b"PAR1"
    try:
        if parquet:
            with path.open("rb") as handle:
                return _in_page_layout(pq.read_table(handle))
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ReportError(f"{path}: not a readable Parquet or JSON Lines file ({exc})") from None
    if rows and isinstance(rows[0], dict) and {"custom_id", "response"} <= set(rows[0]):
        return _openai_batch_table(path, rows)
    try:
        return _in_page_layout(pa.Table.from_pylist(rows))
    except (pa.ArrowException, TypeError) as exc:
        raise ReportError(f"{path}: JSON lines that do not form one table ({exc})") from None


def _openai_batch_table(path: Path, rows: list[dict]):
    """An OpenAI Batch output (formats/openai_batch.py) and its error file as the writer's table layout."""
    import pyarrow as pa

    errors_file = path.with_name(layout.default_error_path(path.name))
    failed = [json.loads(line) for line in errors_file.read_text(encoding="utf-8").splitlines()
              if line.strip()] if file_size(errors_file) is not None else []
    page = next((p for p in pages() if any(p.owns_line(r) for r in rows)), None)  # another task's lines
    own = [r for r in rows if page is not None and page.owns_line(r)]
    rows = [r for r in rows if page is None or not page.owns_line(r)]
    labels = list(next((((r.get("response") or {}).get("body") or {}).get(layout.BATCH_SCORES, {}) for r in rows), {}))
    if not labels and own:  # that task's lines alone: its page reads them
        return page.lines_table(own, [(r.get("custom_id"), _error_of(r)) for r in failed])
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
    if own:  # answered, not failed: said on the page, not counted as errors of the label rows
        table = table.replace_schema_metadata({_NOTE_KEY: page.lines_left_out(len(own)).encode()})
    return table


def _in_page_layout(table):
    """The output's table in the layout its task's page reads (task.py; e.g. a questions job's
    per-row answers spread into question columns); a labels output as it is, its label columns
    named by their labels (output.column_names: slug writes them by their slugs)."""
    table = column_names.as_read(table)
    for page in pages():
        table = page.table(table)
    return table


def _error_of(row: dict) -> str:
    body = (row.get("response") or {}).get("body") or {}
    return (body.get("error") or {}).get("message") or (row.get("error") or {}).get("message") or "failed"


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
