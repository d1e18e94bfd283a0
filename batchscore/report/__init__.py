"""`batchscore report`: one self-contained HTML page about an output, optionally against a previous one.

    write_report("out/2026-01-02.parquet", previous="out/2026-01-01.parquet")

Computation lives in `stats` and `drift` (numpy only); `html` draws the plots (matplotlib,
optional: `pip install 'batchscore[report]'`) and writes the page. An output whose task has a
page of its own (task.py: a questions job's `<id>.…` columns) gets that page instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from batchscore.errors import ReportError, ReportUnavailable
from batchscore.io.storage import as_path
from batchscore.output.layout import OutputFiles
from batchscore.report.data import (ScoredOutput, find_metrics, load_metrics, load_output, metrics_candidates,
                                    read_output_table)
from batchscore.task import page_for_output

__all__ = ["write_report", "default_report_path", "require_matplotlib", "ReportError", "ReportUnavailable",
           "ScoredOutput", "load_output"]


def require_matplotlib() -> None:
    """Raise ReportUnavailable (with the install command) unless matplotlib (the plots) and scipy
    (the intervals and tests) can be imported."""
    for package, use in (("matplotlib", "draws its plots with"), ("scipy", "computes its intervals and tests with")):
        try:
            __import__(package)
        except ImportError:
            raise ReportUnavailable(f"the report {use} {package}, which is not installed: "
                                    "pip install 'batchscore[report]'") from None


def default_report_path(output: str | os.PathLike) -> Path:
    """`_<output>.report.html`, next to the output (named in output/layout.py)."""
    return OutputFiles(output).report


def write_report(output: str | os.PathLike, *, previous: str | os.PathLike | None = None,
                 metrics: str | os.PathLike | dict | None = None, html_path: str | os.PathLike | None = None,
                 id_column: str | None = None, truth: str | None = None) -> Path:
    """Write the HTML report of `output` and return its path.

    `metrics`: a `--metrics` JSON path or its dict (a RunSummary.to_dict()); when None,
    the summary in the output's completion marker, else a JSON next to the output that names it
    (see data.find_metrics).
    `previous`: an earlier output of the same job, joined by `id_column` (default: the first
    column) for the drift section. `truth`: the output's column of true labels for the quality
    section (default: the run summary's `calibration.truth_column`, when the output has it).
    Raises ReportError for unreadable inputs or a `truth` that is not a column, ReportUnavailable
    without matplotlib or scipy.
    """
    require_matplotlib()
    from batchscore.output.summary import RunSummary
    from batchscore.report.html import render, write_html
    from batchscore.report.quality import truth_column

    if isinstance(metrics, dict):
        metrics_data, note = metrics, "this run's summary"
    elif metrics is not None:
        metrics_data, note = load_metrics(metrics), str(metrics)
    else:
        metrics_data, found = find_metrics(output)
        note = str(found) if found else ("no completion marker and no metrics JSON naming this output "
                                         "next to it (looked for " + ", ".join(
                                             p.name for p in metrics_candidates(output)) + ")")
    target = as_path(html_path) if html_path is not None else default_report_path(output)
    table = read_output_table(output)
    page = page_for_output(table.column_names)
    summary = RunSummary.from_dict(metrics_data) if metrics_data is not None else None
    if page is not None:  # the task's own page (questions: one section per question)
        return write_html(page.render(as_path(output), table, summary, note, previous=previous, truth=truth),
                          target)
    current = load_output(output, id_column, table)
    before = load_output(previous, id_column or current.id_column) if previous is not None else None
    truth = truth_column(current, truth, summary)
    return write_html(render(current, before, summary, note, truth), target)
